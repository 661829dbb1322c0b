"""PyTorch reference of the delta-rule decode step (DESIGN.md, "The kernels").

Runs anywhere torch runs: it is what CPU tensors and pure-Python wheels use, and what the CUDA
kernels are tested against. Math in fp32; the state pool is updated in place for valid slots
only, so slots not named by `idx` stay bit-identical.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

LAYOUTS = ("kv", "vk")


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Raw GDN gate a [N, HV] -> log-decay g = -exp(A_log) * softplus(a + dt_bias)."""
    return -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Raw KDA gate a [N, HV, K] with A_log [HV], dt_bias [HV, K] -> per-channel log-decay."""
    return -torch.exp(A_log.float())[:, None] * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _check(q, k, v, state, idx, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not accepted; expected one of {LAYOUTS}")
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [N, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    N, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != N or v.shape[1] % H:
        raise ValueError(f"v must be [N, HV, V] with HV a multiple of H={H}; got {tuple(v.shape)}")
    HV, V = v.shape[1], v.shape[2]
    want = (HV, K, V) if layout == "kv" else (HV, V, K)
    if state.dim() != 4 or tuple(state.shape[1:]) != want:
        raise ValueError(f"state must be [P, {', '.join(map(str, want))}] for layout {layout!r}; got {tuple(state.shape)}")
    if idx.shape != (N,) or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be an int32/int64 tensor of shape [{N}]; got {idx.dtype} {tuple(idx.shape)}")


def delta_rule_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    idx: torch.Tensor,
    *,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
    layout: str = "kv",
) -> torch.Tensor:
    """One step. log_decay is [N, HV] (GDN) or [N, HV, K] (KDA). Returns o [N, HV, V] in v's dtype."""
    _check(q, k, v, state, idx, layout)
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    P = state.shape[0]
    scale = K ** -0.5 if scale is None else scale
    out = torch.zeros(N, HV, V, dtype=v.dtype, device=v.device)
    valid = (idx >= 0) & (idx < P)
    if not bool(valid.any()):
        return out
    rows = valid.nonzero().squeeze(1)
    slots = idx[rows].long()

    group = HV // H
    qf = q[rows].float().repeat_interleave(group, dim=1)  # [M, HV, K]
    kf = k[rows].float().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * scale
    vf = v[rows].float()
    b = beta[rows].float()[..., None]  # [M, HV, 1]
    gd = log_decay[rows].float()
    decay = torch.exp(gd)[..., None] if gd.dim() == 3 else torch.exp(gd)[..., None, None]  # rows of h

    h = state[slots].float()
    if layout == "vk":
        h = h.transpose(-1, -2)  # math below is on [K, V]
    h = h * decay
    pred = torch.einsum("mhkv,mhk->mhv", h, kf)
    u = b * (vf - pred)
    h = h + kf[..., :, None] * u[..., None, :]
    o = torch.einsum("mhkv,mhk->mhv", h, qf)
    if layout == "vk":
        h = h.transpose(-1, -2)
    state[slots] = h.to(state.dtype)
    out[rows] = o.to(v.dtype)
    return out


def gdn_decode_reference(q, k, v, g, beta, state, idx, *, scale=None, use_qk_l2norm=False, layout="kv"):
    """Gated DeltaNet: g is the [N, HV] log-decay (see gdn_gate for the raw form)."""
    if g.dim() != 2:
        raise ValueError(f"GDN g must be [N, HV]; got {tuple(g.shape)} (per-channel gates are KDA)")
    return delta_rule_decode_reference(q, k, v, g, beta, state, idx, scale=scale,
                                       use_qk_l2norm=use_qk_l2norm, layout=layout)


def kda_decode_reference(q, k, v, g, beta, state, idx, *, scale=None, use_qk_l2norm=False, layout="kv"):
    """Kimi Delta Attention: g is the per-channel [N, HV, K] log-decay (see kda_gate)."""
    if g.dim() != 3:
        raise ValueError(f"KDA g must be [N, HV, K]; got {tuple(g.shape)}")
    return delta_rule_decode_reference(q, k, v, g, beta, state, idx, scale=scale,
                                       use_qk_l2norm=use_qk_l2norm, layout=layout)
