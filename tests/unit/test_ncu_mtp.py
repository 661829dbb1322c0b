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
    assert seen == [(("float32", 4, 2, 6, "", "", "random"), 4, 8)]


def test_the_slot_order_reaches_the_process_ncu_profiles(default_heads, monkeypatch):
    command = ncu_mtp.workload_command(("bfloat16", 32, 1), 4, "op.so", "", "consecutive")
    assert command[command.index("--slots") + 1] == "consecutive"
    seen = []
    monkeypatch.setattr(ncu_mtp, "workload", lambda *args: seen.append(args))
    monkeypatch.setattr(sys, "argv", ["ncu_mtp.py", *command[command.index("--workload"):]])
    assert ncu_mtp.main() == 0
    assert seen == [("bfloat16", 32, 1, 4, "op.so", "", "consecutive")]


def test_a_slot_order_it_does_not_know_is_refused_naming_the_orders(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ncu_mtp.py", "--workload", "bfloat16:32:1", "--slots", "sorted"])
    with pytest.raises(SystemExit):
        ncu_mtp.main()
    err = capsys.readouterr().err
    assert "'sorted'" in err and "random" in err and "consecutive" in err


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


def test_the_phase_table_gives_each_kernel_its_path_before_in_and_after_the_loop():
    import ncu_source

    kernel = "void cudelta::<unnamed>::decode_mtp_stream_kernel<(bool)1, (int)128>(cudelta::GdnDecodeParams)"
    prof = ncu_source.SourceProfile(kernel, launches=1, instructions=["LDG", "FFMA", "FFMA", "STG"],
                                    samples=[6.0, 2.0, 1.0, 1.0], executed=[32.0, 64.0, 64.0, 32.0])
    prof.instruction_reasons = [ncu_source.Counter(long_sb=6), ncu_source.Counter(wait=2),
                                ncu_source.Counter(wait=1), ncu_source.Counter(membar=1)]
    row, = ncu_mtp.phase_rows("bfloat16 B=1 T=2", "cudelta", 2, {kernel: prof})
    assert row == ("| bfloat16 B=1 T=2 | cudelta | decode_mtp_stream_kernel | 1 · 60% · long_sb 100 | "
                   "4 · 30% · wait 100 | 1 · 10% · membar 100 |")
