"""Public ops: the CUDA kernel where it can run, the PyTorch reference everywhere else.

Both paths take the same options and check arguments alike (cudelta._contract.check_call and
check_gates), so a call that is wrong fails the same way on a CPU and on a GPU. What the kernels do
not compute yet (several tokens per request, the epilogue) is refused on CUDA tensors by name,
never run in the slow reference on the GPU. vLLM's padded pool runs in the kernels, whose 16-byte
state accesses add one rule on CUDA (check_kernel_pool).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _native
from ._contract import LAYOUTS, check_call, check_gates, check_kernel_pool, min_valid_slot
from .reference import gdn_decode_reference, kda_decode_reference

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NotSupportedOnCUDAError(NotImplementedError):
    """An option of the contract that this release computes on CPU tensors only (the reference): on
    CUDA tensors it is refused, never run slowly behind an engine's back."""


def _not_on_cuda(q, idx, extra) -> list[str]:
    """The options of a CUDA call that the kernels do not take yet, each named (empty: none)."""
    names = []
    if q.dim() == 4:
        names.append(f"q of shape {tuple(q.shape)} (T tokens per request)")
    if extra["cu_seqlens"] is not None:
        names.append("cu_seqlens (tokens per request)")
    if idx.dim() == 2:
        names.append(f"idx of shape {tuple(idx.shape)} (a state checkpoint per token)")
    if extra["num_accepted_tokens"] is not None:
        names.append("num_accepted_tokens")
    epilogue = [n for n in ("output_gate", "norm_weight", "norm_eps", "gate_activation") if extra[n] is not None]
    if epilogue:
        names.append(f"{', '.join(epilogue)} (the gated RMSNorm epilogue)")
    return names


def _refuse(names: list[str]) -> NotSupportedOnCUDAError:
    return NotSupportedOnCUDAError(
        f"cudelta: {'; '.join(names)}: not yet supported by the CUDA kernels of this release (CPU tensors run it "
        "in the PyTorch reference; see README, 'Multi-token decode')")


def _decode(kind, q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale, use_qk_l2norm, layout, invalid_slot,
            out, extra):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    options = dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, layout=layout,
                   invalid_slot=invalid_slot, out=out, **extra)
    reference = gdn_decode_reference if kind == "gdn" else kda_decode_reference
    args = (q, k, v, g, beta, state, idx)
    if not q.is_cuda:
        _native.notice_once("cpu", "CPU tensors run the PyTorch reference (the kernels need CUDA tensors)")
        return reference(*args, **options)

    def check():
        shape = check_call(q, k, v, state, idx, layout, out, **extra)
        check_gates(kind, shape.lead, shape.HV, shape.K, g, beta, a, b, A_log, dt_bias)

    # One look at a few attributes: the options the kernels lack are refused on every CUDA path (a slow
    # reference on the GPU is what an engine would never notice), after the checks that name a
    # malformed argument as on the CPU.
    if q.dim() != 3 or idx.dim() != 1 or any(x is not None for x in extra.values()):
        check()
        unsupported = _not_on_cuda(q, idx, extra)
        if unsupported:
            raise _refuse(unsupported)
    st = _native.status()
    if not st.loaded:
        if st.path is not None:  # a library that exists but cannot run here is an error, not a slow path
            raise _native.NativeLibraryError(f"cudelta: {st.reason}")
        _native.notice_once("no-native", f"{st.reason}; CUDA tensors use the PyTorch reference (slow)")
        return reference(*args, **options)
    if q.dtype not in _NATIVE_DTYPES:
        _native.notice_once(f"dtype:{q.dtype}", f"q dtype {q.dtype} is not supported by the CUDA kernel; "
                            "using the reference")
        return reference(*args, **options)
    lowest = min_valid_slot(invalid_slot)
    compiling = torch.compiler.is_compiling()
    if layout not in LAYOUTS or compiling:
        check()  # traced once under torch.compile: free at run time
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    op = torch.ops.cudelta.gdn_decode if kind == "gdn" else torch.ops.cudelta.kda_decode
    args = (q, k, v, g, beta, a, b, A_log, dt_bias, state, idx, out, scale, use_qk_l2norm, LAYOUTS.index(layout),
            lowest, st.variant)
    if compiling:  # the op names a pool it cannot address aligned, in check_kernel_pool's words
        op(*args)
        return out
    # Eager: the op checks every argument before it launches anything (nothing is written when it
    # refuses), so the Python checks, 4 us a call, run only to name a refused argument the way the
    # reference path does, or a pool whose slots the kernels cannot address aligned.
    try:
        op(*args)
    except RuntimeError:
        check()
        check_kernel_pool(state)
        raise
    return out


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor],
    beta: Optional[torch.Tensor],
    state: torch.Tensor,
    idx: torch.Tensor,
    *,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    layout: str = "kv",
    invalid_slot: str = "negative",
    out: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    output_gate: Optional[torch.Tensor] = None,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: Optional[float] = None,
    gate_activation: Optional[str] = None,
) -> torch.Tensor:
    """Gated DeltaNet decode: each request's tokens in order, the pool updated in place; returns o
    of v's shape and dtype.

    One token per request (as before): q, k [N, H, K]; v [N, HV, V] (HV a multiple of H); K and V
    each 64, 128 or 256; idx [N] int32/int64: state[idx[n]] is read and written in place.
    Gates, either precomputed: g (log-decay) and beta [N, HV]; or raw and fused into the kernel:
    g=None with a [N, HV], A_log [HV], dt_bias [HV] (g = -exp(A_log) * softplus(a + dt_bias)),
    and beta=None with b [N, HV] (beta = sigmoid(b)). The two halves may be mixed.
    state: the pool, [P, HV, K, V] (layout="kv") or [P, HV, V, K] (layout="vk", vLLM's), float32 or
    bfloat16 (math in float32); each slot's block contiguous, slots any whole number of elements
    >= one block apart (vLLM's padded pages). A request whose slot is < 0 (or <= 0 with
    invalid_slot="nonpositive", slot 0 being an engine's null block) or >= P gets a zero output and
    touches no state. out: an optional preallocated buffer of v's shape and dtype.

    Several tokens per request (speculative decoding): q, k [N, T, H, K], v [N, T, HV, V] and the
    per-token gates [N, T, ...]; or a flat token dimension, q, k [tokens, H, K] and so on, with
    cu_seqlens [N+1] (request n's tokens are cu_seqlens[n]:cu_seqlens[n+1]; T may differ per
    request; tokens after cu_seqlens[N] get zero outputs). idx [N] writes the state after the last
    token at idx[n]; idx [N, C] (C >= every T) stores the state after token t at idx[n, t] (an
    invalid slot is not written) and starts from the state at idx[n, 0], or at
    idx[n, num_accepted_tokens[n] - 1] with num_accepted_tokens [N]; a request with no valid
    starting slot gets zero outputs and writes nothing. The state is carried in fp32 from token to
    token.

    Epilogue (vLLM's gated RMSNorm): with output_gate z (v's shape) and norm_weight w [V], each
    head's output o, rounded to its dtype, becomes o * rsqrt(mean(o^2) + norm_eps) * w * act(z),
    rounded again; act = gate_activation ("silu", the default, or "sigmoid"); norm_eps 1e-5 unless
    given.

    Several tokens and the epilogue run on CPU tensors (the reference); on CUDA tensors this release
    raises NotSupportedOnCUDAError naming them. A padded pool runs on both; on CUDA tensors its slots
    must lie a multiple of 16 bytes apart and start on 16 bytes (vLLM's pages do).
    """
    return _decode("gdn", q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale, use_qk_l2norm, layout,
                   invalid_slot, out, dict(cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
                                           output_gate=output_gate, norm_weight=norm_weight, norm_eps=norm_eps,
                                           gate_activation=gate_activation))


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor],
    beta: Optional[torch.Tensor],
    state: torch.Tensor,
    idx: torch.Tensor,
    *,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    layout: str = "kv",
    invalid_slot: str = "negative",
    out: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    output_gate: Optional[torch.Tensor] = None,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: Optional[float] = None,
    gate_activation: Optional[str] = None,
) -> torch.Tensor:
    """Kimi Delta Attention decode: as gdn_decode, with a per-channel log-decay g [..., HV, K], or raw
    a [..., HV, K] with A_log [HV] and dt_bias [HV, K]."""
    return _decode("kda", q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale, use_qk_l2norm, layout,
                   invalid_slot, out, dict(cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
                                           output_gate=output_gate, norm_weight=norm_weight, norm_eps=norm_eps,
                                           gate_activation=gate_activation))
