"""On a real GPU (marker `gpu`): the epilogue's FP8 output (output_scale, vLLM's Qwen3.5 static-FP8
out_proj input), rounded in the kernels' final store (store_out, kernels/mtp_common.cuh). Each call
runs twice from the same inputs and pool, with and without the scale: the FP8 output must be, byte
for byte, cudelta.reference.static_fp8 of the unscaled output (which mtp_cases checks against the
float64 loop), and the pool's whole allocation must be written alike; also at scales across the
float range (1 / scale is kernels/mtp_common.cuh's reciprocal_rn there). Then the same under
torch.compile(fullgraph=True) and in a CUDA graph whose scale changes between replays (a static
scale is a tensor, read on the device), and the op's own refusals of an FP8 out without a scale
and a scale without the epilogue."""

import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cudelta._call import DecodeCall  # noqa: E402
from cudelta.ops import run_kernel  # noqa: E402

from test_gdn_decode_gpu import native_loaded  # noqa: E402, F401  (autouse, per module)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/mtp_cases.py
import mtp_cases as mc  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
DEVICE = "cuda"


@pytest.mark.parametrize("case", mc.FP8_OUTPUT, ids=mc.case_id)
def test_the_fp8_output_is_the_checked_output_rounded_as_the_reference_rounds(case):
    mc.check_fp8_output(case, DEVICE)


@pytest.mark.parametrize("share, case", mc.FP8_FEW_TOKEN, ids=lambda x: f"{x}sms" if isinstance(x, float) else mc.case_id(x))
def test_the_few_token_kernel_s_fp8_builds_round_as_the_reference_rounds(share, case):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    case = mc.sized_for(share, case, sms)
    columns = 3 if case.tokens == "T3" else 2
    assert mc.takes_the_few_token_kernel(case.N * case.H * case.group, sms, case.state == "fp32", columns)
    mc.check_fp8_output(case, DEVICE)
    step, scale = mc.build(case, DEVICE), torch.tensor([0.02], device=DEVICE)
    names = mc.kernels_launched(lambda: mc.fp8_call(case, step.t, step.state, scale, None))
    assert len(names) == 1 and re.search(r"decode_vk_few_kernel<[^>]*, true, false>", names[0]), names


@pytest.mark.parametrize("scale", mc.FP8_SCALES, ids=[repr(s) for s in mc.FP8_SCALES])
def test_every_scale_rounds_as_the_reference_rounds(scale):
    mc.check_fp8_scale(scale, DEVICE)


def test_compile_fullgraph_with_the_fp8_output_equals_eager():
    case = mc.Case(seed=910)
    eager, compiled = mc.build(case, DEVICE), mc.build(case, DEVICE)
    scale = torch.tensor([0.05], device=DEVICE)
    out = torch.empty(eager.t["v"].shape, device=DEVICE).to(torch.float8_e4m3fn)

    def step(t, state, scale):
        return mc.fp8_call(case, t, state, scale, None)

    got = torch.compile(step, fullgraph=True)(compiled.t, compiled.state, scale)
    expected = mc.fp8_call(case, eager.t, eager.state, scale, out)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(compiled.storage, eager.storage)


def test_a_cuda_graph_reads_the_scale_at_each_replay():
    case = mc.Case(seed=920)
    static = mc.build(case, DEVICE)
    scale = torch.tensor([0.05], device=DEVICE)
    out = torch.empty(static.t["v"].shape, device=DEVICE).to(torch.float8_e4m3fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, on a pool of its own
        warm = mc.build(case, DEVICE)
        mc.fp8_call(case, warm.t, warm.state, scale, torch.empty_like(out))
    torch.cuda.current_stream().wait_stream(side)
    start = static.storage.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mc.fp8_call(case, static.t, static.state, scale, out)
    for value in (0.05, 0.5):
        static.storage.copy_(start)
        scale.fill_(value)
        graph.replay()
        eager = mc.build(case, DEVICE)
        expected = mc.fp8_call(case, eager.t, eager.state, torch.tensor([value], device=DEVICE), None)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), value
        assert torch.equal(static.storage, eager.storage)


# (what the op is given, its message): run_kernel hands the op a call the Python checks never saw.
OP_REFUSALS = [
    ("an FP8 out without the scale", dict(), "fp8", r"out must have v's dtype bfloat16, got float8_e4m3fn \(an FP8 "
     r"out needs output_scale\)"),
    ("a v-dtype out with the scale", dict(output_scale="scale"), "v", r"out must be float8_e4m3fn with output_scale "
     r"\(the FP8 output\), got bfloat16"),
    ("the scale without the epilogue", dict(output_scale="scale", output_gate=None, norm_weight=None,
                                           gate_activation=None, norm_eps=None), "fp8",
     r"output_scale quantizes the gated RMSNorm epilogue's output to FP8: pass output_gate and norm_weight too"),
    ("a bf16 scale", dict(output_scale="bf16 scale"), "fp8",
     r"output_scale must be a float32 tensor of one element, got bfloat16 \[1\]"),
]


@pytest.mark.parametrize("what,options,out_dtype,message", OP_REFUSALS, ids=[r[0] for r in OP_REFUSALS])
def test_the_op_refuses_a_bad_fp8_output_by_name_and_writes_nothing(what, options, out_dtype, message):
    case = mc.Case(tokens="T2", slots="ckpt", seed=930)
    step = mc.build(case, DEVICE)
    before = step.storage.clone()
    args, kw = mc.call_args(case, step.t, None)
    kw.pop("out")
    scales = {"scale": torch.tensor([0.1], device=DEVICE),
              "bf16 scale": torch.tensor([0.1], device=DEVICE, dtype=torch.bfloat16)}
    kw.update({k: scales[v] if k == "output_scale" else v for k, v in options.items()})
    q, k, v, g, beta = args
    call = DecodeCall(case.kind, q, k, v, g, beta, step.state, step.t["idx"], **kw)
    out = torch.zeros(v.shape, device=DEVICE, dtype=torch.float8_e4m3fn if out_dtype == "fp8" else v.dtype)
    with pytest.raises(RuntimeError, match=message):
        run_kernel(call, out)
    torch.cuda.synchronize()
    assert torch.equal(step.storage, before) and not out.view(torch.uint8).any()
