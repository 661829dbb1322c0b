"""`python -m cudelta` on a machine without a GPU: a report, not a traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


def test_json_report_without_gpu_or_native_library():
    proc = subprocess.run([sys.executable, "-m", "cudelta", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["native"]["loaded"] is False
    assert "pure-Python" in report["native"]["reason"]
    assert report["torch"]["cuda_available"] is False and report["gpus"] == []


def test_text_report_says_what_is_missing():
    proc = subprocess.run([sys.executable, "-m", "cudelta"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "native  not loaded" in proc.stdout and "0 GPU(s)" in proc.stdout
