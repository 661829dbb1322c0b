"""benchmarks/fp8_bench.py without a GPU: its dry run (cudelta's calls on CPU tensors, the
reference's FP8 output, the check, the table), the check stopping a call that rounds with another
scale, and the allowance of one e4m3 step."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_bench as fb  # noqa: E402

DRY = ["--device", "cpu", "--dram-mib", "4", "--heads", "4/8", "--states", "bfloat16", "--batches", "1",
       "--tokens", "1", "3"]


@pytest.fixture(autouse=True)
def restore_bench_globals():
    saved = (fb.bench.DEVICE, fb.bench.DRAM_BYTES, fb.bench.H, fb.bench.HV, fb.bench.CONV_BYTES)
    yield
    fb.bench.DEVICE, fb.bench.DRAM_BYTES, fb.bench.H, fb.bench.HV, fb.bench.CONV_BYTES = saved


def test_the_dry_run_checks_and_times_cudelta_s_calls_and_says_why_vllm_is_missing(capsys):
    assert fb.main(DRY) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "vLLM MTP + quant: not loaded (the CPU dry run)" in lines[0] and "heads 4/8" in lines[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[3:]]
    assert [r[:3] for r in rows] == [["bfloat16", "1", "1"], ["bfloat16", "1", "3"]]
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) > 0 and r[5:8] == ["-", "-", "-"]


def test_a_call_that_rounds_with_another_scale_is_stopped_before_timing(monkeypatch):
    real = fb.calls

    def twice_the_scale(cell, vllm_mtp, vllm_t1, scale, out8):
        return real(cell, vllm_mtp, vllm_t1, scale * 2, out8)

    monkeypatch.setattr(fb, "calls", twice_the_scale)
    with pytest.raises(SystemExit, match=r"bfloat16 B=1 T=1: cudelta fp8: out max \|Δ\| \S+ \(\S+x its tolerance\)"):
        fb.main(DRY)


def test_one_e4m3_step_is_allowed_and_two_are_not():
    e = torch.tensor([1.0, 448.0, 2.0 ** -9]).to(torch.float8_e4m3fn)
    one = torch.tensor([1.125, 416.0, 2.0 ** -8]).to(torch.float8_e4m3fn)  # the next value down or up
    two = torch.tensor([1.25, 384.0, 2.0 ** -9]).to(torch.float8_e4m3fn)
    assert fb.fp8_excess(one, e) == (32.0, 1.0)  # 448 -> 416 is 32 of an allowance of 448 / 8 = 56; 2^-8 -> 2^-9 is 2^-9 of 2^-9
    assert fb.fp8_excess(two, e)[1] > 1
    assert fb.fp8_excess(torch.tensor([float("nan")]).to(torch.float8_e4m3fn), e[:1]) == (float("inf"), float("inf"))


def test_the_row_reads_the_faster_vllm_flow_over_cudelta_and_the_fp8_output_s_cost():
    row = dict(state="float32", B=8, T=1, us={fb.CUDELTA_BF16: 10.0, fb.CUDELTA_FP8: 10.5, fb.VLLM_MTP: 21.0,
                                              fb.VLLM_T1: 15.75})
    assert fb.row_text(row) == "| float32 | 8 | 1 | 10.0 | 10.5 | 21.0 | 15.8 | 1.50x | +0.5 |"
    del row["us"][fb.VLLM_T1]
    assert fb.row_text(row).endswith("| 21.0 | - | 2.00x | +0.5 |")
