"""Public ops: the CUDA kernel where it can run, the PyTorch reference everywhere else.

Both paths take the same options and check arguments alike (cudelta.reference.check_args and
check_gates), so a call that is wrong fails the same way on a CPU and on a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _native
from .reference import (
    LAYOUTS,
    check_args,
    check_gates,
    gdn_decode_reference,
    kda_decode_reference,
    min_valid_slot,
)

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _decode(kind, q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale, use_qk_l2norm, layout, invalid_slot,
            out):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    options = dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, layout=layout,
                   invalid_slot=invalid_slot, out=out)
    reference = gdn_decode_reference if kind == "gdn" else kda_decode_reference
    args = (q, k, v, g, beta, state, idx)
    if not q.is_cuda:
        _native.notice_once("cpu", "CPU tensors run the PyTorch reference (the kernels need CUDA tensors)")
        return reference(*args, **options)
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

    def check():
        check_args(q, k, v, state, idx, layout, out)
        check_gates(kind, q.shape[0], v.shape[1], q.shape[2], g, beta, a, b, A_log, dt_bias)

    compiling = torch.compiler.is_compiling()
    if layout not in LAYOUTS or compiling:
        check()  # traced once under torch.compile: free at run time
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    op = torch.ops.cudelta.gdn_decode if kind == "gdn" else torch.ops.cudelta.kda_decode
    args = (q, k, v, g, beta, a, b, A_log, dt_bias, state, idx, out, scale, use_qk_l2norm, LAYOUTS.index(layout),
            lowest, st.variant)
    if compiling:
        op(*args)
        return out
    # Eager: the op checks every argument before it launches anything (nothing is written when it
    # refuses), so the Python checks, 4 us a call, run only to name a refused argument the way the
    # reference path does.
    try:
        op(*args)
    except RuntimeError:
        check()
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
) -> torch.Tensor:
    """One Gated DeltaNet decode step; `state[idx[n]]` is updated in place, returns o [N, HV, V].

    q, k [N, H, K]; v [N, HV, V] (HV a multiple of H); K and V each 64, 128 or 256.
    Gates, either precomputed: g (log-decay) and beta [N, HV]; or raw and fused into the kernel:
    g=None with a [N, HV], A_log [HV], dt_bias [HV] (g = -exp(A_log) * softplus(a + dt_bias)),
    and beta=None with b [N, HV] (beta = sigmoid(b)). The two halves may be mixed.
    state: the pool, [P, HV, K, V] (layout="kv") or [P, HV, V, K] (layout="vk", vLLM's), float32 or
    bfloat16 (math in float32). idx [N] int32/int64: a request whose slot is < 0 (or <= 0 with
    invalid_slot="nonpositive", slot 0 being an engine's null block) or >= P gets a zero output and
    touches no state. out: an optional preallocated [N, HV, V] buffer of v's dtype.
    """
    return _decode("gdn", q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale, use_qk_l2norm, layout,
                   invalid_slot, out)


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
) -> torch.Tensor:
    """One Kimi Delta Attention decode step: as gdn_decode, with a per-channel log-decay g [N, HV, K],
    or raw a [N, HV, K] with A_log [HV] and dt_bias [HV, K]."""
    return _decode("kda", q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale, use_qk_l2norm, layout,
                   invalid_slot, out)
