"""On a real GPU (marker `gpu`): cudelta.vllm_compat.fused_kda_decode, the drop-in for vLLM 0.33's Kimi
K3 KDA decode op (its conv, then the KDA step with the bounded gate and the gated RMSNorm), against
its PyTorch reference on the same pages (every byte of vLLM's pages: outputs, recurrent and conv
state, the null block, slots not named, padding), against an independent float64 model
(tests/kda_cases.py), and against vLLM's own op where its library was carried
(.peers/cuda_op, benchmarks/fetch_vllm_ops.py); in a CUDA graph and under torch.compile. And
cudelta.kda_decode's bounded gate on each kernel path: one token a request (kv and vk layouts) and
several tokens with a checkpoint per token."""

import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # kda_cases.py
sys.path.insert(0, str(ROOT / "benchmarks"))  # mtp_bench's loader of vLLM's library
import kda_cases as kc  # noqa: E402
from test_gdn_decode_gpu import native_loaded  # noqa: E402, F401  (autouse, per module)

import cudelta  # noqa: E402
from cudelta import vllm_compat  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# The conv's outputs reach the step rounded to bf16 (cudelta and its reference; vLLM's fused op may keep
# them in fp32), and a one-ulp flip of q, k or v (the kernel's fast SiLU beside torch's) moves the state
# and the normalised output by about 2^-8 of their scale: measured up to 0.006 of states of magnitude ~1
# (to the reference) and 0.011 (to vLLM's op). (rtol, fraction of the largest |expected|).
TOL_OUT = (1 / 64, 1 / 128)
TOL_STATE = (1 / 128, 1 / 128)


def close(got, want, tol):
    want = want.float()
    torch.testing.assert_close(got.float(), want, rtol=tol[0], atol=tol[1] * float(want.abs().max()) + 1e-6)


def assert_out(got, want):
    close(got, want, TOL_OUT)


def twin(args, pages, copy):
    """The same call's arguments with conv_state and state rebuilt as views of `copy` (of `pages`)."""
    other = dict(args)
    for name in ("conv_state", "state"):
        t = args[name]
        offset = (t.data_ptr() - pages.data_ptr()) // t.element_size()
        other[name] = torch.as_strided(copy.view(-1).view(t.dtype), t.shape, t.stride(), offset)
    return other


def run_pair(args, pages, fn_a, fn_b):
    """fn_a on the pages, fn_b on a copy: (out_a, out_b, pages_a, pages_b)."""
    copy = pages.clone()
    other = twin(args, pages, copy)
    out_a = fn_a(**args)
    out_b = fn_b(**other)
    torch.cuda.synchronize()
    return out_a, out_b, pages, copy


CASES = [
    # B, H, layout, lower_bound, epilogue, bias
    (1, 12, "SD", -5.0, True, False),
    (5, 2, "DS", -5.0, True, True),
    (40, 4, "SD", None, True, False),
    (7, 12, "SD", -1.5, False, True),  # SD pages with a bias: the conv's fp32-taps vector build
    (130, 1, "DS", None, False, True),
]


@pytest.mark.parametrize("B, H, layout, lower_bound, epilogue, bias", CASES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_drop_in_matches_its_reference_on_vllm_s_pages(B, H, layout, lower_bound, epilogue, bias, state_dtype):
    slots = B + 6
    idx = torch.randperm(slots - 1, generator=torch.Generator().manual_seed(B))[:B].to(torch.int32) + 1
    if B > 2:
        idx[1], idx[-1] = 0, -1  # vLLM's null block and padding slot: skipped, zero outputs
    args, pages = kc.kimi_call(B, H, slots, seed=B * 7 + H, layout=layout, epilogue=epilogue, lower_bound=lower_bound,
                               bias=bias, state_dtype=state_dtype, device="cuda", idx=idx)
    before = pages.clone()
    out, ref, got_pages, ref_pages = run_pair(args, pages, vllm_compat.fused_kda_decode,
                                              vllm_compat.fused_kda_decode_reference)
    assert_out(out, ref)
    if B > 2:
        assert torch.equal(out[0, [1, B - 1]], torch.zeros_like(out[0, [1, B - 1]]))
    named = torch.zeros(slots, dtype=torch.bool, device="cuda")
    named[idx[idx > 0].long()] = True
    assert torch.equal(got_pages[~named], before[~named])  # null block, slots not named: bit-identical
    st, rst = args["state"], twin(args, pages, ref_pages)["state"]
    close(st[named], rst[named], TOL_STATE)
    cs, rcs = args["conv_state"], twin(args, pages, ref_pages)["conv_state"]
    assert torch.equal(cs[named], rcs[named])  # the window holds copies of bf16 inputs
    # Padding after the state in each page, and the bytes between conv state and state: untouched.
    conv_bytes = 3 * 3 * H * kc.D * 2
    block = H * kc.D * kc.D * st.element_size()
    assert torch.equal(got_pages[:, conv_bytes + block:], before[:, conv_bytes + block:])


def test_the_drop_in_matches_the_float64_model():
    idx = torch.tensor([3, 0, 1], dtype=torch.int32)
    args, _ = kc.kimi_call(3, 2, 5, seed=11, device="cuda", idx=idx)
    want_out, want_conv, want_state = kc.kimi_model(args)
    out = vllm_compat.fused_kda_decode(**args)
    assert_out(out.cpu().double(), want_out)
    close(args["state"].cpu().double(), want_state, TOL_STATE)
    assert torch.equal(args["conv_state"].cpu().double(), want_conv)


@pytest.fixture(scope="module")
def vllm_kda_op():
    import mtp_bench

    archive = mtp_bench.cuda_op_archive(None)
    if archive is None:
        pytest.skip("vLLM's library was not carried (.peers/cuda_op from benchmarks/fetch_vllm_ops.py)")
    folder = tempfile.mkdtemp(prefix="vllm-op-")
    so, why = mtp_bench.unpack_cuda_op(archive, Path(folder))
    op, why = mtp_bench.load_vllm_cuda(so, why, "fused_kda_decode")
    if op is None:
        pytest.fail(f"vLLM's library was carried but its fused_kda_decode does not load: {why}")
    return op


@pytest.mark.parametrize("B, H, layout, lower_bound", [(1, 12, "SD", -5.0), (33, 24, "DS", -5.0), (8, 48, "SD", None),
                                                       (200, 12, "SD", -2.0)])
def test_the_drop_in_computes_what_vllm_s_op_computes(vllm_kda_op, B, H, layout, lower_bound):
    slots = B + 4
    idx = torch.arange(1, B + 1, dtype=torch.int32).flip(0)
    args, pages = kc.kimi_call(B, H, slots, seed=B + H, layout=layout, lower_bound=lower_bound, device="cuda", idx=idx)

    def vllm(**a):
        out = torch.empty(1, B, H, kc.D, dtype=torch.bfloat16, device="cuda")
        vllm_kda_op(a["x"], a["weight"], a["bias"], a["conv_state"], a["raw_g"], a["raw_beta"], a["A_log"],
                    a["dt_bias"], a["state_indices"], a["state"], out, a["lower_bound"], a["output_gate"],
                    a["norm_weight"], a["norm_eps"])
        return out

    before = pages.clone()
    out, theirs, got_pages, their_pages = run_pair(args, pages, vllm_compat.fused_kda_decode, vllm)
    assert_out(out, theirs)
    mine, other = args, twin(args, pages, their_pages)
    close(mine["state"], other["state"], TOL_STATE)
    # vLLM's conv window holds the same bf16 inputs: exact.
    assert torch.equal(mine["conv_state"], other["conv_state"])
    print(f"\nB={B} H={H}: max |out - vLLM's| {float((out.float() - theirs.float()).abs().max()):.3g}, "
          f"state {float((mine['state'] - other['state']).abs().max()):.3g}; pages changed "
          f"{int((got_pages != before).any(1).sum())} of {slots}")


def test_the_drop_in_replays_in_a_cuda_graph():
    idx = torch.tensor([2, 4, 1], dtype=torch.int32)
    args, pages = kc.kimi_call(3, 4, 6, seed=21, device="cuda", idx=idx)
    start = pages.clone()
    eager = vllm_compat.fused_kda_decode(**args)
    eager_pages = pages.clone()
    out = torch.empty_like(eager)
    call = dict(args, out=out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture
        vllm_compat.fused_kda_decode(**call)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vllm_compat.fused_kda_decode(**call)
    pages.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(pages, eager_pages)


def test_the_drop_in_traces_under_compile_fullgraph():
    # Standalone state tensors: torch's aot_autograd refuses in-place writes to a view that reinterprets
    # another dtype's storage (vLLM's int8 pages), whatever the op.
    idx = torch.tensor([2, 4, 1], dtype=torch.int32)
    args, _ = kc.kimi_call(3, 4, 6, seed=22, device="cuda", idx=idx)
    args = dict(args, conv_state=args["conv_state"].clone(), state=args["state"].clone())
    twin_args = dict(args, conv_state=args["conv_state"].clone(), state=args["state"].clone())
    eager = vllm_compat.fused_kda_decode(**twin_args)
    compiled = torch.compile(vllm_compat.fused_kda_decode, fullgraph=True)
    out = compiled(**args)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(args["state"], twin_args["state"]) and torch.equal(args["conv_state"], twin_args["conv_state"])


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_kda_decode_s_bounded_gate_on_each_kernel_path(layout, tokens):
    gen = torch.Generator().manual_seed(5 + tokens)
    N, H, K, slots = 9, 4, 128, 30

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).cuda()

    lead = (N, tokens) if tokens > 1 else (N,)
    q, k, v = r(*lead, H, K).bfloat16(), r(*lead, H, K).bfloat16(), r(*lead, H, K).bfloat16()
    a, b = r(*lead, H, K).bfloat16(), r(*lead, H).bfloat16()
    A_log, dt = r(H, scale=0.5), r(H, K)
    state = r(slots, H, K, K, scale=0.1)
    idx = (torch.randperm(slots - 1, generator=gen)[:N * tokens].view(N, tokens) + 1).cuda()
    if tokens == 1:
        idx = idx[:, 0]
    kw = dict(a=a, b=b, A_log=A_log, dt_bias=dt, use_qk_l2norm=True, layout=layout, gate_lower_bound=-5.0)
    s_ref = state.clone()
    out = cudelta.kda_decode(q, k, v, None, None, state, idx, **kw)
    ref = cudelta.kda_decode_reference(q, k, v, None, None, s_ref, idx, **kw)
    assert_out(out, ref)
    torch.testing.assert_close(state, s_ref, rtol=1e-4, atol=1e-5)
    # The bound changes the step: the softplus form gives another state.
    s_soft = s_ref.clone()
    cudelta.kda_decode_reference(q, k, v, None, None, s_soft, idx, **dict(kw, gate_lower_bound=None))
    assert not torch.allclose(s_soft, s_ref, rtol=1e-3, atol=1e-4)
