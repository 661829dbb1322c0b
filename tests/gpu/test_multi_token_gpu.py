"""On a real GPU (marker `gpu`): each multi-token option and the epilogue, which an earlier release
refused on CUDA tensors (cudelta.ops.NotSupportedOnCUDAError), runs in the kernels, alone and all
at once, and matches the same call on CPU tensors (the PyTorch reference); vLLM's one-token packed
decode runs the kernel through cudelta.vllm_compat, on a contiguous pool and on vLLM's padded pool
as allocated. tests/gpu/test_mtp_gpu.py checks the options against the float64 loop, combined."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cudelta import vllm_compat  # noqa: E402
from test_gdn_decode_gpu import check_step, native_loaded  # noqa: E402, F401  (native_loaded: autouse, per module)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/mtp_cases.py
import mtp_cases as mc  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# Each option on its own (one token per request, idx [N], no epilogue, a contiguous pool otherwise),
# then all of them at once on vLLM's pages.
ALONE = dict(tokens="single", slots="final", epilogue="none", pool="contiguous")
OPTIONS = [
    ("T tokens per request", mc.Case(**dict(ALONE, tokens="T3"), seed=600)),
    ("cu_seqlens", mc.Case(**dict(ALONE, tokens="varlen"), seed=601)),
    ("idx per token", mc.Case(**dict(ALONE, slots="ckpt"), seed=602)),
    ("num_accepted_tokens", mc.Case(**dict(ALONE, slots="accepted"), seed=603)),
    ("epilogue", mc.Case(**dict(ALONE, epilogue="silu"), seed=604)),
    ("padded pool with the epilogue", mc.Case(**dict(ALONE, epilogue="sigmoid", pool="pages"), seed=605)),
    ("all at once", mc.Case(seed=606)),
]


@pytest.mark.parametrize("what,case", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_each_option_runs_on_cuda_and_matches_the_cpu_reference(what, case):
    gpu, cpu = mc.build(case, "cuda"), mc.build(case, "cpu")
    before = mc.snapshot(gpu)
    try:
        out = mc.call(case, gpu)
    except NotImplementedError as e:  # cudelta.ops.NotSupportedOnCUDAError is one
        pytest.fail(f"{what}: still refused on CUDA tensors: {e}")
    torch.cuda.synchronize()
    mc.compare(case, gpu, out, cpu, mc.call(case, cpu), before)


def vllm_pages(P, HV, D, state_dtype, conv_bytes=4096, pad_bytes=512):
    """vLLM's mamba page layout (MambaBase.bind_kv_cache): conv state, this state, padding per page."""
    nbytes = HV * D * D * torch.empty((), dtype=state_dtype).element_size()
    pages = torch.randint(-128, 128, (P, conv_bytes + nbytes + pad_bytes), dtype=torch.int8, device="cuda")
    state = pages[:, conv_bytes:conv_bytes + nbytes].view(state_dtype).view(-1, HV, D, D)
    state.copy_(torch.randn(state.shape, device="cuda") * 0.1)
    return pages, state


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
