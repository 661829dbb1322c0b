"""vLLM 0.33's Kimi K3 KDA decode call (vllm._custom_ops.fused_kda_decode) as its layer builds it, and
an independent float64 model of what the op computes, written from vLLM's Triton kernels
(kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py: the gates, the step) and its conv and gated
RMSNorm, one request and one head at a time. Shared by tests/unit/test_vllm_kda.py (CPU) and
tests/gpu/test_vllm_kda_gpu.py."""

from __future__ import annotations

import torch

D, W = 128, 4  # head dim, conv width
PAGE_ALIGN = 32 << 10


def kimi_call(B, H, slots, seed, *, layout="SD", epilogue=True, lower_bound=-5.0, bias=False,
              state_dtype=torch.float32, device="cpu", idx=None):
    """The op's keyword arguments on one pool of vLLM-style pages (conv state, then the recurrent state,
    padded to 32 KiB; slot 0 the null block), and the pages themselves."""
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    dim = 3 * H * D

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    conv_bytes = (W - 1) * dim * 2
    itemsize = torch.empty((), dtype=state_dtype).element_size()
    block = H * D * D * itemsize
    page = -(-(conv_bytes + block) // PAGE_ALIGN) * PAGE_ALIGN
    pages = torch.randint(-128, 128, (slots, page), generator=gen, dtype=torch.int8).to(device)
    conv_view = pages[:, :conv_bytes].view(bf16)
    conv_view.copy_(randn(slots, conv_bytes // 2, dtype=bf16))
    state = pages[:, conv_bytes:conv_bytes + block].view(state_dtype).view(slots, H, D, D)
    state.copy_(randn(slots, H, D, D, scale=0.1, dtype=state_dtype))
    # SD: pages hold [3, dim] and the layer hands the op the transposed view; DS: [dim, 3].
    conv_state = (conv_view.view(slots, W - 1, dim).transpose(1, 2) if layout == "SD"
                  else conv_view.view(slots, dim, W - 1))
    # x and output_gate: views of one projection row (x's row stride is not its width), as the layer splits it.
    proj = randn(B, dim + H * D + 16, dtype=bf16)
    if idx is None:
        idx = torch.randperm(slots - 1, generator=gen)[:B].to(torch.int32) + 1
    args = dict(
        x=proj[:, :dim], weight=randn(3, W, H * D, scale=0.3), bias=randn(dim, scale=0.1) if bias else None,
        conv_state=conv_state, raw_g=randn(1, B, H, D, dtype=bf16), raw_beta=randn(B, H + 3, dtype=bf16)[:, :H][None],
        A_log=randn(H, scale=0.5), dt_bias=randn(H * D), state_indices=idx.to(device), state=state,
        lower_bound=lower_bound, output_gate=proj[:, dim:dim + H * D].unflatten(1, (H, D)) if epilogue else None,
        norm_weight=(1 + randn(D, scale=0.2)) if epilogue else None, norm_eps=1e-5)
    return args, pages


def kimi_model(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [1, B, H, D] float64, conv_state and state after the call, float64 copies): vLLM's op in
    float64 from its formulas, a request at a time; slots <= 0 skipped (zero output)."""
    f = torch.float64
    x, idx = args["x"].to(f).cpu(), args["state_indices"].tolist()
    B, H = x.shape[0], args["A_log"].shape[0]
    weight = args["weight"].to(f).cpu()                         # [3, W, H*D]: q, k, v each tap-major
    w = weight.permute(0, 2, 1).reshape(3 * H * D, W)            # channel c's taps
    bias = torch.zeros(3 * H * D, dtype=f) if args["bias"] is None else args["bias"].to(f).cpu()
    conv = args["conv_state"].to(f).cpu().clone()
    state = args["state"].to(f).cpu().clone()
    g_raw, beta_raw = args["raw_g"][0].to(f).cpu(), args["raw_beta"][0].to(f).cpu()
    A, dt = torch.exp(args["A_log"].to(f).cpu()), args["dt_bias"].to(f).cpu().view(H, D)
    lb = args["lower_bound"]
    out = torch.zeros(1, B, H, D, dtype=f)
    for n, slot in enumerate(idx):
        if slot <= 0:
            continue
        seq = torch.cat([conv[slot], x[n][:, None]], dim=1)      # [dim, W]
        y = (w * seq).sum(1) + bias
        y = y * torch.sigmoid(y)                                   # SiLU
        y = y.to(torch.bfloat16).to(f)                             # the conv's output, bf16 (x's dtype)
        conv[slot] = seq[:, 1:]
        q, k, v = y.view(3, H, D)
        for h in range(H):
            qh = q[h] / torch.sqrt((q[h] * q[h]).sum() + 1e-6) * D ** -0.5
            kh = k[h] / torch.sqrt((k[h] * k[h]).sum() + 1e-6)
            gx = g_raw[n, h] + dt[h]
            if lb is not None:
                log_decay = lb * torch.sigmoid(A[h] * gx)
            else:
                log_decay = -A[h] * torch.where(gx > 20, gx, torch.log1p(torch.exp(gx)))
            S = state[slot, h]                                     # [V, K]
            S = S * torch.exp(log_decay)[None, :]
            u = (v[h] - S @ kh) * torch.sigmoid(beta_raw[n, h])
            S = S + u[:, None] * kh[None, :]
            state[slot, h] = S
            o = S @ qh
            if args["output_gate"] is not None:
                o = o.to(torch.bfloat16).to(f)
                zh = args["output_gate"].reshape(B, H, D)[n, h].to(f).cpu()
                o = o * torch.rsqrt((o * o).mean() + args["norm_eps"]) * args["norm_weight"].to(f).cpu()
                o = o * torch.sigmoid(zh)
            out[0, n, h] = o
    return out, conv, state
