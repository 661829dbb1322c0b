"""A malformed multi-token call is refused with one line naming the bad value and what is accepted,
before anything is written; on CUDA tensors the options the kernels do not take yet are refused by
name instead of running the slow reference on the GPU."""

import math

import pytest

torch = pytest.importorskip("torch")

import cudelta  # noqa: E402
from cudelta._contract import check_kernel_pool, check_pool  # noqa: E402
from cudelta.ops import NotSupportedOnCUDAError  # noqa: E402
from cudelta.reference import gdn_decode_reference  # noqa: E402
from decode_loop import random_pool, token_inputs, vllm_pool  # noqa: E402

P = 8
DECODES = [pytest.param(gdn_decode_reference, id="reference"), pytest.param(cudelta.gdn_decode, id="public")]


def call(decode, t, state, idx, **options):
    return decode(t["q"], t["k"], t["v"], t["g"], t["beta"], state, idx, **options)


def dense(t, T):
    return {n: x.reshape(-1, T, *x.shape[1:]) if n in ("q", "k", "v", "g", "beta", "z") else x for n, x in t.items()}


@pytest.fixture
def flat():
    return token_inputs([2, 1, 3], seed=20)


@pytest.fixture
def idx():
    return torch.tensor([[1, 2, 3], [4, 5, 6], [7, -1, 0]])


# (what is wrong, the options of a flat call of 6 tokens in 3 requests, the message)
FLAT_CASES = [
    ("cu_seqlens of floats", dict(cu_seqlens=torch.tensor([0.0, 2.0, 3.0, 6.0])),
     r"cu_seqlens must be an int32/int64 tensor \[N\+1\] of token offsets; got torch.float32 \(4,\)"),
    ("cu_seqlens for 2 requests, idx for 3", dict(cu_seqlens=torch.tensor([0, 3, 6])),
     r"idx must be an int32/int64 tensor of shape \[2\] \(a slot per request\) or \[2, T\] \(a slot per token\); "
     r"got torch.int64 \(3, 3\)"),
    ("num_accepted_tokens of 2 for 3 requests", dict(num_accepted_tokens=torch.tensor([1, 1])),
     r"num_accepted_tokens must be an int32/int64 tensor of shape \[3\] \(accepted tokens per request\); got "
     r"torch.int64 \(2,\)"),
    ("num_accepted_tokens as floats", dict(num_accepted_tokens=torch.ones(3)),
     r"num_accepted_tokens must be an int32/int64 tensor of shape \[3\].*got torch.float32"),
    ("output_gate alone", dict(output_gate="z"),
     r"the gated RMSNorm epilogue needs both output_gate and norm_weight; got only output_gate"),
    ("norm_weight alone", dict(norm_weight="w"),
     r"the gated RMSNorm epilogue needs both output_gate and norm_weight; got only norm_weight"),
    ("norm_eps without the epilogue", dict(norm_eps=1e-6),
     r"norm_eps belongs to the gated RMSNorm epilogue: pass output_gate and norm_weight too"),
    ("both without the epilogue", dict(norm_eps=1e-6, gate_activation="silu"),
     r"norm_eps and gate_activation belong to the gated RMSNorm epilogue"),
    ("output_gate of the wrong shape", dict(output_gate="z[:5]", norm_weight="w"),
     r"output_gate must be a float tensor of v's shape \(6, 4, 64\); got torch.float32 \(5, 4, 64\)"),
    ("output_gate of ints", dict(output_gate="z.int()", norm_weight="w"),
     r"output_gate must be a float tensor of v's shape \(6, 4, 64\); got torch.int32"),
    ("norm_weight of the wrong size", dict(output_gate="z", norm_weight="w[:32]"),
     r"norm_weight must be a float tensor \[V\] = \[64\]; got torch.float32 \(32,\)"),
    ("a NaN norm_eps", dict(output_gate="z", norm_weight="w", norm_eps=float("nan")),
     r"norm_eps must be a finite number >= 0; got nan"),
    ("a negative norm_eps", dict(output_gate="z", norm_weight="w", norm_eps=-1e-5),
     r"norm_eps must be a finite number >= 0; got -1e-05"),
    ("norm_eps as text", dict(output_gate="z", norm_weight="w", norm_eps="1e-5"),
     r"norm_eps must be a finite number >= 0; got '1e-5'"),
    ("an unknown activation", dict(output_gate="z", norm_weight="w", gate_activation="swish"),
     r"gate_activation='swish' is not accepted; expected one of \('silu', 'sigmoid'\)"),
    ("out of one token per request", dict(out="torch.empty(3, 4, 64)"),
     r"out must be a torch.float32 tensor of shape \[6, 4, 64\]; got torch.float32 \(3, 4, 64\)"),
    ("decreasing offsets", dict(cu_seqlens=torch.tensor([0, 3, 2, 6])),
     r"cu_seqlens must be non-decreasing offsets within the 6 tokens; got \[0, 3, 2, 6\]"),
    ("offsets past the tokens", dict(cu_seqlens=torch.tensor([0, 2, 3, 7])),
     r"cu_seqlens must be non-decreasing offsets within the 6 tokens; got \[0, 2, 3, 7\]"),
    ("more tokens than slot columns", dict(cu_seqlens=torch.tensor([0, 1, 2, 6])),
     r"request 2 has 4 tokens \(cu_seqlens\) but idx has 3 columns: idx \[N, T\] needs a slot for each token"),
]


def resolve(options, t):
    """Options whose tensors are named by an expression on the inputs (parametrize ids stay short)."""
    env = dict(t, torch=torch)
    return {k: eval(v, env) if isinstance(v, str) and k in ("output_gate", "norm_weight", "out") else v  # noqa: S307
            for k, v in options.items()}


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("what,options,message", FLAT_CASES, ids=[c[0] for c in FLAT_CASES])
def test_a_bad_multi_token_argument_is_named_and_nothing_is_written(decode, what, options, message, flat, idx):
    state = random_pool(P, 4, 64, 64)
    before = state.clone()
    options = {"cu_seqlens": flat["cu_seqlens"], **resolve(options, flat)}
    with pytest.raises(ValueError, match=message):
        call(decode, flat, state, idx, **options)
    assert torch.equal(state, before)


@pytest.mark.parametrize("decode", DECODES)
def test_shapes_of_the_dense_form_are_named(decode, flat):
    t = dense(token_inputs([3, 3], seed=21), 3)
    state = random_pool(P, 4, 64, 64)
    with pytest.raises(ValueError, match=r"idx \[N, T\] needs a slot for each of the T=3 tokens; got 2 columns"):
        call(decode, t, state, torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match=r"num_accepted_tokens picks the starting slot among idx\[n, :\]: idx must "
                       r"be \[N, T\] \(a slot per token\); got idx \(2,\)"):
        call(decode, t, state, torch.tensor([1, 2]), num_accepted_tokens=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"v must be \[2, 3, HV, V\] with HV a multiple of H=2; got \(2, 2, 4, 64\)"):
        decode(t["q"], t["k"], t["v"][:, :2], t["g"], t["beta"], state, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"GDN g must be \[2, 3, 4\]; got \[2, 4\]"):
        decode(t["q"], t["k"], t["v"], t["g"][:, 0], t["beta"], state, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"beta must be \[2, 3, 4\]; got \[6, 4\]"):
        decode(t["q"], t["k"], t["v"], t["g"], flat["beta"], state, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"with cu_seqlens, q and k must both be \[tokens, H, K\]; got "
                       r"\(2, 3, 2, 64\)"):
        call(decode, t, state, torch.tensor([1, 2]), cu_seqlens=torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match=r"q and k must both be \[N, H, K\] \(one token per request\) or "
                       r"\[N, T, H, K\]; got \(6, 128\)"):
        decode(flat["q"].reshape(6, 128), flat["k"].reshape(6, 128), flat["v"], flat["g"], flat["beta"], state,
               torch.tensor([1, 2]))


@pytest.mark.parametrize("decode", DECODES)
def test_the_pool_rule_is_named(decode):
    t = token_inputs([1, 1], seed=22)
    state = random_pool(P, 4, 64, 64)
    transposed = state.transpose(2, 3)  # [P, HV, V, K] strides: not a contiguous [HV, K, V] block
    with pytest.raises(ValueError, match=r"state's slot block \[HV, K, V\] must be contiguous \(strides "
                       r"\(4096, 64, 1\)\); got strides \(4096, 1, 64\) for shape \(8, 4, 64, 64\)"):
        call(decode, t, transposed, torch.tensor([1, 2]))
    overlapping = torch.zeros(P * 2048 + 16384).as_strided((P, 4, 64, 64), (2048, 4096, 64, 1))  # slots overlap
    with pytest.raises(ValueError, match=r"state's slot stride must be at least one slot's block of 16384 elements "
                       r"\(a multiple of the element size, padding allowed\); got 2048"):
        call(decode, t, overlapping, torch.tensor([1, 2]))
    _, padded = vllm_pool(P, 4, 64, 64, "kv")  # slots a page apart: accepted
    call(decode, t, padded, torch.tensor([1, 2]))


class OnCUDA(torch.Tensor):
    """A CPU tensor that says it is on CUDA: cudelta.ops takes the kernel path's decisions for it
    without a GPU (tests/gpu/test_multi_token_gpu.py makes the same calls on a real one)."""

    @property
    def is_cuda(self):
        return True


def on_cuda(x):
    return x.as_subclass(OnCUDA)


# Every option the kernels now take, given on "CUDA" tensors (tests/gpu/test_mtp_gpu.py runs them on
# a real GPU): none is refused any more.
CUDA_CASES = [
    ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 1, 2]))),
    ("idx per token", dict(idx=torch.tensor([[1], [2]]))),
    ("num_accepted_tokens", dict(idx=torch.tensor([[1], [2]]), num_accepted_tokens=torch.tensor([1, 1]))),
    ("epilogue", dict(output_gate="z", norm_weight="w")),
    ("gate_activation", dict(output_gate="z", norm_weight="w", gate_activation="sigmoid")),
]


@pytest.mark.parametrize("what,options", CUDA_CASES, ids=[c[0] for c in CUDA_CASES])
def test_on_cuda_tensors_every_option_is_taken_not_refused(what, options):
    # Without a native library (this unit environment) the CUDA path falls back to the reference; the
    # point is that no option is refused on the way, and the result is the CPU call's.
    t = token_inputs([1, 1], seed=23)
    options = resolve(options, t)
    idx = options.pop("idx", torch.tensor([1, 2]))
    state = random_pool(P, 4, 64, 64)
    cpu_state = state.clone()
    expected = cudelta.gdn_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], cpu_state, idx, **options)
    got = cudelta.gdn_decode(on_cuda(t["q"]), t["k"], t["v"], t["g"], t["beta"], state, idx, **options)
    assert torch.equal(got, expected) and torch.equal(state, cpu_state)
    assert issubclass(NotSupportedOnCUDAError, NotImplementedError)  # kept: engines may still catch it


def test_on_cuda_tensors_a_malformed_option_is_named_as_on_the_cpu():
    t = token_inputs([1, 1], seed=25)
    with pytest.raises(ValueError, match=r"gate_activation='relu' is not accepted"):
        cudelta.gdn_decode(on_cuda(t["q"]), t["k"], t["v"], t["g"], t["beta"], random_pool(P, 4, 64, 64),
                           torch.tensor([1, 2]), output_gate=t["z"], norm_weight=t["w"], gate_activation="relu")


def pool_with_stride(stride_bytes, dtype, P=3, inner=(4, 64, 64), offset_bytes=0):
    """A pool whose slots lie stride_bytes apart, starting offset_bytes into a 16-byte aligned buffer."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.zeros(offset_bytes + P * stride_bytes + 64, dtype=torch.int8)
    base = raw[offset_bytes:offset_bytes + (P - 1) * stride_bytes + math.prod(inner) * size].view(dtype)
    return base.as_strided((P, *inner), (stride_bytes // size, inner[1] * inner[2], inner[2], 1))


@pytest.mark.parametrize("dtype,stride_bytes", [(torch.float32, 4 * 16384 + 4), (torch.float32, 4 * 16384 + 8),
                                                (torch.bfloat16, 2 * 16384 + 2), (torch.bfloat16, 2 * 16384 + 528 + 6)])
def test_the_kernels_refuse_slots_not_a_multiple_of_16_bytes_apart_naming_the_stride(dtype, stride_bytes):
    state = pool_with_stride(stride_bytes, dtype)
    check_pool(state, "kv")  # the pool rule holds: the reference takes it
    elements = stride_bytes // state.element_size()
    with pytest.raises(ValueError, match=rf"^state's slot stride of {elements} elements \({stride_bytes} bytes\) is "
                       r"not a multiple of 16 bytes; accepted on CUDA: slots a multiple of 16 bytes apart \(the "
                       r"kernels' 16-byte state accesses; vLLM's pages are\)$"):
        check_kernel_pool(state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_take_vllm_s_pages_and_any_16_byte_slot_stride(dtype):
    _, pages = vllm_pool(P, 4, 64, 64, "vk", dtype)  # 4096 bytes of conv state, 528 of padding per page
    assert not pages.is_contiguous()
    check_kernel_pool(pages)
    check_kernel_pool(pool_with_stride(16384 * pages.element_size() + 16, dtype))
    check_kernel_pool(random_pool(P, 4, 64, 64))
    # one slot: its stride addresses nothing, whatever it is
    check_kernel_pool(pool_with_stride(16384 * pages.element_size() + 2, dtype, P=1))


def test_the_kernels_refuse_a_pool_starting_off_16_bytes_naming_the_offset():
    state = pool_with_stride(4 * 16384 + 16, torch.float32, offset_bytes=8)
    with pytest.raises(ValueError, match=r"^state must start on 16 bytes; got address offset 8 \(a view starting "
                       r"mid-row is not\)$"):
        check_kernel_pool(state)
