"""On a real GPU (marker `gpu`): cudelta's causal-conv1d update kernel against the PyTorch reference
(cudelta/conv_reference.py, on CPU copies) in both forms vLLM's GDN layer calls (one token a row; the
speculative varlen form with accepted tokens and T varying per request), on vLLM's page layout (the
conv state [state_len, dim] a page, passed transposed), with null and unusable slots, and in place on
x through the vLLM drop-in; every byte of the pool outside the written windows stays bit-identical."""

import pytest

torch = pytest.importorskip("torch")

import cudelta  # noqa: E402, F401
from cudelta import conv, vllm_compat  # noqa: E402
from cudelta.conv_reference import causal_conv1d_update_reference  # noqa: E402
from test_gdn_decode_gpu import native_loaded  # noqa: E402, F401  (autouse)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# Qwen3-Next's conv channels at TP=4 (2*4*128 + 8*128): runs of 4 channels as vectors; and a dim
# that is not a whole block nor a multiple of 4: a channel a thread.
DIMS = (2048, 202)


def pool(slots, dim, state_len, dtype, page_major=True, seed=0):
    """conv_state [slots, dim, state_len] as vLLM binds it: each page [state_len, dim] (channels
    contiguous), passed as the transposed view; or a plain contiguous tensor."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if page_major:
        pages = torch.randn(slots, state_len, dim, device="cuda", generator=gen).to(dtype)
        return pages.transpose(1, 2)
    return torch.randn(slots, dim, state_len, device="cuda", generator=gen).to(dtype)


def inputs(rows, dim, width, x_dtype, w_dtype, bias, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, dim, device="cuda", generator=gen).to(x_dtype)
    w = (torch.randn(dim, width, device="cuda", generator=gen) / width).to(w_dtype)
    b = (torch.randn(dim, device="cuda", generator=gen) * 0.1).to(w_dtype) if bias else None
    return x, w, b


def reference_on_cpu(x, state, w, b, act, idx, cu=None, acc=None, out=None):
    cs = state.detach().cpu().clone()
    o = causal_conv1d_update_reference(x.cpu(), cs, w.cpu(), None if b is None else b.cpu(), act, idx.cpu(),
                                       None if cu is None else cu.cpu(), None if acc is None else acc.cpu(),
                                       out=None if out is None else out.cpu().clone())
    return o, cs


def assert_close_out(got, want):
    # The kernel sums the products in the reference's order without contraction; SiLU's exp may
    # differ by an fp32 ulp, which the rounding to the output dtype absorbs but at a tie.
    tol = 1e-5 if got.dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=1e-5)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("x_dtype,state_dtype,w_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),  # vLLM's GDN layer
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float16, torch.float16, torch.float16),
    (torch.float16, torch.float16, torch.float32),  # a weight of another dtype: a channel a thread
    (torch.float32, torch.float32, torch.float32),
])
@pytest.mark.parametrize("width,bias,act", [(4, True, "silu"), (4, False, None), (3, True, "silu"), (2, False, "silu")])
@pytest.mark.parametrize("page_major", [True, False], ids=["pages", "contiguous"])
def test_one_token_a_row_matches_the_reference(dim, x_dtype, state_dtype, w_dtype, width, bias, act, page_major):
    slots, state_len = 12, width - 1
    state = pool(slots, dim, state_len, state_dtype, page_major)
    before = state.clone()
    idx = torch.tensor([3, 0, 7, 11, 5], dtype=torch.int32, device="cuda")  # slot 0: the null block
    x, w, b = inputs(len(idx), dim, width, x_dtype, w_dtype, bias)
    want, want_state = reference_on_cpu(x, state, w, b, act, idx)
    got = conv.causal_conv1d_update(x, state, w, b, act, idx)
    assert_close_out(got, want)
    assert torch.equal(state.cpu(), want_state)  # the window moves bytes, no arithmetic
    assert torch.equal(got[1], x[1])  # the null slot's row keeps x's values
    untouched = [s for s in range(slots) if s not in (3, 7, 11, 5)]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_speculative_varlen_matches_the_reference(state_dtype, idx_dtype):
    dim, width, T = DIMS[0], 4, 8
    state_len = width - 1 + T - 1  # vLLM's conv state with num_spec = T - 1 drafts
    slots = 40
    state = pool(slots, dim, state_len, state_dtype, seed=3)
    before = state.clone()
    lens = [1, 2, 8, 3, 5, 0, 4, 7, 6]  # T varying per request; one request without tokens
    acc = [1, 2, 8, 1, 3, 1, 4, 7, 2]  # 1..T: the window starts acc - 1 columns in
    idx = [9, 4, 0, 17, 33, 21, 2, 38, 12]  # request 2 names the null block
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=idx_dtype, device="cuda")
    # vLLM passes the first column of its [N, T] block table: a strided view
    idx_t = torch.tensor(idx, dtype=idx_dtype, device="cuda")[:, None].repeat(1, T)[:, 0]
    assert idx_t.stride(0) == T
    acc_t = torch.tensor(acc, dtype=idx_dtype, device="cuda")
    x, w, b = inputs(int(cu[-1]) + 3, dim, width, torch.bfloat16, torch.bfloat16, True, seed=4)  # 3 padding rows
    out = torch.full_like(x, 7.0)
    want, want_state = reference_on_cpu(x, state, w, b, "silu", idx_t, cu, acc_t, out=out)
    got = conv.causal_conv1d_update(x, state, w, b, "silu", idx_t, cu, acc_t, out=out)
    assert got is out
    assert_close_out(got, want)
    assert torch.equal(state.cpu(), want_state)
    assert torch.equal(out[int(cu[2]):int(cu[3])], torch.full_like(out[:8], 7.0))  # the null slot's rows
    assert torch.equal(out[-3:], torch.full_like(out[-3:], 7.0))  # rows after cu_seqlens[N]
    written = {s for s, n in zip(idx, lens) if s != 0 and n > 0}
    untouched = [s for s in range(slots) if s not in written]
    assert torch.equal(state[untouched], before[untouched])


def test_a_request_the_pool_cannot_hold_is_skipped_and_the_others_computed():
    # The reference raises for it; the kernel cannot without a host sync, so it writes nothing.
    dim, width, T = 256, 4, 4
    state = pool(8, dim, width - 1 + T - 1, torch.bfloat16, seed=5)
    before = state.clone()
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device="cuda")
    acc = torch.tensor([2, 9, 1], dtype=torch.int32, device="cuda")  # request 1: window past state_len
    idx = torch.tensor([1, 2, 99], dtype=torch.int32, device="cuda")  # request 2: slot out of range
    x, w, b = inputs(12, dim, width, torch.bfloat16, torch.bfloat16, True, seed=6)
    out = torch.zeros_like(x)
    conv.causal_conv1d_update(x, state, w, b, "silu", idx, cu, acc, out=out)
    want, want_state = reference_on_cpu(x[:4], before[:2], w, b, "silu", idx[:1], cu[:2], acc[:1])
    assert_close_out(out[:4], want)
    assert torch.equal(state[1].cpu(), want_state[1])
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))
    assert torch.equal(state[[0, *range(2, 8)]], before[[0, *range(2, 8)]])


def test_vllm_drop_in_writes_x_in_place_and_captures_in_a_cuda_graph():
    dim, width = DIMS[0], 4
    state = pool(16, dim, width - 1, torch.bfloat16, seed=8)
    idx = torch.tensor([5, 9, 2], dtype=torch.int32, device="cuda")
    x, w, b = inputs(3, dim, width, torch.bfloat16, torch.bfloat16, True, seed=9)
    want, want_state = reference_on_cpu(x, state, w, b, "silu", idx)
    xs = x.clone()
    got = vllm_compat.causal_conv1d_update(xs, state, w, b, True, idx)
    assert got is xs
    assert_close_out(xs, want)
    assert torch.equal(state.cpu(), want_state)
    # Replayed from a graph (the eager call above loaded everything once): each replay advances the
    # window by one token, as the reference does.
    xg = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vllm_compat.causal_conv1d_update(xg, state, w, b, True, idx)
    expect = state.cpu().clone()
    for _ in range(3):
        xg.copy_(x)
        want = causal_conv1d_update_reference(x.cpu(), expect, w.cpu(), b.cpu(), "silu", idx.cpu())
        graph.replay()
        torch.cuda.synchronize()
        assert_close_out(xg, want)
        assert torch.equal(state.cpu(), expect)


def test_channels_that_are_not_contiguous_are_refused_by_name():
    state = pool(4, 64, 3, torch.bfloat16)
    x = torch.randn(2, 128, device="cuda", dtype=torch.bfloat16)[:, ::2]
    w = torch.randn(64, 4, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be \\[tokens, dim\\] with dim contiguous"):
        conv.causal_conv1d_update(x, state, w, None, "silu", torch.tensor([1, 2], dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("dim", DIMS)
def test_more_tokens_than_a_thread_loads_at_once_continue_the_window(dim):
    # A thread loads 8 tokens at a time (kConvTokenBatch): 11 tokens take two batches.
    width, lens = 4, [11, 3, 9]
    state = pool(6, dim, width - 2 + max(lens), torch.bfloat16, seed=10)
    cu = torch.tensor([0, 11, 14, 23], dtype=torch.int32, device="cuda")
    acc = torch.tensor([1, 2, 1], dtype=torch.int32, device="cuda")
    idx = torch.tensor([4, 1, 5], dtype=torch.int32, device="cuda")
    x, w, b = inputs(23, dim, width, torch.bfloat16, torch.bfloat16, True, seed=11)
    want, want_state = reference_on_cpu(x, state, w, b, "silu", idx, cu, acc)
    got = conv.causal_conv1d_update(x, state, w, b, "silu", idx, cu, acc)
    assert_close_out(got, want)
    assert torch.equal(state.cpu(), want_state)


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_vllm_s_kda_weight_on_either_page_layout_matches_the_reference(layout, bias):
    # Kimi K3's layer: bf16 x and conv state, the fp32 weight [3, 4, H*128] (q, k, v tap-major) read
    # in place: the fp32-taps build on SD pages (a page [3, dim], passed transposed), the DS build on
    # DS pages (a page [dim, 3]); each a vector path of its own.
    H, D, slots = 3, 128, 10
    dim = 3 * H * D
    gen = torch.Generator(device="cuda").manual_seed(7)
    if layout == "SD":
        state = torch.randn(slots, 3, dim, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
    else:
        state = torch.randn(slots, dim, 3, device="cuda", generator=gen).to(torch.bfloat16)
    before = state.clone()
    weight = torch.randn(3, 4, H * D, device="cuda", generator=gen) * 0.3
    b = torch.randn(dim, device="cuda", generator=gen) * 0.1 if bias else None
    idx = torch.tensor([4, 0, 9, 2, 6], dtype=torch.int32, device="cuda")  # slot 0: the null block
    x = torch.randn(len(idx), dim, device="cuda", generator=gen).to(torch.bfloat16)
    want, want_state = reference_on_cpu(x, state, weight, b, "silu", idx)
    got = conv.causal_conv1d_update(x, state, weight, b, "silu", idx)
    assert_close_out(got, want)
    assert torch.equal(state.cpu(), want_state)
    assert torch.equal(got[1], x[1])
    untouched = [s for s in range(slots) if s not in (4, 9, 2, 6)]
    assert torch.equal(state[untouched], before[untouched])
