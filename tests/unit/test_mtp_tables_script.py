"""benchmarks/mtp_tables.sh, the one device call behind the results files' tables: what comes back
under $OUT and its exit status, when a head shape or the GPU tests fail and when STOP_AFTER cuts
the call short. A slip there costs device time, so it is pinned here with `nvidia-smi` and
`python3` replaced on PATH (the build, pytest and mtp_bench.py become shims that write what the
real ones would)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The fake python3: `-m pip install ... --target DIR .` makes DIR/cudelta; `-m pytest` prints a
# summary and exits FAKE_TESTS_RC; `benchmarks/mtp_bench.py --heads H/HV ... --out PATH` writes the
# tables and their .json, or fails for the shapes in FAKE_FAIL_HEADS (no files), sleeping
# FAKE_BENCH_S first.
FAKE_PYTHON = r"""#!/usr/bin/env bash
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --target) mkdir -p "${args[i + 1]}/cudelta" ;;
    --heads) heads=${args[i + 1]} ;;
    --out) out=${args[i + 1]} ;;
  esac
done
case " $* " in
  *" pip install "*) exit 0 ;;
  *" pytest "*) echo "3 passed in 0.1s"; exit "${FAKE_TESTS_RC:-0}" ;;
  *mtp_bench.py*)
    sleep "${FAKE_BENCH_S:-0}"
    case " ${FAKE_FAIL_HEADS:-} " in *" $heads "*) echo "mtp_bench: no process produced results" >&2; exit 1 ;; esac
    printf '%s\n' "MTP decode step ($heads)" "- never slower than vLLM's CUDA op: met in all 48 cells" > "$out"
    echo "{\"heads\": \"$heads\"}" > "${out%.md}.json"
    exit 0 ;;
esac
echo "fake python3: unexpected call: $*" >&2
exit 9
"""


def run_tables(tmp_path: Path, heads: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    (shims / "python3").write_text(FAKE_PYTHON)
    (shims / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    out = tmp_path / "out"
    full_env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "OUT": str(out), "TMPDIR": str(tmp_path),
                "HEADS": heads, **env}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "mtp_tables.sh")], cwd=ROOT, env=full_env,
                            capture_output=True, text=True, timeout=120)
    return result, out


def archived(out: Path) -> dict[str, dict]:
    with tarfile.open(out / "numbers.tar.gz") as tar:
        return {m.name: json.load(tar.extractfile(m)) for m in tar.getmembers()}


def test_every_shape_s_tables_come_back_with_their_numbers_in_one_archive(tmp_path):
    result, out = run_tables(tmp_path, "16/32 4/8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mtp-16-32.md", "mtp-4-8.md", "numbers.tar.gz", "tests.txt"]
    assert archived(out) == {"mtp-16-32.json": {"heads": "16/32"}, "mtp-4-8.json": {"heads": "4/8"}}
    assert "tests rc=0" in result.stdout and result.stdout.count("- never slower") == 2


def test_a_shape_that_fails_fails_the_call_and_the_others_still_come_back(tmp_path):
    result, out = run_tables(tmp_path, "16/32 4/8 32/32", TESTS="none", FAKE_FAIL_HEADS="4/8")
    assert result.returncode == 1
    assert "mtp 4/8 rc=1" in result.stdout and "no process produced results" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["mtp-16-32.md", "mtp-32-32.md", "numbers.tar.gz"]
    assert set(archived(out)) == {"mtp-16-32.json", "mtp-32-32.json"}


def test_failing_gpu_tests_fail_the_call_but_the_tables_are_still_made(tmp_path):
    result, out = run_tables(tmp_path, "16/32", FAKE_TESTS_RC="1")
    assert result.returncode == 1
    assert "tests rc=1" in result.stdout and (out / "tests.txt").read_text().strip() == "3 passed in 0.1s"
    assert (out / "mtp-16-32.md").exists()


def test_stop_after_starts_no_shape_past_it(tmp_path):
    # The script counts whole seconds of `date`: the first shape's check reads 0 or 1 (a second may
    # turn over during the build), the second's at least 2 after a 2.1 s shape, so a limit of 1 s
    # lets exactly one start whichever way the seconds fall.
    result, out = run_tables(tmp_path, "16/32 4/8 32/32", TESTS="none", STOP_AFTER="1", FAKE_BENCH_S="2.1")
    assert result.returncode == 0, result.stderr
    assert "stopped before 4/8 (STOP_AFTER)" in result.stdout
    assert set(archived(out)) == {"mtp-16-32.json"}
