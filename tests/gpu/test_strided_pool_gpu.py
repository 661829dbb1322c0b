"""On a real GPU (marker `gpu`): the kernels on vLLM's padded state pool, as its mamba cache binds it
(MambaBase.bind_kv_cache: one int8 page per slot holding the conv state, then this state, then
padding), for both layouts, GDN and KDA, fp32 and bf16 state, at batches that reach each build; every
byte of the pages outside the written slots' state blocks stays bit-identical, and a slot stride the
kernels cannot address aligned is refused by name."""

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import cudelta  # noqa: E402
from test_gdn_decode_gpu import RULES, check_step, make, native_loaded, run_op  # noqa: E402, F401  (autouse)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

CONV_BYTES = 4096


def into_pages(t, pad_bytes=528, seed=7):
    """Moves t["state"] into vLLM's page layout: returns the int8 pages [P, page], every byte random
    first, and makes t["state"] the view pages[:, conv:conv + nbytes].view(dtype).view(P, ...)."""
    state = t["state"]
    P, inner = state.shape[0], tuple(state.shape[1:])
    nbytes = state[0].numel() * state.element_size()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = torch.randint(-128, 128, (P, CONV_BYTES + nbytes + pad_bytes), dtype=torch.int8, device="cuda",
                          generator=gen)
    view = pages[:, CONV_BYTES:CONV_BYTES + nbytes].view(state.dtype).view(P, *inner)
    view.copy_(state)
    t["state"] = view
    return pages


def written_bytes(pages, t, rule):
    """The bytes of the pages a step may write: the state blocks of the valid slots idx names."""
    nbytes = t["state"][0].numel() * t["state"].element_size()
    mask = torch.zeros(pages.shape, dtype=torch.bool, device=pages.device)
    slots = [s for s in t["idx"].tolist() if RULES[rule] <= s < pages.shape[0]]
    mask[slots, CONV_BYTES:CONV_BYTES + nbytes] = True
    return mask


def step_on_pages(kind, t, pages, *, gates, layout, rule):
    pages_before, before = pages.clone(), t["state"].clone()
    out = run_op(kind, -1, t, gates=gates, layout=layout, rule=rule)
    torch.cuda.synchronize()
    check_step(kind, t, before, out, gates=gates, layout=layout, rule=rule)
    keep = ~written_bytes(pages, t, rule)
    assert torch.equal(pages[keep], pages_before[keep]), "a byte outside the written slots' state blocks changed"
    return out


# (K, V, N) at Qwen3-Next's head counts: for K = V = 128 the batches reach every warp build of both
# layouts and state dtypes (the list in test_gdn_decode_gpu.py, WARP_BUILD_BATCHES, says which);
# K = 256 reaches the kv block kernel and the long vk tiles, K = V = 64 the small builds.
BATCHES = [(128, 128, 2), (128, 128, 12), (128, 128, 37), (128, 128, 300), (256, 128, 37), (64, 64, 5)]


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V,N", BATCHES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
def test_steps_on_vllm_s_padded_pool_match_the_reference(kind, layout, K, V, N, state_dtype):
    t = make(N=N, H=16, HV=32, K=K, V=V, P=N + 8, kda=kind == "kda", layout=layout, state_dtype=state_dtype,
             invalid=(0, 1) if N < 8 else (3, 8))
    t["idx"][N // 2] = 0  # the null block
    pages = into_pages(t)
    assert t["state"].stride(0) > t["state"][0].numel()
    for _ in range(2):  # two steps in a row on the same pages
        step_on_pages(kind, t, pages, gates="raw", layout=layout, rule="nonpositive")


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("pad_bytes", [16, 528, 4096 + 16])
def test_precomputed_gates_and_any_16_byte_padding(layout, pad_bytes):
    t = make(N=9, H=4, HV=8, K=128, V=128, P=14, kda=True, layout=layout, idx_dtype=torch.int64, invalid=(2, 5))
    pages = into_pages(t, pad_bytes=pad_bytes)
    step_on_pages("kda", t, pages, gates="pre", layout=layout, rule="negative")


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_the_public_api_on_the_padded_pool_equals_the_contiguous_pool_bit_for_bit(layout):
    t = make(N=37, H=16, HV=32, K=128, V=128, P=45, layout=layout, state_dtype=torch.bfloat16)
    dense = t["state"].clone()
    pages = into_pages(t)
    args = dict(a=t["a"], b=t["b"], A_log=t["A_log"], dt_bias=t["dt_bias"], use_qk_l2norm=True, layout=layout)
    o_pages = cudelta.gdn_decode(t["q"], t["k"], t["v"], None, None, t["state"], t["idx"], **args)
    o_dense = cudelta.gdn_decode(t["q"], t["k"], t["v"], None, None, dense, t["idx"], **args)
    torch.cuda.synchronize()
    assert torch.equal(o_pages, o_dense) and torch.equal(t["state"], dense)
    assert t["state"].stride(0) * 2 == pages.shape[1] > t["state"][0].numel() * 2


def test_the_padded_pool_under_compile_fullgraph_and_a_cuda_graph():
    t = make(N=12, H=16, HV=32, K=128, V=128, P=20, layout="vk")
    dense = t["state"].clone()
    into_pages(t)
    out = torch.empty_like(t["v"])

    def step(state, o):
        return cudelta.gdn_decode(t["q"], t["k"], t["v"], None, None, state, t["idx"], a=t["a"], b=t["b"],
                                  A_log=t["A_log"], dt_bias=t["dt_bias"], layout="vk", out=o)

    torch.compile(step, fullgraph=True)(t["state"], out)
    expected = step(dense, torch.empty_like(out))
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and torch.equal(t["state"], dense)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(t["state"], out)
    graph.replay()
    step(dense, expected)
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and torch.equal(t["state"], dense)


# Slots that do not lie a whole number of 16 bytes apart (the kernels' state accesses are 16-byte
# vectors): (state dtype, padding bytes, the stride the message names in elements and bytes).
MISALIGNED = [(torch.float32, 516, 66689, 266756), (torch.bfloat16, 520, 67844, 135688),
              (torch.bfloat16, 2, 67585, 135170)]
REFUSAL = ("state's slot stride of {e} elements ({b} bytes) is not a multiple of 16 bytes; accepted on CUDA: slots "
           "a multiple of 16 bytes apart (the kernels' 16-byte state accesses; vLLM's pages are)")


@pytest.mark.parametrize("state_dtype,pad,elements,stride_bytes", MISALIGNED)
def test_the_public_api_refuses_a_misaligned_slot_stride_by_name_and_writes_nothing(state_dtype, pad, elements,
                                                                                      stride_bytes):
    t = make(N=4, H=2, HV=4, K=128, V=128, P=6, layout="vk", state_dtype=state_dtype)
    pages = into_pages(t, pad_bytes=pad)
    assert t["state"].stride(0) == elements
    before = pages.clone()
    with pytest.raises(ValueError, match="^" + REFUSAL.format(e=elements, b=stride_bytes)
                       .replace("(", r"\(").replace(")", r"\)") + "$"):
        cudelta.gdn_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], t["state"], t["idx"], layout="vk")
    torch.cuda.synchronize()
    assert torch.equal(pages, before)


OP_SCRIPT = """
import sys; sys.path.insert(0, {here!r})
import torch, cudelta; cudelta._native.status()
from test_gdn_decode_gpu import make, run_op
from test_strided_pool_gpu import into_pages
t = make(N=4, H=2, HV=4, K=128, V=128, P=6, layout="vk", state_dtype=getattr(torch, {dtype!r}))
pages = into_pages(t, pad_bytes={pad})
{tweak}
before = pages.clone()
try:
    run_op("gdn", -1, t, layout="vk")
except RuntimeError as e:
    print(e)
torch.cuda.synchronize()
print("pages unchanged:", torch.equal(pages, before))
"""


# The op itself (what torch.compile'd graphs and engines calling torch.ops.cudelta reach), each case
# in its own process as the other kernel errors (test_gdn_decode_gpu.py says why).
@pytest.mark.parametrize("case", ["misaligned fp32", "misaligned bf16", "block not contiguous"])
def test_the_op_refuses_a_pool_it_cannot_address_by_name(case):
    if case == "block not contiguous":
        dtype, pad, tweak = "float32", 528, "t['state'] = t['state'].transpose(2, 3)"
        message = ("cudelta.decode: state's slot block [HV, V, K] must be contiguous (strides (16384, 128, 1)); "
                   "got strides (16384, 1, 128) for shape [6, 4, 128, 128]")
    else:
        sd, pad, elements, stride_bytes = MISALIGNED[0] if case == "misaligned fp32" else MISALIGNED[1]
        dtype, tweak = str(sd).split(".")[-1], ""
        message = "cudelta.decode: " + REFUSAL.format(e=elements, b=stride_bytes)
    script = OP_SCRIPT.format(here=str(Path(__file__).parent), dtype=dtype, pad=pad, tweak=tweak)
    proc = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-800:]
    assert message in proc.stdout and "pages unchanged: True" in proc.stdout, proc.stdout[-800:]


OVERLAP_SCRIPT = """
import sys; sys.path.insert(0, {here!r})
import torch, cudelta; cudelta._native.status()
from test_gdn_decode_gpu import make, run_op
from test_strided_pool_gpu import CONV_BYTES, into_pages
t = make(N=4, H=2, HV=4, K=128, V=128, P=6, layout="vk")
pages = into_pages(t)
def in_slot(x, slot):  # a tensor of x's shape and dtype at the start of a slot's state block
    return pages[slot, CONV_BYTES:CONV_BYTES + x.numel() * x.element_size()].view(x.dtype).view(x.shape)
{setup}
before = pages.clone()
try:
    run_op("gdn", -1, t, layout="vk", out=out)
except RuntimeError as e:
    print(e)
torch.cuda.synchronize()
print("pages unchanged:", torch.equal(pages, before))
"""
ACCEPTED = "; accepted: buffers that share no byte with each other"
OVERLAP_CASES = {
    "out is v": ("out = t['v']", "out shares memory with v" + ACCEPTED + " (out is written while v is still read)"),
    "out in a slot": ("out = in_slot(t['v'], 5)", "out shares memory with the state pool" + ACCEPTED),
    "q in a slot": ("t['q'] = in_slot(t['q'], 5).copy_(t['q']); out = None",
                    "q shares memory with the state pool's slots" + ACCEPTED),
    "beta is out": ("out = torch.empty_like(t['v']); t['beta'] = out.view(-1)[:t['beta'].numel()].view(t['beta'].shape)"
                    ".copy_(t['beta'])", "out shares memory with beta" + ACCEPTED),
}


# The op itself refuses a call whose written tensors (out, the pool's slots) share bytes with what it
# reads, before it launches anything; each case in its own process, as the other op errors.
@pytest.mark.parametrize("case", list(OVERLAP_CASES))
def test_the_op_refuses_what_it_writes_sharing_memory_with_what_it_reads(case):
    setup, message = OVERLAP_CASES[case]
    script = OVERLAP_SCRIPT.format(here=str(Path(__file__).parent), setup=setup)
    proc = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-800:]
    assert "cudelta.decode: " + message in proc.stdout and "pages unchanged: True" in proc.stdout, proc.stdout[-800:]


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_public_api_names_an_aliased_out_and_writes_nothing(tokens):
    # One token a request: the op refuses before any Python check; three (cu_seqlens, the epilogue):
    # the Python checks leave addresses to the op too. Either way the refusal is named in Python.
    t = make(N=2 * tokens, H=2, HV=4, K=128, V=128, P=6, layout="vk")
    pages = into_pages(t)
    before = pages.clone()
    options = {} if tokens == 1 else dict(cu_seqlens=torch.tensor([0, 3, 6], device="cuda"),
                                          output_gate=torch.randn_like(t["v"]), norm_weight=torch.ones(128, device="cuda"))
    idx = torch.tensor([1, 4], device="cuda") if tokens == 1 else torch.tensor([[1, 2, 3], [4, 5, 0]], device="cuda")
    with pytest.raises(ValueError, match=r"^out shares memory with v; accepted: buffers that share no byte"):
        cudelta.gdn_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], t["state"], idx, layout="vk", out=t["v"],
                           **options)
    torch.cuda.synchronize()
    assert torch.equal(pages, before)


@pytest.mark.parametrize("tokens", [1, 3])
def test_an_out_in_the_conv_bytes_of_a_page_is_not_the_pool(tokens):
    # vLLM keeps each page's conv state between the state blocks; an out there shares no byte with
    # the slots, so it is accepted and gets the same values as an out of its own.
    N = 2
    t = make(N=N * tokens, H=2, HV=2, K=128, V=128, P=6, layout="vk")
    pages = into_pages(t)
    idx = torch.tensor([[1, 2, 3], [4, 5, 0]], device="cuda")[:, :tokens]  # no slot shared between requests
    idx = idx[:, 0].contiguous() if tokens == 1 else idx
    cu = torch.arange(0, N * tokens + 1, tokens, device="cuda") if tokens > 1 else None
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    ref_state = t["state"].clone()
    expected = cudelta.gdn_decode(*args, ref_state, idx, layout="vk", cu_seqlens=cu)
    nbytes = t["v"].numel() * t["v"].element_size()
    assert nbytes <= CONV_BYTES
    out = pages[0, :nbytes].view(t["v"].dtype).view(t["v"].shape)
    got = cudelta.gdn_decode(*args, t["state"], idx, layout="vk", cu_seqlens=cu, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, expected) and torch.equal(t["state"], ref_state)
