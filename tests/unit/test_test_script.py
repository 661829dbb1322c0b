"""scripts/test.sh checks free disk before it installs anything: a full disk once turned a CI run
into 159 unrelated ENOSPC errors. `df` and `python3` are replaced on PATH so the check can be
driven both ways without filling a disk or building a venv."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAST_THE_CHECK = 3  # the fake python3's exit status: the script got to making its venv


def run_suite_script(tmp_path: Path, free_kib: int, cached_cuda_venv: bool) -> subprocess.CompletedProcess:
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "df").write_text(
        "#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
        f"echo '/dev/vda 264241152 1 {free_kib} 99% /'\n")
    (shims / "python3").write_text(f"#!/bin/sh\necho past the disk check\nexit {PAST_THE_CHECK}\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    cache = tmp_path / "cache"
    if cached_cuda_venv:
        python = cache / "venvs" / "cu-py3.11" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("")
        python.chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "CUDELTA_TEST_CACHE": str(cache),
           "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(ROOT / "scripts" / "test.sh")], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("cached_cuda_venv, need_gb", [(False, 11), (True, 3)])
def test_too_little_disk_stops_the_suite_before_any_install_and_says_how_much(tmp_path, cached_cuda_venv, need_gb):
    result = run_suite_script(tmp_path, free_kib=(need_gb - 1) * 1048576, cached_cuda_venv=cached_cuda_venv)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "past the disk check" not in result.stdout
    assert f"{need_gb - 1} GB free" in result.stderr and f"needs about {need_gb} GB" in result.stderr
    assert "TMPDIR" in result.stderr  # the way out is named
    assert not (tmp_path / "cache" / "venvs" / "runner").exists()


@pytest.mark.parametrize("cached_cuda_venv, need_gb", [(False, 11), (True, 3)])
def test_enough_disk_goes_on_to_the_install(tmp_path, cached_cuda_venv, need_gb):
    result = run_suite_script(tmp_path, free_kib=need_gb * 1048576, cached_cuda_venv=cached_cuda_venv)
    assert result.returncode == PAST_THE_CHECK, result.stderr
    assert "past the disk check" in result.stdout
