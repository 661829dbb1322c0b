"""On a real GPU (marker `gpu`): the multi-token options and the epilogue, which this release computes
on CPU tensors only, are refused on CUDA tensors by name with the pool left as it was; vLLM's
one-token packed decode runs the kernel through cudelta.vllm_compat, on a contiguous pool and on
vLLM's padded pool as allocated."""

import pytest

torch = pytest.importorskip("torch")

import cudelta  # noqa: E402
from cudelta import vllm_compat  # noqa: E402
from cudelta.ops import NotSupportedOnCUDAError  # noqa: E402
from test_gdn_decode_gpu import check_step, native_loaded  # noqa: E402, F401  (native_loaded: autouse, per module)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def step(N=4, T=1, H=2, HV=4, D=128, P=9, seed=40):
    gen = torch.Generator().manual_seed(seed)
    lead = (N, T) if T > 1 else (N,)
    t = dict(q=torch.randn(*lead, H, D, generator=gen), k=torch.randn(*lead, H, D, generator=gen),
             v=torch.randn(*lead, HV, D, generator=gen), g=-torch.rand(*lead, HV, generator=gen),
             beta=torch.rand(*lead, HV, generator=gen), z=torch.randn(*lead, HV, D, generator=gen),
             w=torch.ones(D))
    t = {n: x.cuda().to(torch.bfloat16 if n in "qkvz" else torch.float32) for n, x in t.items()}
    t["state"] = (torch.randn(P, HV, D, D, generator=gen) * 0.1).cuda()
    return t


OPTIONS = [
    ("cu_seqlens", lambda t: dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4], device="cuda")), "cu_seqlens"),
    ("idx per token", lambda t: dict(idx=torch.tensor([[1], [2], [3], [4]], device="cuda")), "idx of shape"),
    ("accepted", lambda t: dict(idx=torch.tensor([[1], [2], [3], [4]], device="cuda"),
                                num_accepted_tokens=torch.ones(4, dtype=torch.int32, device="cuda")),
     "num_accepted_tokens"),
    ("epilogue", lambda t: dict(output_gate=t["z"], norm_weight=t["w"]), "the gated RMSNorm epilogue"),
]


@pytest.mark.parametrize("what,options,name", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_an_option_the_kernels_lack_is_refused_by_name_on_cuda(what, options, name):
    t = step()
    before = t["state"].clone()
    opts = options(t)
    idx = opts.pop("idx", torch.tensor([1, 2, 3, 4], device="cuda"))
    with pytest.raises(NotSupportedOnCUDAError, match=f"{name}.*not yet supported by the CUDA kernels"):
        cudelta.gdn_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], t["state"], idx, layout="vk", **opts)
    torch.cuda.synchronize()
    assert torch.equal(t["state"], before)


def test_tokens_per_request_are_refused_by_name_on_cuda():
    t = step(T=3)
    with pytest.raises(NotSupportedOnCUDAError, match=r"q of shape \(4, 3, 2, 128\) \(T tokens per request\)"):
        cudelta.gdn_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], t["state"],
                           torch.tensor([1, 2, 3, 4], device="cuda"), layout="vk")


def vllm_pages(P, HV, D, state_dtype, conv_bytes=4096, pad_bytes=512):
    """vLLM's mamba page layout (MambaBase.bind_kv_cache): conv state, this state, padding per page."""
    nbytes = HV * D * D * torch.empty((), dtype=state_dtype).element_size()
    pages = torch.randint(-128, 128, (P, conv_bytes + nbytes + pad_bytes), dtype=torch.int8, device="cuda")
    state = pages[:, conv_bytes:conv_bytes + nbytes].view(state_dtype).view(-1, HV, D, D)
    state.copy_(torch.randn(state.shape, device="cuda") * 0.1)
    return pages, state


def test_on_vllm_s_padded_pool_a_refusal_names_only_the_option_and_leaves_the_pages_as_they_were():
    t = step()
    pages, state = vllm_pages(9, 4, 128, torch.bfloat16)
    before = pages.clone()
    with pytest.raises(NotSupportedOnCUDAError, match=r"cudelta: output_gate, norm_weight \(the gated RMSNorm "
                       r"epilogue\): not yet supported") as e:
        cudelta.gdn_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], state,
                           torch.tensor([1, 2, 3, 4], device="cuda"), layout="vk", output_gate=t["z"],
                           norm_weight=t["w"])
    torch.cuda.synchronize()
    assert "pool" not in str(e.value)
    assert torch.equal(pages, before)


@pytest.mark.parametrize("pool", ["contiguous", "vllm-pages"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
def test_vllm_packed_decode_runs_the_kernel(state_dtype, pool):
    B, H, HV, D, P = 37, 16, 32, 128, 45
    gen = torch.Generator().manual_seed(41)
    qkv = 2 * H * D + HV * D
    # q, k, v rows of a wider projection (vLLM's mixed_qkvz), as the layer hands them over
    mixed = torch.randn(B, qkv + HV * D, generator=gen).to("cuda", torch.bfloat16)[:, :qkv]
    ba = (torch.randn(B, 2 * HV, generator=gen) * 2).to("cuda", torch.bfloat16)
    b, a = ba[:, :HV], ba[:, HV:]
    A_log, dt_bias = (torch.randn(HV, generator=gen) * 0.5).cuda(), torch.randn(HV, generator=gen).cuda()
    state = (torch.randn(P, HV, D, D, generator=gen) * 0.1).to("cuda", state_dtype)
    pages = None
    if pool == "vllm-pages":  # the pool as vLLM allocates it: conv state and padding in each slot's page
        pages, padded = vllm_pages(P, HV, D, state_dtype)
        padded.copy_(state)
        state = padded
        assert state.stride(0) > state[0].numel()
    idx = torch.randperm(P - 1, generator=gen)[:B].add(1).to("cuda", torch.int32)
    idx[[3, 20]] = 0  # the null block
    before = state.clone()
    pages_before = None if pages is None else pages.clone()
    out = torch.full((B, 1, HV, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, final = vllm_compat.fused_recurrent_gated_delta_rule_packed_decode(
        mixed, a, b, A_log, dt_bias, D ** -0.5, state, out, idx, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    assert o is out and final is state
    # the step against the reference, element by element, as every kernel test here checks it
    q, k, v = mixed.split([H * D, H * D, HV * D], dim=-1)
    t = dict(q=q.reshape(B, H, D), k=k.reshape(B, H, D), v=v.reshape(B, HV, D), a=a, b=b, A_log=A_log,
             dt_bias=dt_bias, state=state, idx=idx)
    check_step("gdn", t, before, out[:, 0], gates="raw", layout="vk", rule="nonpositive", l2norm=True)
    assert torch.all(out[3] == 0) and torch.all(out[20] == 0)
    if pages is not None:  # the conv state and the padding of every page, and the untouched slots: as they were
        nbytes = state[0].numel() * state.element_size()
        keep = torch.ones(pages.shape, dtype=torch.bool, device="cuda")
        keep[[s for s in idx.tolist() if s > 0], 4096:4096 + nbytes] = False
        assert torch.equal(pages[keep], pages_before[keep])
