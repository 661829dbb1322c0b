"""benchmarks/ncu_mtp.py profiles the head shape it is given: the process ncu runs (--workload) is
told the shape, and builds its cells at it."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mtp_bench  # noqa: E402
import ncu_mtp  # noqa: E402


@pytest.fixture
def default_heads():
    shape = (mtp_bench.H, mtp_bench.HV)
    yield shape
    mtp_bench.set_heads(*shape)


def test_the_workload_command_carries_the_head_shape(default_heads):
    mtp_bench.set_heads(4, 8)
    command = ncu_mtp.workload_command(("bfloat16", 1, 8), 8, "op.so", "")
    assert command[command.index("--heads") + 1] == "4/8"
    assert command[command.index("--workload") + 1] == "bfloat16:1:8"


def test_the_workload_process_builds_its_cells_at_that_shape(default_heads, monkeypatch):
    seen = []
    monkeypatch.setattr(ncu_mtp, "workload", lambda *args: seen.append((args, mtp_bench.H, mtp_bench.HV)))
    monkeypatch.setattr(sys, "argv", ["ncu_mtp.py", "--workload", "float32:4:2", "--calls", "6", "--heads", "4/8"])
    assert ncu_mtp.main() == 0
    assert seen == [(("float32", 4, 2, 6, "", ""), 4, 8)]


def test_without_heads_the_shape_is_qwen35s(default_heads, monkeypatch):
    assert default_heads == (16, 32)
    seen = []
    monkeypatch.setattr(ncu_mtp, "workload", lambda *args: seen.append((mtp_bench.H, mtp_bench.HV)))
    monkeypatch.setattr(sys, "argv", ["ncu_mtp.py", "--workload", "bfloat16:1:2"])
    assert ncu_mtp.main() == 0
    assert seen == [(16, 32)]


def test_a_shape_vllms_op_cannot_take_is_refused(default_heads, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ncu_mtp.py", "--workload", "bfloat16:1:2", "--heads", "4/6"])
    with pytest.raises(SystemExit):
        ncu_mtp.main()
    assert "HV must be a positive multiple of H" in capsys.readouterr().err
