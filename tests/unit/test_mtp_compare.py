"""benchmarks/mtp_compare.py: full runs of mtp_bench.py side by side, the targets counted per head
shape for each run and the cells where cudelta's time moved against a base run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mtp_compare as c  # noqa: E402

BF16 = "bfloat16"


def process(cudelta_us: dict, vllm_us: dict, t1_us: float = 5.0, copy_us: dict | None = None) -> dict:
    """One process's numbers over B 1 and 64, T 1 and 4 (B·T >= 256 only at B=64 T=4)."""
    times = []
    for (B, T), us in cudelta_us.items():
        times.append(dict(state=BF16, B=B, T=T, impl="cudelta", us=us))
        times.append(dict(state=BF16, B=B, T=T, impl="vllm-cuda", us=vllm_us[B, T]))
        if copy_us:
            times.append(dict(state=BF16, B=B, T=T, impl="copy", us=copy_us[B, T]))
        if T == 1:
            times.append(dict(state=BF16, B=B, T=T, impl="cudelta-t1", us=t1_us))
    return {"device": "NVIDIA H100 80GB HBM3", "copy_GBps": 3000.0, "times": times, "skips": [], "checks": []}


VLLM = {(1, 1): 6.0, (1, 4): 8.0, (64, 1): 40.0, (64, 4): 100.0}
COPY = {(1, 1): 2.0, (1, 4): 3.0, (64, 1): 30.0, (64, 4): 90.0}


def write_run(folder: Path, heads: tuple[int, int], cudelta_us: dict, procs: int = 3, **kw) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    dump = {"args": {"states": [BF16], "batches": [1, 64], "tokens": [1, 4], "heads": list(heads)},
            "processes": [process(cudelta_us, VLLM, copy_us=COPY, **kw) for _ in range(procs)]}
    (folder / f"mtp-{heads[0]}-{heads[1]}.json").write_text(json.dumps(dump))
    return folder


OLD = {(1, 1): 5.0, (1, 4): 8.4, (64, 1): 38.0, (64, 4): 96.0}  # B=1 T=4 slower than vLLM's 8.0
NEW = {(1, 1): 4.0, (1, 4): 7.9, (64, 1): 38.5, (64, 4): 99.0}  # B=1 1.5x at T=1; B=64 T=4 3.1% slower


def test_the_targets_are_counted_per_head_shape_run_after_run(tmp_path):
    a = c.load_run(write_run(tmp_path / "a", (16, 32), OLD))
    b = c.load_run(write_run(tmp_path / "b", (16, 32), NEW, t1_us=3.9))
    table = c.targets_table([a, b]).splitlines()
    assert table[0] == ("| heads | never slower | >= 1.5x at B <= 8 | >= 93% of copy at B·T >= 256 | "
                        "T=1 epilogue within 5% |")
    # old: B=1 T=4 slower; 1.5x nowhere; copy 90/96 = 94%; T=1 +0% at B=1 (5.0 vs 5.0), B=64 +660%
    # new: never slower everywhere; 1.5x at B=1 T=1; copy 90/99 = 91%; T=1 within 5% at B=1 (4.0 vs 3.9)
    assert table[2] == "| 16/32 | 3 / 4 of 4 | 0 / 1 of 2 | 1 / 0 of 1 | 1 / 1 of 2 |"


def test_a_cell_moved_only_when_every_run_moved_it_past_the_threshold_the_same_way(tmp_path):
    base = c.load_run(write_run(tmp_path / "base", (4, 8), OLD))
    again = {**NEW, (64, 1): 36.0}  # B=64 T=1: 1.3% slower in one run, 5.3% faster in the other
    runs = [c.load_run(write_run(tmp_path / "r1", (4, 8), NEW)), c.load_run(write_run(tmp_path / "r2", (4, 8), again))]
    moved = {(m.B, m.T): m for m in c.moved_cells(base, runs)}
    assert sorted(moved) == [(1, 1), (1, 4), (64, 4)]
    assert moved[1, 1].run_us == (4.0, 4.0) and moved[1, 1].base_ratio == pytest.approx(1.2)
    assert moved[64, 4].run_ratio == (pytest.approx(100 / 99), pytest.approx(100 / 99))
    assert [(m.B, m.T) for m in c.moved_cells(base, runs, threshold=0.1)] == [(1, 1)]
    row = c.moved_table([moved[1, 4]]).splitlines()[2]
    assert row == ("| 4/8 | bf16 | 1 | 4 | 8.4 -> 7.9 / 7.9 | 0.940 / 0.940 | 8.0 -> 8.0 / 8.0 | "
                   "0.95x -> 1.01x / 1.01x |")


def test_a_head_shape_missing_from_a_run_is_left_out_not_a_crash(tmp_path):
    write_run(tmp_path / "a", (16, 32), OLD)
    write_run(tmp_path / "a", (4, 8), OLD)
    b = c.load_run(write_run(tmp_path / "b", (4, 8), NEW))
    a = c.load_run(tmp_path / "a")
    assert [line.split(" | ")[0] for line in c.targets_table([a, b]).splitlines()[2:]] == ["| 4/8"]
    assert {m.heads for m in c.moved_cells(a, [b])} == {(4, 8)}


def test_the_command_line_prints_both_and_refuses_a_folder_without_numbers(tmp_path):
    write_run(tmp_path / "base", (16, 32), OLD)
    write_run(tmp_path / "new", (16, 32), NEW)
    script = str(Path(c.__file__))
    done = subprocess.run([sys.executable, script, str(tmp_path / "new"), "--base", str(tmp_path / "base")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "| 16/32 | 4 of 4 |" in done.stdout
    assert "against the base in every run: 2 faster, 1 slower" in done.stdout
    (tmp_path / "empty").mkdir()
    done = subprocess.run([sys.executable, script, str(tmp_path / "empty")], capture_output=True, text=True)
    assert done.returncode == 2 and "no mtp-*.json" in done.stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "mtp-4-8.json").write_text('{"args": {}}')
    done = subprocess.run([sys.executable, script, str(tmp_path / "broken")], capture_output=True, text=True)
    assert done.returncode == 2 and "mtp-4-8.json: not mtp_bench.py's numbers (KeyError: 'heads')" in done.stderr
    done = subprocess.run([sys.executable, script, str(tmp_path / "new"), "--threshold", "3"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "--threshold 3.0: a share between 0 and 1" in done.stderr


def test_a_base_also_named_as_a_run_is_refused_since_no_cell_could_move(tmp_path):
    write_run(tmp_path / "base", (16, 32), OLD)
    write_run(tmp_path / "new", (16, 32), NEW)
    script = str(Path(c.__file__))
    done = subprocess.run([sys.executable, script, str(tmp_path / "new"), str(tmp_path / "base" / "."), "--base",
                           str(tmp_path / "base")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert f"--base {tmp_path / 'base'} is also one of the runs" in done.stderr


def test_the_ratio_table_of_one_head_shape_puts_cudelta_s_time_in_its_corners(tmp_path):
    run = c.load_run(write_run(tmp_path / "a", (16, 32), {**NEW, (64, 4): 125.0}))
    assert c.ratio_table(run[16, 32]).splitlines() == [
        "| B | bf16 state, T=1 | T=4 |", "| --- | --- | --- |",
        "| 1 | 1.50x (4.0 µs) | 1.01x (7.9 µs) |",
        "| 64 | 1.04x (38.5 µs) | 0.80x (125 µs) |"]


def test_the_command_line_prints_the_ratios_asked_for_and_names_the_heads_it_has(tmp_path):
    write_run(tmp_path / "new", (16, 32), NEW)
    script = str(Path(c.__file__))
    done = subprocess.run([sys.executable, script, str(tmp_path / "new"), "--ratios", "16/32"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("| 64 | 1.04x (38.5 µs) | 1.01x (99.0 µs) |")
    done = subprocess.run([sys.executable, script, str(tmp_path / "new"), "--ratios", "4/8"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and done.stdout == "" and "--ratios 4/8: not in" in done.stderr
    assert "(it has 16/32)" in done.stderr
    done = subprocess.run([sys.executable, script, str(tmp_path / "new"), "--ratios", "16"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "'16': heads as H/HV, e.g. 16/32" in done.stderr
