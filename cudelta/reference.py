"""PyTorch reference of the delta-rule decode step (ARCHITECTURE.md, "The decode step").

Runs anywhere torch runs: it is what CPU tensors and pure-Python wheels use, and what the CUDA
kernels are tested against. It takes every option the kernels take (both state layouts, fp32 or
bf16 state, raw or precomputed gates, both invalid-slot rules, an `out=` buffer) and checks its
arguments the same way, so one call behaves alike on either path. Math in fp32; the state pool is
updated in place for valid slots only, so slots not named by `idx` stay bit-identical.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

LAYOUTS = ("kv", "vk")
INVALID_SLOT_RULES = ("negative", "nonpositive")
HEAD_DIMS = (64, 128, 256)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Raw GDN gate a [N, HV] -> log-decay g = -exp(A_log) * softplus(a + dt_bias)."""
    return -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Raw KDA gate a [N, HV, K] with A_log [HV], dt_bias [HV, K] -> per-channel log-decay."""
    return -torch.exp(A_log.float())[:, None] * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)


def min_valid_slot(invalid_slot: str) -> int:
    """The lowest slot that holds a state: 0, or 1 where slot 0 is the engine's null block (vLLM)."""
    if invalid_slot not in INVALID_SLOT_RULES:
        raise ValueError(f"invalid_slot={invalid_slot!r} is not accepted; expected one of {INVALID_SLOT_RULES}")
    return 0 if invalid_slot == "negative" else 1


def check_head_dims(K: int, V: int) -> None:
    for name, size in (("K", K), ("V", V)):
        if size not in HEAD_DIMS:
            raise ValueError(f"head dim {name}={size} is not supported; accepted: {', '.join(map(str, HEAD_DIMS))}")


def check_gates(kind, N, HV, K, g, beta, a, b, A_log, dt_bias) -> None:
    """The gate errors, named, without computing anything: the reference and the kernel path
    (cudelta.ops, per call) both check with this."""
    per_channel = kind == "kda"
    g_shape = (N, HV, K) if per_channel else (N, HV)
    raw = (a, A_log, dt_bias)
    if g is not None and any(x is not None for x in raw):
        raise ValueError("pass either g or the raw gate (a, A_log, dt_bias), not both")
    if g is None:
        if any(x is None for x in raw):
            missing = [n for n, x in zip(("a", "A_log", "dt_bias"), raw) if x is None]
            raise ValueError(f"no gate: pass g, or a with A_log and dt_bias (missing {', '.join(missing)})")
        bias_shape = (HV, K) if per_channel else (HV,)
        for name, x, want in (("a", a, g_shape), ("A_log", A_log, (HV,)), ("dt_bias", dt_bias, bias_shape)):
            if tuple(x.shape) != want:
                raise ValueError(f"{kind.upper()} {name} must be {list(want)}; got {list(x.shape)}")
    elif tuple(g.shape) != g_shape:
        hint = " (per-channel gates are KDA)" if not per_channel and g.dim() == 3 else ""
        raise ValueError(f"{kind.upper()} g must be {list(g_shape)}; got {list(g.shape)}{hint}")
    if (beta is None) == (b is None):
        raise ValueError("pass exactly one of beta (in (0, 1)) and b (raw, sigmoid applied)")
    x = beta if beta is not None else b
    if tuple(x.shape) != (N, HV):
        raise ValueError(f"{'beta' if beta is not None else 'b'} must be [{N}, {HV}]; got {list(x.shape)}")


def resolve_gates(kind, N, HV, K, g, beta, a, b, A_log, dt_bias):
    """(log-decay, beta) in fp32 from either the precomputed or the raw form, with named errors."""
    check_gates(kind, N, HV, K, g, beta, a, b, A_log, dt_bias)
    if g is None:
        g = (kda_gate if kind == "kda" else gdn_gate)(a, A_log, dt_bias)
    return g.float(), (beta.float() if beta is not None else torch.sigmoid(b.float()))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def check_args(q, k, v, state, idx, layout, out):
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not accepted; expected one of {LAYOUTS}")
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [N, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    N, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != N or v.shape[1] % H:
        raise ValueError(f"v must be [N, HV, V] with HV a multiple of H={H}; got {tuple(v.shape)}")
    HV, V = v.shape[1], v.shape[2]
    check_head_dims(K, V)
    want = (HV, K, V) if layout == "kv" else (HV, V, K)
    if state.dim() != 4 or tuple(state.shape[1:]) != want:
        raise ValueError(f"state must be [P, {', '.join(map(str, want))}] for layout {layout!r}; got {tuple(state.shape)}")
    if state.dtype not in STATE_DTYPES:
        raise ValueError(f"state dtype {state.dtype} is not accepted; expected one of: float32, bfloat16")
    if idx.shape != (N,) or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be an int32/int64 tensor of shape [{N}]; got {idx.dtype} {tuple(idx.shape)}")
    if out is not None and (tuple(out.shape) != (N, HV, V) or out.dtype != v.dtype):
        raise ValueError(f"out must be a {v.dtype} tensor of shape [{N}, {HV}, {V}]; got {out.dtype} {tuple(out.shape)}")


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
    invalid_slot: str = "negative",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One step. log_decay is [N, HV] (GDN) or [N, HV, K] (KDA), beta [N, HV] in (0, 1).

    Returns o [N, HV, V] in v's dtype (written into `out` when given); requests whose slot is
    invalid (negative, or also 0 with invalid_slot="nonpositive", or >= P) get a zero output and
    leave the pool untouched.
    """
    check_args(q, k, v, state, idx, layout, out)
    lowest = min_valid_slot(invalid_slot)
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    P = state.shape[0]
    scale = K ** -0.5 if scale is None else scale
    o_all = torch.zeros(N, HV, V, dtype=torch.float32, device=v.device)
    valid = (idx >= lowest) & (idx < P)
    if bool(valid.any()):
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
        o_all[rows] = torch.einsum("mhkv,mhk->mhv", h, qf)
        if layout == "vk":
            h = h.transpose(-1, -2)
        state[slots] = h.to(state.dtype)
    if out is None:
        return o_all.to(v.dtype)
    out.copy_(o_all)
    return out


def _decode(kind, q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, **options):
    N, _, K = q.shape
    HV = v.shape[1] if v.dim() == 3 else 0
    log_decay, beta = resolve_gates(kind, N, HV, K, g, beta, a, b, A_log, dt_bias)
    return delta_rule_decode_reference(q, k, v, log_decay, beta, state, idx, **options)


def gdn_decode_reference(q, k, v, g, beta, state, idx, *, a=None, b=None, A_log=None, dt_bias=None, scale=None,
                         use_qk_l2norm=False, layout="kv", invalid_slot="negative", out=None):
    """Gated DeltaNet: g is the [N, HV] log-decay, or raw a [N, HV] with A_log, dt_bias [HV] (see
    gdn_gate); beta [N, HV], or raw b with the sigmoid applied here."""
    return _decode("gdn", q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale=scale,
                   use_qk_l2norm=use_qk_l2norm, layout=layout, invalid_slot=invalid_slot, out=out)


def kda_decode_reference(q, k, v, g, beta, state, idx, *, a=None, b=None, A_log=None, dt_bias=None, scale=None,
                         use_qk_l2norm=False, layout="kv", invalid_slot="negative", out=None):
    """Kimi Delta Attention: g is the per-channel [N, HV, K] log-decay, or raw a [N, HV, K] with
    A_log [HV] and dt_bias [HV, K] (see kda_gate)."""
    return _decode("kda", q, k, v, g, beta, state, idx, a, b, A_log, dt_bias, scale=scale,
                   use_qk_l2norm=use_qk_l2norm, layout=layout, invalid_slot=invalid_slot, out=out)
