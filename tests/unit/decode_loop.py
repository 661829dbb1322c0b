"""The decode step as a per-request, per-head float64 loop, written straight from ARCHITECTURE.md,
and the inputs the CPU tests feed it: the independent computation that the PyTorch reference and
the public calls are checked against."""

import math

import torch

def softplus20(x: float) -> float:
    return x if x > 20 else math.log1p(math.exp(x))


def loop_gates(g, beta, a, b, A_log, dt_bias):
    """float64 log-decay and beta, from the precomputed or the raw form, element by element."""
    if g is None:
        g = torch.empty(a.shape, dtype=torch.float64)
        for i in range(a.numel()):
            n, hv, *kk = torch.unravel_index(torch.tensor(i), a.shape)
            bias = dt_bias[hv, kk[0]] if kk else dt_bias[hv]
            g.view(-1)[i] = -math.exp(float(A_log[hv])) * softplus20(float(a.reshape(-1)[i]) + float(bias))
    if beta is None:
        beta = 1.0 / (1.0 + torch.exp(-b.double()))
    return g.double(), beta.double()


def loop_reference(q, k, v, g, beta, state, idx, scale, l2norm, layout="kv", lowest=0, a=None, b=None, A_log=None,
                   dt_bias=None):
    g, beta = loop_gates(g, beta, a, b, A_log, dt_bias)
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    out = torch.zeros(N, HV, V, dtype=v.dtype)
    for n in range(N):
        s = int(idx[n])
        if s < lowest or s >= state.shape[0]:
            continue
        for hv in range(HV):
            h_ = hv // (HV // H)
            qq, kk = q[n, h_].double(), k[n, h_].double()
            if l2norm:
                qq = qq / torch.sqrt((qq * qq).sum() + 1e-6)
                kk = kk / torch.sqrt((kk * kk).sum() + 1e-6)
            qq = qq * scale
            h = state[s, hv].double()
            if layout == "vk":
                h = h.T
            gg = g[n, hv]
            h = h * (torch.exp(gg)[:, None] if gg.dim() == 1 else torch.exp(gg))
            u = beta[n, hv] * (v[n, hv].double() - h.T @ kk)
            h = h + torch.outer(kk, u)
            out[n, hv] = (h.T @ qq).to(v.dtype)
            state[s, hv] = (h.T if layout == "vk" else h).to(state.dtype)
    return out


def inputs(N=5, H=2, HV=4, K=64, V=64, P=7, kda=False, layout="kv", state_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(N, H, K, generator=gen), torch.randn(N, H, K, generator=gen)
    v = torch.randn(N, HV, V, generator=gen)
    g = -torch.rand(N, HV, K, generator=gen) if kda else -torch.rand(N, HV, generator=gen)
    beta = torch.rand(N, HV, generator=gen)
    shape = (P, HV, K, V) if layout == "kv" else (P, HV, V, K)
    state = (torch.randn(*shape, generator=gen) * 0.1).to(state_dtype)
    idx = torch.tensor([3, -1, 0, 6, 9][:N])  # -1 and 9 (>= P) are skipped
    return q, k, v, g, beta, state, idx


def raw_gates(N, HV, K, kda, seed=1):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(N, HV, K, generator=gen) * 3 if kda else torch.randn(N, HV, generator=gen) * 3
    a.view(-1)[0] = 25.0  # above softplus' threshold: softplus(x) = x there
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, K, generator=gen) if kda else torch.randn(HV, generator=gen)
    b = torch.randn(N, HV, generator=gen) * 2
    return a, b, A_log, dt_bias
