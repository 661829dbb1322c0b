"""Per-element tolerances for one delta-rule decode step, and for several tokens per request with the
gated RMSNorm epilogue (unit tests of the reference, GPU tests of the kernels).

Each element is held to its own error scale, never to the largest value of the tensor: an element
100x smaller than the largest gets a 100x tighter bound. The scale is the standard forward-error
one: the same step computed on absolute values (|state|, |k|, |v|, |q|, no cancellation), so a
sum of N terms may be off by a few eps32 times the sum of the |terms|, while an element that is
small because its terms are small is held to that. On top, one unit in the last place of the
stored dtype at the element's own value: both sides round the same fp32 number to bf16/fp16, and
where they are a hair apart across a rounding boundary they land one ulp apart.

    tolerance_i = ulp(dtype, |expected_i|) + rel * magnitude_i
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

# fp32 math in another order (the kernels reduce in shuffle trees, the reference with einsum), the
# fast exp/log of the fused gates (within 1e-6 relative, kernels/common/step.cuh softplus20) and
# rsqrtf in the l2 norm: each well under 1e-6 of the element's magnitude; 2e-5 leaves 10x.
FP32_STEP_REL = 2e-5

_MANTISSA_BITS = {torch.float32: 23, torch.float64: 52, torch.bfloat16: 7, torch.float16: 10}


def ulp(dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of `dtype` at |x| (x in any float dtype; at 0: the smallest
    normal's ulp)."""
    finfo = torch.finfo(dtype)
    ax = x.double().abs().clamp_min(finfo.tiny)
    _, exponent = torch.frexp(ax)  # ax = m * 2**exponent, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(ax), exponent - 1 - _MANTISSA_BITS[dtype])


@dataclass(frozen=True)
class Magnitudes:
    """The step on absolute values, float64: `out` [N, HV, V], `state` the pool's shape; zero where
    the request is skipped (its output is exactly 0, its slot untouched)."""

    out: torch.Tensor
    state: torch.Tensor


def step_magnitudes(q, k, v, log_decay, beta, state, idx, *, scale=None, use_qk_l2norm=False, layout="kv",
                    lowest=0) -> Magnitudes:
    """q, k [N, H, K]; v [N, HV, V]; log_decay [N, HV] or [N, HV, K] (fp, already resolved from raw
    gates); beta [N, HV] in (0, 1); state the pool BEFORE the step; idx [N]."""
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    P = state.shape[0]
    scale = K ** -0.5 if scale is None else scale
    # float64 on the inputs' device: a GPU test's pool can be gigabytes
    dev = state.device
    out = torch.zeros(N, HV, V, dtype=torch.float64, device=dev)
    pool = torch.zeros(state.shape, dtype=torch.float64, device=dev)
    idx_c = idx.to(dev).long()
    rows = ((idx_c >= lowest) & (idx_c < P)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return Magnitudes(out, pool)
    group = HV // H
    qa = q[rows].double().repeat_interleave(group, dim=1)
    ka = k[rows].double().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        qa = qa / torch.sqrt((qa * qa).sum(-1, keepdim=True) + 1e-6)
        ka = ka / torch.sqrt((ka * ka).sum(-1, keepdim=True) + 1e-6)
    qa, ka = (qa * scale).abs(), ka.abs()
    va = v[rows].double().abs()
    b = beta[rows].double().abs()[..., None]
    gd = log_decay[rows].double()
    decay = torch.exp(gd)[..., None] if gd.dim() == 3 else torch.exp(gd)[..., None, None]
    slots = idx_c[rows]
    h = state[slots].double().abs()
    if layout == "vk":
        h = h.transpose(-1, -2)
    h = h * decay
    u = b * (va + torch.einsum("mhkv,mhk->mhv", h, ka))
    h = h + ka[..., :, None] * u[..., None, :]
    out[rows] = torch.einsum("mhkv,mhk->mhv", h, qa)
    pool[slots] = h.transpose(-1, -2) if layout == "vk" else h
    return Magnitudes(out, pool)


@dataclass(frozen=True)
class TokenMagnitudes:
    """Several tokens per request: `out` [tokens, HV, V] and, for each slot the call stores a state
    at, that state's magnitude (the pool's slot shape). Token t of a request (from 0) counts t + 1
    times its own magnitude: see token_magnitudes."""

    out: torch.Tensor
    state: dict[int, torch.Tensor]


def token_magnitudes(q, k, v, log_decay, beta, state, idx, cu_seqlens, *, accepted=None, scale=None,
                     use_qk_l2norm=False, layout="kv", lowest=0) -> TokenMagnitudes:
    """The error scales of a multi-token call (ARCHITECTURE.md, "Several tokens per request"), float64
    on the inputs' device. q, k [tokens, H, K]; v [tokens, HV, V]; log_decay [tokens, HV] or
    [tokens, HV, K] and beta [tokens, HV] resolved; request n's tokens are cu_seqlens[n] to
    cu_seqlens[n+1] (a sequence of ints); state the pool BEFORE the call; idx [N] (the state after
    the last token stored at idx[n]) or [N, C] (start at idx[n, accepted[n] - 1], store after token t
    at idx[n, t] where valid).

    The absolute-value step of step_magnitudes, carried over the tokens as the state is. It bounds
    what an earlier token's error turns into: the error e of h passes through the same linear map,
    |exp(g) e - beta k k^T exp(g) e| <= exp(g) |e| + beta |k| (|k|^T exp(g) |e|), so t + 1 steps of at
    most `rel` each leave token t within (t + 1) * rel of its carried magnitude: the magnitudes of
    token t are weighted by t + 1 (outputs and stored states alike)."""
    L, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    P = state.shape[0]
    scale = K ** -0.5 if scale is None else scale
    group = HV // H
    qa = q.double().repeat_interleave(group, dim=1)
    ka = k.double().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        qa = qa / torch.sqrt((qa * qa).sum(-1, keepdim=True) + 1e-6)
        ka = ka / torch.sqrt((ka * ka).sum(-1, keepdim=True) + 1e-6)
    qa, ka, va = (qa * scale).abs(), ka.abs(), v.double().abs()
    decay = torch.exp(log_decay.double())
    decay = decay[..., None] if decay.dim() == 3 else decay[..., None, None]  # rows of h: [tokens, HV, K|1, 1]
    b = beta.double().abs()[..., None]
    out = torch.zeros(L, HV, V, dtype=torch.float64, device=q.device)
    stored: dict[int, torch.Tensor] = {}
    vk = (lambda h: h.transpose(-1, -2)) if layout == "vk" else (lambda h: h)  # noqa: E731
    for n in range(len(cu_seqlens) - 1):
        bos, eos = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        if idx.dim() == 2:
            acc = 1 if accepted is None else int(accepted[n])
            s = int(idx[n, acc - 1]) if 1 <= acc <= idx.shape[1] else -1
        else:
            s = int(idx[n])
        if not lowest <= s < P or eos == bos:
            continue
        h = vk(state[s].double().abs())
        for t in range(eos - bos):
            r = bos + t
            h = h * decay[r]
            u = b[r] * (va[r] + torch.einsum("hkv,hk->hv", h, ka[r]))
            h = h + ka[r][..., :, None] * u[..., None, :]
            out[r] = (t + 1) * torch.einsum("hkv,hk->hv", h, qa[r])
            if idx.dim() == 2 and lowest <= int(idx[n, t]) < P:
                stored[int(idx[n, t])] = (t + 1) * vk(h)
        if idx.dim() == 1:
            stored[s] = (eos - bos) * vk(h)
    return TokenMagnitudes(out, stored)


def epilogue_tolerance(y: torch.Tensor, o: torch.Tensor, o_tol: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                       eps: float, activation: str, rel: float = FP32_STEP_REL) -> torch.Tensor:
    """Per element of the gated RMSNorm's expected output y = o * rsqrt(mean(o^2) + eps) * w * act(z)
    (the mean per head, over the last dim), where the o the other side normalises may differ from
    this o by up to o_tol per element (its own tolerance): what that moves y by, bounded exactly (not
    to first order), plus the norm's own fp32 error (rel * |y|) and one ulp of y's dtype at y.

    With c = |w act(z)|, s = rsqrt(mean(o^2) + eps) and ds the most s can move when mean(o^2) moves
    by its bound dm = mean(2 |o| o_tol + o_tol^2): |y' - y| <= c (o_tol (s + ds) + |o| ds)."""
    x, tol = o.double(), o_tol.double()
    zz = z.double()
    act = torch.sigmoid(zz) if activation == "sigmoid" else zz * torch.sigmoid(zz)
    c = (weight.double() * act).abs()
    ms = x.square().mean(-1, keepdim=True) + eps
    dm = (2 * x.abs() * tol + tol.square()).mean(-1, keepdim=True)
    s = torch.rsqrt(ms)
    # rsqrt is convex and decreasing: it moves most toward the smaller mean; unbounded past zero
    ds = torch.where(dm < ms, torch.rsqrt((ms - dm).clamp_min(1e-300)) - s, torch.full_like(s, float("inf")))
    return ulp(y.dtype, y) + c * (tol * (s + ds) + x.abs() * ds) + rel * c * x.abs() * s


def tolerance(expected: torch.Tensor, magnitude: torch.Tensor, rel: float = FP32_STEP_REL) -> torch.Tensor:
    """Per element: one ulp of expected's dtype at its value, plus rel times the element's magnitude."""
    return ulp(expected.dtype, expected) + rel * magnitude.double()


def worst_ratio(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> tuple[float, tuple]:
    """max_i |actual_i - expected_i| / tol_i and where it is (a ratio > 1 fails)."""
    err = (actual.double() - expected.double().to(actual.device)).abs()
    ratio = err / tol.to(actual.device)
    ratio = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), ratio)
    flat = int(ratio.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ratio.shape))
    return float(ratio.reshape(-1)[flat]), where


def assert_each_element_close(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, what: str,
                              rel: float = FP32_STEP_REL) -> float:
    """Fails naming the worst element, its two values and its own tolerance; returns the worst
    error / tolerance ratio (at most 1)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tol = tolerance(expected, magnitude.to(expected.device), rel)
    return assert_within(actual, expected, tol, what, magnitude)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, what: str,
                  magnitude: Optional[torch.Tensor] = None, rows: Optional[list] = None) -> float:
    """Each element within its own tolerance `tol`: fails naming the worst element (its first index
    as rows[i] where given: the slot a row of gathered states came from), its two values, its
    tolerance (and its magnitude, where given); returns the worst error / tolerance ratio."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    ratio, where = worst_ratio(actual, expected, tol)
    note = "" if magnitude is None else f"element magnitude {float(magnitude[where]):.3g}; "
    label = list(where) if rows is None else f"[slot {rows[where[0]]}{''.join(f', {i}' for i in where[1:])}]"
    assert ratio <= 1.0, (
        f"{what}{label}: {float(actual[where]):.9g} vs expected {float(expected[where]):.9g}, "
        f"|diff| {abs(float(actual[where]) - float(expected[where])):.3g} > tolerance {float(tol[where]):.3g} "
        f"({note}{ratio:.3g}x the tolerance)")
    log = os.environ.get("CUDELTA_TEST_RATIO_LOG")
    if log:  # how close each check came to its tolerance: the headroom, read after a GPU run
        with open(log, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]} {what} {ratio:.4g}\n")
    return ratio
