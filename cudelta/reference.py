"""PyTorch reference of the delta-rule decode step (ARCHITECTURE.md, "The decode step").

Runs anywhere torch runs: it is what CPU tensors and pure-Python wheels use, and what the CUDA
kernels are tested against. It takes every option of the contract (both state layouts, fp32 or
bf16 state, raw or precomputed gates, both invalid-slot rules, an `out=` buffer; several tokens per
request with a state checkpoint per token and a starting slot chosen by the accepted tokens; the
gated RMSNorm epilogue and its FP8 output; vLLM's padded pool) and checks its arguments with
cudelta._contract, as the kernel path does, so one call behaves alike on either path. Math in fp32, the state carried in
fp32 from token to token; the pool is written at valid slots only, so every other byte of it (slots
not named, an engine's padding between slots) stays bit-identical.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._call import DecodeCall
from ._contract import (  # noqa: F401  (the names this module exported before _contract held them)
    DEFAULT_NORM_EPS,
    FP8_DTYPE,
    FP8_MAX,
    HEAD_DIMS,
    INVALID_SLOT_RULES,
    LAYOUTS,
    STATE_DTYPES,
    Shape,
    check_call,
    check_decode_call,
    check_gates,
    check_head_dims,
    check_token_values,
    min_valid_slot,
)


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Raw GDN gate a [..., HV] -> log-decay g = -exp(A_log) * softplus(a + dt_bias)."""
    return -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: Optional[float] = None) -> torch.Tensor:
    """Raw KDA gate a [..., HV, K] with A_log [HV], dt_bias [HV, K] -> per-channel log-decay:
    -exp(A_log) * softplus(a + dt_bias), or with lower_bound < 0 the bounded form lower_bound *
    sigmoid(exp(A_log) * (a + dt_bias)) (vLLM's Kimi K3 "safe gate"; decays in [e^lower_bound, 1))."""
    x = a.float() + dt_bias.float()
    A = torch.exp(A_log.float())[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(A * x)
    return -A * F.softplus(x, beta=1.0, threshold=20.0)


def resolve_gates(kind, lead, HV, K, g, beta, a, b, A_log, dt_bias, lower_bound: Optional[float] = None):
    """(log-decay, beta) in fp32 from either the precomputed or the raw form, with named errors."""
    check_gates(kind, lead, HV, K, g, beta, a, b, A_log, dt_bias)
    if g is None:
        g = kda_gate(a, A_log, dt_bias, lower_bound) if kind == "kda" else gdn_gate(a, A_log, dt_bias)
    return g.float(), (beta.float() if beta is not None else torch.sigmoid(b.float()))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, activation: str) -> torch.Tensor:
    """The epilogue on outputs already rounded to their dtype, as vLLM's fused op and its unfused path
    (a stored output, then RMSNormGated) compute it: per head over V, in fp32,
    o * rsqrt(mean(o^2) + eps) * w * act(z), rounded once more to o's dtype."""
    x = o.float()
    zf = z.float()
    gate = torch.sigmoid(zf) if activation == "sigmoid" else zf * torch.sigmoid(zf)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float() * gate
    return y.to(o.dtype)


def static_fp8(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's static per-tensor FP8 quantization of an output already rounded to its dtype (its Qwen3.5
    gated-norm kernel's order, as scaled_fp8_quant's): y times 1 / scale (rounded to nearest, fp32),
    clamped to +-448, rounded to the nearest e4m3 value. A zero stays a zero of its sign, so that the
    outputs of skipped requests are zero bytes under any scale (vLLM's kernel makes a zero NaN under
    a scale of 0 or NaN, where 1 / scale is infinite or NaN: no scale an engine passes)."""
    x = y.float()
    x = torch.where(x == 0, x, x * torch.reciprocal(scale.float().reshape(())))
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _starting_slots(idx: torch.Tensor, accepted: Optional[torch.Tensor], columns: int) -> torch.Tensor:
    """Slot of each request's starting state [N] (int64, -1 where no column holds it): idx[n], or
    idx[n, acc[n] - 1] with idx [N, C] (acc 1 without num_accepted_tokens)."""
    idx = idx.long()
    if not columns:
        return idx
    col = torch.zeros_like(idx[:, 0]) if accepted is None else accepted.long().to(idx.device) - 1
    inside = (col >= 0) & (col < columns)
    return torch.where(inside, idx.gather(1, col.clamp(0, columns - 1)[:, None])[:, 0], -1)


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
    cu_seqlens: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    output_gate: Optional[torch.Tensor] = None,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: Optional[float] = None,
    gate_activation: Optional[str] = None,
    output_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The step for every request's tokens, in order. log_decay is lead + [HV] (GDN) or lead + [HV, K]
    (KDA), beta lead + [HV] in (0, 1), where lead is q's leading shape: [N], [N, T] or, with
    cu_seqlens, [tokens].

    Returns o of v's shape and dtype (written into `out` when given), or with output_scale
    float8_e4m3fn (static_fp8 of the epilogue's output). A request whose starting slot is invalid
    (negative, or also 0 with invalid_slot="nonpositive", or >= P, or no column of idx for its
    accepted tokens) gets zero outputs and writes nothing; so do tokens outside every request (after
    cu_seqlens[N]).
    """
    shape = check_call(q, k, v, state, idx, layout, out, cu_seqlens, num_accepted_tokens, output_gate, norm_weight,
                       norm_eps, gate_activation, output_scale=output_scale)
    cu = check_token_values(shape, cu_seqlens)
    lowest = min_valid_slot(invalid_slot)
    scale = shape.K ** -0.5 if scale is None else scale
    o, computed = _recurrence(shape, q, k, v, log_decay, beta, state, idx, cu, scale, use_qk_l2norm, layout,
                              lowest, num_accepted_tokens)
    if output_gate is not None:
        eps = DEFAULT_NORM_EPS if norm_eps is None else float(norm_eps)
        o = gated_rms_norm(o, output_gate.reshape(o.shape), norm_weight, eps, gate_activation or "silu")
        o = torch.where(computed[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
    if output_scale is not None:
        o = static_fp8(o, output_scale)
    o = o.reshape(v.shape)
    if out is None:
        return o
    out.copy_(o)
    return out


def _recurrence(shape: Shape, q, k, v, log_decay, beta, state, idx, cu, scale, use_qk_l2norm, layout, lowest,
                accepted) -> tuple[torch.Tensor, torch.Tensor]:
    """o [L, HV, V] in v's dtype and which tokens ran [L]; the pool written at each valid checkpoint
    slot (idx [N, C]) or, with idx [N], once at idx[n] after the request's last token."""
    L, H, K, HV, V = shape.L, shape.H, shape.K, shape.HV, shape.V
    P = state.shape[0]
    dev = v.device
    flat = lambda x, *inner: x.reshape(L, *inner)  # noqa: E731
    qf, kf, vf = flat(q, H, K), flat(k, H, K), flat(v, HV, V)
    gd = flat(log_decay, *log_decay.shape[len(shape.lead):]).float()
    bf = flat(beta, HV).float()
    o_all = torch.zeros(L, HV, V, dtype=v.dtype, device=dev)
    computed = torch.zeros(L, dtype=torch.bool, device=dev)
    start = _starting_slots(idx, accepted, shape.columns)
    valid = (start >= lowest) & (start < P)
    if not bool(valid.any()):
        return o_all, computed
    rows = valid.nonzero().squeeze(1)  # requests that run, on idx's device
    rows_cpu = rows.cpu()
    bos = cu[:-1][rows_cpu].to(dev)
    lens = (cu[1:] - cu[:-1])[rows_cpu].to(dev)
    group = HV // H
    h = state[start[rows]].float()
    if layout == "vk":
        h = h.transpose(-1, -2)  # math below is on [K, V]
    for t in range(int(lens.max()) if len(lens) else 0):
        live = lens > t  # requests that still have a token t
        tok = bos[live] + t
        hs = h[live]
        qt = qf[tok].float().repeat_interleave(group, dim=1)  # [M, HV, K]
        kt = kf[tok].float().repeat_interleave(group, dim=1)
        if use_qk_l2norm:
            qt, kt = _l2norm(qt), _l2norm(kt)
        qt = qt * scale
        g = gd[tok]
        hs = hs * (torch.exp(g)[..., None] if g.dim() == 3 else torch.exp(g)[..., None, None])  # rows of h
        u = bf[tok][..., None] * (vf[tok].float() - torch.einsum("mhkv,mhk->mhv", hs, kt))
        hs = hs + kt[..., :, None] * u[..., None, :]
        o_all[tok] = torch.einsum("mhkv,mhk->mhv", hs, qt).to(v.dtype)
        computed[tok] = True
        h[live] = hs
        if shape.columns:
            dst = idx[rows[live], t].long()
            ok = (dst >= lowest) & (dst < P)
            _store(state, dst[ok], hs[ok], layout)
    if not shape.columns:
        ran = lens > 0
        _store(state, start[rows][ran], h[ran], layout)
    return o_all, computed


def _store(state: torch.Tensor, slots: torch.Tensor, h: torch.Tensor, layout: str) -> None:
    if layout == "vk":
        h = h.transpose(-1, -2)
    state[slots] = h.to(state.dtype)


def decode_reference(call: DecodeCall) -> torch.Tensor:
    """The reference of one decode call (cudelta._call.DecodeCall): the gates resolved for its kind,
    then the step."""
    shape = check_decode_call(call)
    log_decay, beta = resolve_gates(call.kind, shape.lead, shape.HV, shape.K, call.g, call.beta, call.a, call.b,
                                    call.A_log, call.dt_bias, call.gate_lower_bound)
    return delta_rule_decode_reference(
        call.q, call.k, call.v, log_decay, beta, call.state, call.idx, scale=call.scale,
        use_qk_l2norm=call.use_qk_l2norm, layout=call.layout, invalid_slot=call.invalid_slot, out=call.out,
        cu_seqlens=call.cu_seqlens, num_accepted_tokens=call.num_accepted_tokens, output_gate=call.output_gate,
        norm_weight=call.norm_weight, norm_eps=call.norm_eps, gate_activation=call.gate_activation,
        output_scale=call.output_scale)


def _entry(kind: str, doc: str):
    """The reference with the public API's arguments (cudelta.gdn_decode / kda_decode): one call value,
    an unknown option refused by name."""
    def decode(q, k, v, g, beta, state, idx, **options):
        return decode_reference(DecodeCall(kind, q, k, v, g, beta, state, idx, **options))

    decode.__name__ = decode.__qualname__ = f"{kind}_decode_reference"
    decode.__doc__ = doc
    return decode


gdn_decode_reference = _entry("gdn", """Gated DeltaNet: g is the lead + [HV] log-decay, or raw a with A_log,
    dt_bias [HV] (see gdn_gate); beta lead + [HV], or raw b with the sigmoid applied here. Arguments and options:
    cudelta.gdn_decode.""")
kda_decode_reference = _entry("kda", """Kimi Delta Attention: g is the per-channel lead + [HV, K] log-decay, or
    raw a with A_log [HV] and dt_bias [HV, K] (see kda_gate). Arguments and options: cudelta.kda_decode.""")
