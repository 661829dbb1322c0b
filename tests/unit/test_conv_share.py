"""benchmarks/conv_share.py without a GPU: its checks on CPU tensors (the reference conv standing in
for vLLM's, cudelta's reference step for the step), and its table from given medians."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import conv_share  # noqa: E402
import mtp_bench  # noqa: E402
import mtp_report as report  # noqa: E402


@pytest.fixture
def small_heads_on_cpu(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(mtp_bench, "DEVICE", "cpu")
    for name in ("H", "HV", "CONV_BYTES"):  # set_heads and ConvCell rebind them: restored after
        monkeypatch.setattr(mtp_bench, name, getattr(mtp_bench, name))
    mtp_bench.set_heads(2, 4)


def reference_conv(spoil=None):
    """cudelta's reference with vLLM's causal_conv1d_update keywords and bf16 products, optionally
    spoiled after."""
    import torch
    from cudelta.conv_reference import causal_conv1d_update_reference

    def conv(x, conv_state, weight, bias, activation, *, conv_state_indices, num_accepted_tokens, query_start_loc,
             max_query_len, out):
        before = conv_state.clone()
        causal_conv1d_update_reference(x, conv_state, weight, bias, activation, conv_state_indices, query_start_loc,
                                       num_accepted_tokens, out=out, round_products_to=torch.bfloat16)
        if spoil is not None:
            spoil(conv_state, before, out)
        return out

    return conv


def checks(conv, B=2, T=3, step=None):
    from cudelta import vllm_compat

    cc = conv_share.ConvCell("bfloat16", B, T, seed=7)
    result = {"checks": [], "skips": []}
    calls = conv_share.cell_calls(cc, conv, {report.CUDELTA: step or vllm_compat.fused_gdn_decode_post_conv_mtp})
    assert list(calls) == ["conv", "cudelta", "conv+cudelta"]
    timed = conv_share.check_cell(cc, calls, result)
    assert not result["skips"] and timed == set(calls)
    return {c["impl"]: c for c in result["checks"]}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_the_conv_and_the_pair_agree_with_the_reference_chain():
    got = checks(reference_conv())
    assert set(got) == {"conv", "conv+cudelta"}  # a step alone is mtp_bench's to check
    assert all(c["ok"] for c in got.values()), got
    # The pages hold the conv state for T - 1 drafts ahead of the recurrent state.
    assert mtp_bench.CONV_BYTES == (4 - 1 + 3 - 1) * (2 * 2 * 128 + 4 * 128) * 2


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_a_window_not_advanced_a_wrong_output_and_a_stray_write_are_named():
    def keep_window(state, before, out):
        state.copy_(before)

    got = checks(reference_conv(keep_window))
    assert not got["conv"]["ok"] and "a conv state byte differs" in got["conv"]["detail"]
    assert not got["conv+cudelta"]["ok"]

    def nudge(state, before, out):
        out[0, 3] += 1.0

    got = checks(reference_conv(nudge))
    assert got["conv"]["detail"].startswith("conv out max |Δ|")
    # the pair is named by its conv; its step is checked on the conv outputs it was given, and is right
    assert got["conv+cudelta"]["detail"] == got["conv"]["detail"]

    def touch_next_slot(state, before, out):
        state[-1] += 1.0  # a spare slot no request names

    got = checks(reference_conv(touch_next_slot))
    assert "a conv state byte differs" in got["conv"]["detail"]


def test_the_table_prints_the_pair_ratio_and_the_conv_share():
    med = {("bfloat16", 1, 2, "conv"): 3.0, ("bfloat16", 1, 2, "vllm-cuda"): 8.0, ("bfloat16", 1, 2, "cudelta"): 6.0,
           ("bfloat16", 1, 2, "conv+vllm-cuda"): 12.0, ("bfloat16", 1, 2, "conv+cudelta"): 8.0}
    text = conv_share.render(med, {("bfloat16", 1, 2, "conv+cudelta")}, ["bfloat16"], [1], [2], "HEADER", ["NOTE"])
    assert "| 1 | 3.0 / — · 8.0 / 6.0 · 12.0 / 8.0 ✗ / — / — · 1.50x / — / — → 2.00x · 25% |" in text
    assert "- bfloat16: the conv is 25-25% of vLLM's pair; vLLM's pair ÷ cudelta's 1.50-1.50x" in text
    assert ("- bfloat16, B <= 8: the pair at >= 1.5x vLLM's in 1 of 1 cells; with the conv fused at no cost in 1 of 1 "
            "(ceilings 2.00-2.00x)") in text
    assert text.startswith("HEADER") and text.rstrip().endswith("NOTE")
    # a cell without its pair prints dashes, and no summary claims a number it lacks
    text = conv_share.render({("bfloat16", 4, 1, "conv"): 2.0}, set(), ["bfloat16"], [4], [1], "H", [])
    assert "| 4 | 2.0 / — · — / — · — / — / — / — · — / — / — → — · — |" in text and "the conv is" not in text
    assert "own pair (its conv" not in text and "own pair in one call" not in text
    # pairs timed at B <= 8 but no step alone (its run skipped): no ceiling claimed, and no crash on it
    med = {("bfloat16", 1, 2, "conv"): 3.0, ("bfloat16", 1, 2, "conv+vllm-cuda"): 12.0,
           ("bfloat16", 1, 2, "conv+cudelta"): 8.0}
    text = conv_share.render(med, set(), ["bfloat16"], [1], [2], "H", [])
    assert "- bfloat16, B <= 8: the pair at >= 1.5x vLLM's in 1 of 1 cells\n" in text and "ceilings" not in text
    # vLLM's pair timed but not cudelta's (its check skipped): the conv's share alone, no ratio claimed
    med = {("bfloat16", 1, 2, "conv"): 3.0, ("bfloat16", 1, 2, "conv+vllm-cuda"): 12.0}
    text = conv_share.render(med, set(), ["bfloat16"], [1], [2], "H", [])
    assert "- bfloat16: the conv is 25-25% of vLLM's pair\n" in text and "B <= 8" not in text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_a_wrong_step_after_a_right_conv_is_named():
    from cudelta import vllm_compat

    def step_off_by_a_little(*args):
        vllm_compat.fused_gdn_decode_post_conv_mtp(*args)
        args[8][args[5][0, 0]] *= 1.05  # the state stored after request 0's first token

    got = checks(reference_conv(), step=step_off_by_a_little)
    assert got["conv"]["ok"]
    assert not got["conv+cudelta"]["ok"] and got["conv+cudelta"]["detail"].startswith("state max |Δ|")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_a_pair_whose_check_could_not_run_is_not_timed_nor_its_step():
    from cudelta import vllm_compat

    cc = conv_share.ConvCell("bfloat16", 2, 2, seed=7)
    result = {"checks": [], "skips": []}

    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory")

    calls = conv_share.cell_calls(cc, reference_conv(), {report.CUDELTA: vllm_compat.fused_gdn_decode_post_conv_mtp,
                                                          report.VLLM_CUDA: out_of_memory})
    assert conv_share.check_cell(cc, calls, result) == {"conv", "cudelta", "conv+cudelta"}
    assert [s["impl"] for s in result["skips"]] == ["conv+vllm-cuda"]


def test_a_saved_run_renders_again_with_medians_over_its_processes(tmp_path, monkeypatch):
    import json

    for name in ("H", "HV", "CONV_BYTES"):
        monkeypatch.setattr(mtp_bench, name, getattr(mtp_bench, name))

    def proc(conv_us):
        times = [dict(state="bfloat16", B=8, T=2, impl=i, us=u, mode="graph")
                 for i, u in (("conv", conv_us), ("vllm-cuda", 9.0), ("cudelta", 7.5), ("conv+vllm-cuda", 12.0),
                              ("conv+cudelta", 10.0))]
        checks = [dict(state="bfloat16", B=8, T=2, impl=i, ok=True) for i in ("conv", "conv+vllm-cuda", "conv+cudelta")]
        return dict(device="GPU X", times=times, skips=[], checks=checks, reasons={})

    dump = dict(heads=[4, 8], procs=3, seconds=50, dram_mib=256, states=["bfloat16"], batches=[8], tokens=[2],
                processes=[proc(2.0), proc(3.0), proc(2.6)])
    path = tmp_path / "conv-4-8.json"
    path.write_text(json.dumps(dump))
    text = conv_share.render_dump(path)
    assert text.startswith("vLLM's MTP layer step, conv then step (H=4, HV=8, K=V=128, conv width 4 over 2048 channels")
    assert "GPU X; median of 3 of 3 processes, 50 s" in text
    assert "| 8 | 2.6 / — · 9.0 / 7.5 · 12.0 / 10.0 / — / — · 1.20x / — / — → 1.60x · 22% |" in text
    assert "Checks: 9 of 9 agree" in text and "largest 38.5%" in text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_a_pair_whose_conv_does_not_reproduce_its_conv_alone_is_named():
    calls = []

    def third_call_differs(state, before, out):
        calls.append(1)
        if len(calls) == 3:  # the conv's check, the pair's reference run, then the pair itself
            out[0, 3] += 0.25

    got = checks(reference_conv(third_call_differs))
    assert got["conv"]["ok"]
    assert "the pair's conv outputs differ from its conv's alone" in got["conv+cudelta"]["detail"]


def test_the_table_prints_cudeltas_own_pair_beside_vllms():
    med = {("bfloat16", 1, 2, "conv"): 3.0, ("bfloat16", 1, 2, "cudelta-conv"): 2.0, ("bfloat16", 1, 2, "vllm-cuda"): 8.0,
           ("bfloat16", 1, 2, "cudelta"): 6.0, ("bfloat16", 1, 2, "conv+vllm-cuda"): 12.0,
           ("bfloat16", 1, 2, "conv+cudelta"): 9.0, ("bfloat16", 1, 2, "cudelta-conv+cudelta"): 7.5,
           ("bfloat16", 1, 2, "cudelta-one-call"): 6.0,
           ("bfloat16", 32, 2, "conv+vllm-cuda"): 30.0, ("bfloat16", 32, 2, "cudelta-conv+cudelta"): 25.0,
           ("bfloat16", 32, 2, "cudelta-one-call"): 31.0}
    text = conv_share.render(med, set(), ["bfloat16"], [1, 32], [2], "HEADER", [])
    assert "| 1 | 3.0 / 2.0 · 8.0 / 6.0 · 12.0 / 9.0 / 7.5 / 6.0 · 1.33x / 1.60x / 2.00x → 2.00x · 25% |" in text
    assert ("- bfloat16: cudelta's own pair (its conv, then its step) 1.20-1.60x vLLM's pair, slower in 0 of 2 "
            "cells; at B <= 8 >= 1.5x in 1 of 1 cells") in text
    # a cell where it is slower than vLLM's pair is counted, not hidden in the range
    assert ("- bfloat16: cudelta's own pair in one call 0.97-2.00x vLLM's pair, slower in 1 of 2 cells; at B <= 8 "
            ">= 1.5x in 1 of 1 cells") in text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_cudeltas_conv_and_its_pair_are_checked_against_the_fp32_products():
    from cudelta import vllm_compat

    cc = conv_share.ConvCell("bfloat16", 2, 3, seed=7)
    result = {"checks": [], "skips": []}
    calls = conv_share.cell_calls(cc, reference_conv(), {report.CUDELTA: vllm_compat.fused_gdn_decode_post_conv_mtp},
                                  own_conv=vllm_compat.causal_conv1d_update,
                                  own_one_call=vllm_compat.conv_then_gdn_decode_post_conv_mtp)
    assert list(calls) == ["conv", "cudelta", "conv+cudelta", "cudelta-conv", "cudelta-conv+cudelta", "cudelta-one-call"]
    assert conv_share.check_cell(cc, calls, result) == set(calls)
    got = {c["impl"]: c for c in result["checks"]}
    assert all(c["ok"] for c in got.values()), got
    # vLLM's bf16 products against the fp32 reference would be off by more than an ulp somewhere:
    # each conv is held to its own reference, not the other's.
    calls = conv_share.cell_calls(cc, vllm_compat.causal_conv1d_update,
                                  {report.CUDELTA: vllm_compat.fused_gdn_decode_post_conv_mtp})
    result = {"checks": [], "skips": []}
    conv_share.check_cell(cc, calls, result)
    assert result["checks"][0]["impl"] == "conv"
