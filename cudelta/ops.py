"""Public ops: the CUDA kernel where it can run, the PyTorch reference everywhere else."""

from __future__ import annotations

from typing import Optional

import torch

from . import _native
from .reference import gdn_decode_reference, kda_decode_reference

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _native_unsupported(q, v, g, beta, state, layout) -> Optional[str]:
    """Inputs the CUDA kernel does not take (the reference does): say which, for the notice."""
    if layout != "kv":
        return f"layout {layout!r} (the kernel takes 'kv')"
    if state.dtype != torch.float32:
        return f"state dtype {state.dtype} (the kernel takes float32)"
    if q.shape[-1] not in (64, 128):
        return f"K={q.shape[-1]} (the kernel takes 64 or 128)"
    if v.shape[-1] % 32:
        return f"V={v.shape[-1]} (the kernel takes multiples of 32)"
    if q.dtype not in _NATIVE_DTYPES:
        return f"dtype {q.dtype}"
    return None


def _decode(kind, q, k, v, g, beta, state, idx, scale, use_qk_l2norm, layout):
    reference = gdn_decode_reference if kind == "gdn" else kda_decode_reference
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    args = (q, k, v, g, beta, state, idx)
    if not q.is_cuda:
        _native.notice_once("cpu", "CPU tensors run the PyTorch reference (the kernels need CUDA tensors)")
        return reference(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, layout=layout)
    st = _native.status()
    if not st.loaded:
        if st.path is not None:  # a library that exists but cannot run here is an error, not a slow path
            raise _native.NativeLibraryError(f"cudelta: {st.reason}")
        _native.notice_once("no-native", f"{st.reason}; CUDA tensors use the PyTorch reference (slow)")
        return reference(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, layout=layout)
    why = _native_unsupported(q, v, g, beta, state, layout)
    if why:
        _native.notice_once(f"unsupported:{why}", f"{why} is not supported by the CUDA kernel; using the reference")
        return reference(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, layout=layout)
    op = torch.ops.cudelta.gdn_decode if kind == "gdn" else torch.ops.cudelta.kda_decode
    return op(q, k, v, g.float(), beta.float(), state, idx, scale, use_qk_l2norm, st.variant)


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    idx: torch.Tensor,
    *,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    layout: str = "kv",
) -> torch.Tensor:
    """One Gated DeltaNet decode step; `state[idx[n]]` is updated in place, returns o [N, HV, V].

    q, k [N, H, K]; v [N, HV, V]; g (log-decay) and beta [N, HV]; state [P, HV, K, V] ("kv");
    idx [N] int32/int64 with negative entries skipped (their output is zero).
    """
    return _decode("gdn", q, k, v, g, beta, state, idx, scale, use_qk_l2norm, layout)


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    idx: torch.Tensor,
    *,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    layout: str = "kv",
) -> torch.Tensor:
    """One Kimi Delta Attention decode step: as gdn_decode, with a per-channel log-decay g [N, HV, K]."""
    return _decode("kda", q, k, v, g, beta, state, idx, scale, use_qk_l2norm, layout)
