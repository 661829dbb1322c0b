"""The epilogue's FP8 output (output_scale): vLLM's Qwen3.5 static-FP8 out_proj input. The epilogue's
output, rounded to v's dtype, times 1 / scale in fp32, clamped to +-448, rounded to the nearest e4m3
value; checked here against that rounding written out in float64, and its argument errors named."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import cudelta  # noqa: E402
from cudelta.reference import gdn_decode_reference, kda_decode_reference  # noqa: E402
from decode_loop import random_pool, token_inputs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/mtp_cases.py
import mtp_cases as mc  # noqa: E402

P = 8
IDX = torch.tensor([[1, 2, 3], [4, 5, 6], [7, -1, 0], [-1, -1, -1]])  # the last request has no starting slot
LENS = [2, 1, 3, 2]


def e4m3_by_hand(x: torch.Tensor) -> torch.Tensor:
    """float64 values (already clamped to +-448) rounded to the nearest e4m3fn value, ties to even: 3
    mantissa bits, normals from 2^-6, subnormals 2^-9 apart below it."""
    mag = x.abs()
    e = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag)))).clamp(min=-6)
    step = torch.exp2(e - 3)
    return torch.round(x / step) * step  # x / step is exact (a power of two); torch.round ties to even


def fp8_by_hand(o: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM's order on the epilogue's output o (in its dtype): 1 / scale rounded to fp32, the product
    rounded to fp32 (exact in float64 first: 8 + 24 bits), clamped, rounded to e4m3."""
    inverse = float(torch.tensor(1.0 / scale, dtype=torch.float64).float())
    product = (o.double() * inverse).float().double()
    return e4m3_by_hand(product.clamp(-448.0, 448.0))


def call(decode, t, state, **options):
    return decode(t["q"], t["k"], t["v"], t["g"], t["beta"], state, IDX, cu_seqlens=t["cu_seqlens"],
                  output_gate=t["z"], norm_weight=t["w"], **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("scale", [0.02, 0.3, 1e-3], ids=["scale0.02", "scale0.3", "saturating"])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_fp8_output_is_the_epilogue_output_scaled_clamped_and_rounded_to_e4m3(dtype, scale, activation):
    t = token_inputs(LENS, dtype=dtype, seed=40)
    state = random_pool(P, 4, 64, 64)
    plain = call(gdn_decode_reference, t, state.clone(), gate_activation=activation)
    fp8_state = state.clone()
    q8 = call(gdn_decode_reference, t, fp8_state, gate_activation=activation,
              output_scale=torch.tensor([scale]))
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == plain.shape
    assert torch.equal(q8.double(), fp8_by_hand(plain, scale))
    # The state is the step's, whatever the output's dtype.
    expected_state = state.clone()
    call(gdn_decode_reference, t, expected_state, gate_activation=activation)
    assert torch.equal(fp8_state, expected_state)
    if scale == 1e-3:  # outputs of about 1 over a scale of 1e-3 reach the clamp, never e4m3fn's NaN
        assert q8.double().abs().max() == 448.0 and not q8.double().isnan().any()
    cu = t["cu_seqlens"]
    assert torch.all(q8[cu[3]:cu[4]].double() == 0)  # no starting slot: zero, as without the scale


@pytest.mark.parametrize("decode", [cudelta.gdn_decode, gdn_decode_reference], ids=["public", "reference"])
def test_an_fp8_out_buffer_is_written_and_returned(decode):
    t = token_inputs(LENS, dtype=torch.bfloat16, seed=41)
    state = random_pool(P, 4, 64, 64)
    scale = torch.tensor([0.05])
    expected = call(gdn_decode_reference, t, state.clone(), output_scale=scale)
    out = torch.full(t["v"].shape, float("nan")).to(torch.float8_e4m3fn)
    got = call(decode, t, state, output_scale=scale, out=out)
    assert got is out
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def test_kda_takes_the_fp8_output_alike():
    t = token_inputs(LENS, kda=True, dtype=torch.bfloat16, seed=42)
    state = random_pool(P, 4, 64, 64)
    plain = call(kda_decode_reference, t, state.clone())
    q8 = call(cudelta.kda_decode, t, state, output_scale=torch.tensor([0.1]))
    assert torch.equal(q8.double(), fp8_by_hand(plain, 0.1))


def test_the_by_hand_rounding_is_e4m3fn_s():
    # The test's own rounding against the values e4m3fn holds: every finite byte, each value's
    # midpoints with its neighbours (ties go to the even mantissa), and the subnormals.
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    values = values[values.isfinite()].unique()
    assert torch.equal(e4m3_by_hand(values), values)
    mids = (values[1:] + values[:-1]) / 2
    below, above = values[:-1], values[1:]
    even = torch.where((below.abs().to(torch.float8_e4m3fn).view(torch.uint8) % 2) == 0, below, above)
    assert torch.equal(e4m3_by_hand(mids), even)
    assert torch.equal(mids.to(torch.float8_e4m3fn).double(), even)


@pytest.mark.parametrize("case", mc.FP8_OUTPUT, ids=mc.case_id)
def test_the_gpu_suite_s_fp8_cases_pass_on_cpu_tensors(case):
    # tests/gpu/test_fp8_output_gpu.py's check, with the reference in the kernels' place
    mc.check_fp8_output(case, "cpu")


# The few-token FP8 cases at the SM counts of an A100, an H100 / H200 and a B200: a case whose
# inputs skip every row at some GPU's N tests no FP8 store there (check_fp8_output's last assertion);
# found here, on CPU, not on that GPU.
@pytest.mark.parametrize("sms", [108, 132, 148])
@pytest.mark.parametrize("share, case", mc.FP8_FEW_TOKEN, ids=lambda x: f"{x}sms" if isinstance(x, float) else mc.case_id(x))
def test_the_gpu_suite_s_few_token_fp8_cases_pass_on_cpu_tensors(share, case, sms):
    mc.check_fp8_output(mc.sized_for(share, case, sms), "cpu")


@pytest.mark.parametrize("scale", mc.FP8_SCALES, ids=[repr(s) for s in mc.FP8_SCALES])
def test_the_gpu_suite_s_scales_pass_on_cpu_tensors(scale):
    mc.check_fp8_scale(scale, "cpu")


def test_a_scale_of_zero_saturates_the_outputs_and_skipped_rows_stay_zero_bytes():
    t = token_inputs(LENS, dtype=torch.bfloat16, seed=44)
    q8 = call(gdn_decode_reference, t, random_pool(P, 4, 64, 64), output_scale=torch.tensor([0.0]))
    cu = t["cu_seqlens"]
    assert torch.all(q8[:cu[3]].double().abs() == 448.0)
    assert not q8[cu[3]:cu[4]].view(torch.uint8).any()


# (what is wrong, options beyond the epilogue's output_gate and norm_weight, the message)
BAD = [
    ("a scale without the epilogue", dict(output_scale="torch.tensor([1.0])", output_gate=None, norm_weight=None),
     r"output_scale quantizes the gated RMSNorm epilogue's output to FP8: pass output_gate and norm_weight too"),
    ("a Python float", dict(output_scale=0.5),
     r"output_scale must be a float32 tensor of one element \(a static per-tensor FP8 scale, as vLLM's\); got 0.5"),
    ("a bf16 scale", dict(output_scale="torch.tensor([1.0], dtype=torch.bfloat16)"),
     r"output_scale must be a float32 tensor of one element .*; got torch.bfloat16 \(1,\)"),
    ("a scale per head", dict(output_scale="torch.ones(4)"),
     r"output_scale must be a float32 tensor of one element .*; got torch.float32 \(4,\)"),
    ("a bf16 out with the scale", dict(output_scale="torch.tensor([1.0])", out="torch.empty(8, 4, 64)"),
     r"out must be a torch.float8_e4m3fn tensor of shape \[8, 4, 64\] \(output_scale is given: the output is "
     r"FP8\); got torch.float32 \(8, 4, 64\)"),
    ("an FP8 out without the scale", dict(out="torch.empty(8, 4, 64).to(torch.float8_e4m3fn)"),
     r"out must be a torch.float32 tensor of shape \[8, 4, 64\] \(an FP8 out needs output_scale\); got "
     r"torch.float8_e4m3fn \(8, 4, 64\)"),
    ("an FP8 out of the wrong shape", dict(output_scale="torch.tensor([1.0])",
                                           out="torch.empty(8, 4, 32).to(torch.float8_e4m3fn)"),
     r"out must be a torch.float8_e4m3fn tensor of shape \[8, 4, 64\] .*; got torch.float8_e4m3fn \(8, 4, 32\)"),
]


@pytest.mark.parametrize("decode", [cudelta.gdn_decode, gdn_decode_reference], ids=["public", "reference"])
@pytest.mark.parametrize("what,options,message", BAD, ids=[c[0] for c in BAD])
def test_a_bad_fp8_output_argument_is_named_and_nothing_is_written(decode, what, options, message):
    t = token_inputs(LENS, seed=43)
    state = random_pool(P, 4, 64, 64)
    before = state.clone()
    options = {k: eval(v, {"torch": torch}) if isinstance(v, str) else v for k, v in options.items()}  # noqa: S307
    epilogue = dict(output_gate=t["z"], norm_weight=t["w"])
    epilogue.update({k: options.pop(k) for k in ("output_gate", "norm_weight") if k in options})
    with pytest.raises(ValueError, match=message):
        decode(t["q"], t["k"], t["v"], t["g"], t["beta"], state, IDX, cu_seqlens=t["cu_seqlens"], **epilogue,
               **options)
    assert torch.equal(state, before)
