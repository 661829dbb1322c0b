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


def loop_epilogue(o, z, w, eps, act):
    """The gated RMSNorm of one head's output o (already in the output dtype), in float64."""
    x, zz = o.double(), z.double()
    gate = 1.0 / (1.0 + torch.exp(-zz))
    if act == "silu":
        gate = zz * gate
    return (x / torch.sqrt((x * x).mean() + eps) * w.double() * gate).to(o.dtype)


def loop_reference(q, k, v, g, beta, state, idx, scale, l2norm, layout="kv", lowest=0, a=None, b=None, A_log=None,
                   dt_bias=None, *, cu_seqlens=None, accepted=None, z=None, norm_weight=None, eps=1e-5, act="silu"):
    """Request by request, head by head, token by token. q [N, H, K] (a token each), [N, T, H, K], or
    [tokens, H, K] with cu_seqlens; the per-token tensors alike. idx [N]: start at and write back to
    idx[n]; idx [N, C]: start at idx[n, accepted[n] - 1] (accepted: 1 each if None), store the state
    after token t at idx[n, t]. z / norm_weight: the gated RMSNorm of each rounded output."""
    dense = q.dim() == 4
    N = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    if cu_seqlens is None:
        T = q.shape[1] if dense else 1
        cu_seqlens = [n * T for n in range(N + 1)]
    flat = lambda x: None if x is None else x.reshape(-1, *x.shape[(2 if dense else 1):])  # noqa: E731
    q, k, v, g, beta, a, b, z = map(flat, (q, k, v, g, beta, a, b, z))
    g, beta = loop_gates(g, beta, a, b, A_log, dt_bias)
    H = q.shape[1]
    HV, V = v.shape[1], v.shape[2]
    P = state.shape[0]
    out = torch.zeros(v.shape, dtype=v.dtype)
    for n in range(N):
        bos, eos = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        if idx.dim() == 2:
            acc = 1 if accepted is None else int(accepted[n])
            s = int(idx[n, acc - 1]) if 1 <= acc <= idx.shape[1] else -1
        else:
            s = int(idx[n])
        if s < lowest or s >= P:
            continue
        for hv in range(HV):
            h_ = hv // (HV // H)
            h = state[s, hv].double()
            if layout == "vk":
                h = h.T
            for t in range(eos - bos):
                row = bos + t
                qq, kk = q[row, h_].double(), k[row, h_].double()
                if l2norm:
                    qq = qq / torch.sqrt((qq * qq).sum() + 1e-6)
                    kk = kk / torch.sqrt((kk * kk).sum() + 1e-6)
                qq = qq * scale
                gg = g[row, hv]
                h = h * (torch.exp(gg)[:, None] if gg.dim() == 1 else torch.exp(gg))
                u = beta[row, hv] * (v[row, hv].double() - h.T @ kk)
                h = h + torch.outer(kk, u)
                o = (h.T @ qq).to(v.dtype)
                out[row, hv] = o if z is None else loop_epilogue(o, z[row, hv], norm_weight, eps, act)
                if idx.dim() == 2 and lowest <= int(idx[n, t]) < P:
                    state[int(idx[n, t]), hv] = (h.T if layout == "vk" else h).to(state.dtype)
            if idx.dim() == 1 and eos > bos:
                state[s, hv] = (h.T if layout == "vk" else h).to(state.dtype)
    return out.reshape(N, -1, HV, V) if dense else out


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


def token_inputs(lens, H=2, HV=4, K=64, V=64, kda=False, dtype=torch.float32, seed=0):
    """Per-token inputs of a flat token dimension: q, k, v, g, beta, the raw a, b (A_log, dt_bias per
    head), the epilogue's z and w, and cu_seqlens [N+1] for requests of `lens` tokens."""
    gen = torch.Generator().manual_seed(seed)
    L = sum(lens)
    t = dict(
        q=torch.randn(L, H, K, generator=gen).to(dtype), k=torch.randn(L, H, K, generator=gen).to(dtype),
        v=torch.randn(L, HV, V, generator=gen).to(dtype),
        g=-torch.rand(*((L, HV, K) if kda else (L, HV)), generator=gen) * 0.5,
        beta=torch.rand(L, HV, generator=gen),
        z=(torch.randn(L, HV, V, generator=gen) * 2).to(dtype), w=1 + torch.randn(V, generator=gen) * 0.2,
        cu_seqlens=torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))]),
    )
    t["a"], t["b"], t["A_log"], t["dt_bias"] = raw_gates(L, HV, K, kda, seed=seed + 1)
    return t


def random_pool(P, HV, K, V, layout="kv", state_dtype=torch.float32, seed=2):
    gen = torch.Generator().manual_seed(seed)
    shape = (P, HV, K, V) if layout == "kv" else (P, HV, V, K)
    return (torch.randn(*shape, generator=gen) * 0.1).to(state_dtype)


def vllm_pool(P, HV, K, V, layout="vk", state_dtype=torch.float32, conv_bytes=4096, pad_bytes=528, seed=3):
    """A state pool laid out as vLLM's mamba cache binds it (MambaBase.bind_kv_cache): one int8 page per
    slot holding the conv state, then this state, then padding up to the padded page size; the state
    is `pages[:, conv:conv + nbytes].view(dtype).view(-1, *shape)`, a view whose slot stride is the
    page. Returns (pages, state); every byte of pages is random, the state's values are then set."""
    gen = torch.Generator().manual_seed(seed)
    inner = (HV, K, V) if layout == "kv" else (HV, V, K)
    nbytes = math.prod(inner) * torch.empty((), dtype=state_dtype).element_size()
    pages = torch.randint(-128, 128, (P, conv_bytes + nbytes + pad_bytes), generator=gen, dtype=torch.int8)
    state = pages[:, conv_bytes:conv_bytes + nbytes].view(state_dtype).view(-1, *inner)
    state.copy_(random_pool(P, HV, K, V, layout, state_dtype, seed))
    return pages, state
