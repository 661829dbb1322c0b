"""Public ops: the CUDA kernel where it can run, the PyTorch reference everywhere else.

Both paths take one call value (cudelta._call.DecodeCall) and check arguments alike
(cudelta._contract.check_call and check_gates), so a call that is wrong fails the same way on a CPU
and on a GPU. Every option runs in the kernels on CUDA tensors: several tokens per request with a
checkpoint per token, the gated RMSNorm epilogue, vLLM's padded pool (whose 16-byte state accesses
add one rule on CUDA, check_kernel_pool), and the epilogue's FP8 output (output_scale), rounded in
the kernels' final store.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _native
from ._call import DecodeCall
from ._contract import (DEFAULT_NORM_EPS, FP8_DTYPE, INVALID_SLOT_RULES, LAYOUTS, check_call_overlap,
                        check_decode_call, check_gates, check_kernel_pool, min_valid_slot)
from .reference import decode_reference

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NotSupportedOnCUDAError(NotImplementedError):
    """An option of the contract that this release computes on CPU tensors only (the reference): on
    CUDA tensors it is refused, never run slowly behind an engine's back. No option is refused so
    today; engines that caught it keep working."""


_ACTIVATIONS = {None: 1, "silu": 1, "sigmoid": 2}  # the op's gate_activation (0: no epilogue)


def _rows(x: Optional[torch.Tensor], lead: int) -> Optional[torch.Tensor]:
    """A per-token tensor [N, T, ...] as rows of tokens [N * T, ...] (a view where strides allow)."""
    return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) if lead == 2 else x


def run_kernel(call: DecodeCall, out: torch.Tensor, variant: int = -1, pdl: Optional[bool] = None,
               early_state: bool = False) -> None:
    """The CUDA op on one call, writing `out` (v's shape and dtype; float8_e4m3fn with output_scale)
    and the pool in place: the one place where a call's value becomes the op's arguments. `variant`
    -1 is auto; `pdl` None takes CUDELTA_PDL as read at load. Dense [N, T, ...] tokens travel as rows
    of tokens with T given.
    early_state: only right after cudelta's conv update of the same step (kernels/launch.h,
    GdnDecodeParams::early_state), when the state's loads may start before the conv ends."""
    lead = 2 if call.q.dim() == 4 else 1
    T = call.q.shape[1] if lead == 2 else 1
    rows = out.view(-1, *out.shape[lead:]) if lead == 2 else out
    epilogue = call.output_gate is not None
    torch.ops.cudelta.decode(
        _rows(call.q, lead), _rows(call.k, lead), _rows(call.v, lead), _rows(call.g, lead), _rows(call.beta, lead),
        _rows(call.a, lead), _rows(call.b, lead), call.A_log, call.dt_bias, call.state, call.idx, rows,
        call.cu_seqlens, call.num_accepted_tokens, _rows(call.output_gate, lead), call.norm_weight,
        call.resolved_scale, DEFAULT_NORM_EPS if call.norm_eps is None else float(call.norm_eps), call.per_channel,
        call.use_qk_l2norm, LAYOUTS.index(call.layout), min_valid_slot(call.invalid_slot), T,
        _ACTIVATIONS[call.gate_activation] if epilogue else 0, variant,
        _native.status().pdl if pdl is None else pdl, early_state,
        0.0 if call.gate_lower_bound is None else float(call.gate_lower_bound), call.output_scale)


def _check(call: DecodeCall, overlap: bool = True) -> None:
    shape = check_decode_call(call, overlap)
    check_gates(call.kind, shape.lead, shape.HV, shape.K, call.g, call.beta, call.a, call.b, call.A_log, call.dt_bias)


def _decode(call: DecodeCall, early_state: bool = False) -> torch.Tensor:
    q = call.q
    st = _native.kernels_for(q)
    if st is None:
        return decode_reference(call)
    if q.dtype not in _NATIVE_DTYPES:
        _native.notice_once(f"dtype:{q.dtype}", f"q dtype {q.dtype} is not supported by the CUDA kernel; "
                            "using the reference")
        return decode_reference(call)
    compiling = torch.compiler.is_compiling()
    # Several tokens a request: the Python checks name a wrong shape before the rows of tokens are
    # formed from it (one token a request: the op checks, and the checks run on its refusal below).
    # Addresses are the op's to compare (overlap=False): it refuses a written tensor sharing memory
    # with a read one, and the except below names it.
    if call.multi_token or call.layout not in LAYOUTS or call.invalid_slot not in INVALID_SLOT_RULES or compiling:
        _check(call, overlap=False)  # traced once under torch.compile: free at run time
    dtype = call.v.dtype if call.output_scale is None else FP8_DTYPE
    out = torch.empty(call.v.shape, dtype=dtype, device=call.v.device) if call.out is None else call.out
    if call.q.dim() == 4 and not _viewable(out):
        # The op writes a scratch buffer here: out's own addresses are compared before it is copied.
        if not compiling:
            check_call_overlap(call)
        scratch = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        run_kernel(call, scratch, st.variant, early_state=early_state)
        return out.copy_(scratch)
    if compiling:  # the op names a pool it cannot address aligned, in check_kernel_pool's words
        run_kernel(call, out, st.variant, early_state=early_state)
        return out
    # Eager: the op checks every argument before it launches anything (nothing is written when it
    # refuses), so the Python checks, 4 us a call, run only to name a refused argument the way the
    # reference path does, or a pool whose slots the kernels cannot address aligned.
    try:
        run_kernel(call, out, st.variant, early_state=early_state)
    except RuntimeError:
        _check(call)
        check_kernel_pool(call.state)
        raise
    return out


def _viewable(out: torch.Tensor) -> bool:
    """Whether out [N, T, HV, V] can be written as rows of tokens in place."""
    return out.stride(0) == out.shape[1] * out.stride(1) or out.shape[1] == 1


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
    output_scale: Optional[torch.Tensor] = None,
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
    given. With output_scale, a float32 tensor of one element (vLLM's static per-tensor scale of an
    FP8 out_proj), o is returned as float8_e4m3fn: the epilogue's output, rounded to v's dtype, times
    1 / scale, clamped to +-448, rounded to e4m3 (vLLM's Qwen3.5 gated-norm kernel's order); out, if
    given, is then float8_e4m3fn. The kernels round it in their final store.

    Every option runs on CPU tensors (the reference) and CUDA tensors (the kernels). On CUDA tensors a
    padded pool's slots must lie a multiple of 16 bytes apart and start on 16 bytes (vLLM's pages do),
    and cu_seqlens' values are not read on the host (that would synchronise): a request whose tokens
    fall outside the rows, or outnumber idx's columns, is skipped (nothing written).
    """
    return _decode(DecodeCall("gdn", q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale, use_qk_l2norm,
                              layout, invalid_slot, out, cu_seqlens, num_accepted_tokens, output_gate, norm_weight,
                              norm_eps, gate_activation, output_scale=output_scale))


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
    gate_lower_bound: Optional[float] = None,
    output_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Kimi Delta Attention decode: as gdn_decode, with a per-channel log-decay g [..., HV, K], or raw
    a [..., HV, K] with A_log [HV] and dt_bias [HV, K]: -exp(A_log) * softplus(a + dt_bias), or, with
    gate_lower_bound < 0, gate_lower_bound * sigmoid(exp(A_log) * (a + dt_bias)) (vLLM's Kimi K3
    bounded "safe gate", cudelta.kda_gate)."""
    return _decode(DecodeCall("kda", q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale, use_qk_l2norm,
                              layout, invalid_slot, out, cu_seqlens, num_accepted_tokens, output_gate, norm_weight,
                              norm_eps, gate_activation, gate_lower_bound, output_scale))
