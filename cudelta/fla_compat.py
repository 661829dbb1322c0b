"""A drop-in for the recurrent decode call engines make today (vLLM's flash-linear-attention ops).

    # before
    from vllm.model_executor.layers.fla.ops import fused_recurrent_gated_delta_rule
    # after: same keywords, same return value, the state pool updated in place
    from cudelta.fla_compat import fused_recurrent_gated_delta_rule

Only the decode step is served (one token per sequence: T=1, or B=1 with `cu_seqlens` of one token
each); a call it cannot serve raises ValueError saying why, instead of computing something else.
"""

from __future__ import annotations

from typing import Optional

import torch

from .ops import gdn_decode, kda_decode


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    inplace_final_state: bool = True,
    cu_seqlens: Optional[torch.Tensor] = None,
    ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    layout: str = "vk",
    invalid_slot: str = "nonpositive",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step with flash-linear-attention's keywords (vLLM's fork); returns (o, state).

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] (Gated DeltaNet) or [B, T, HV, K] (Kimi Delta
    Attention, per channel); beta [B, T, HV] (None: ones). Either T=1 (B sequences) or B=1 with
    `cu_seqlens` [T+1] (T sequences of one token). `initial_state` is the pool, [P, HV, V, K] as
    vLLM keeps it (layout="kv" for [P, HV, K, V]), float32 or bfloat16, and is updated in place at
    `ssm_state_indices` [N] (None: sequence n uses state n). As in vLLM, slot 0 is the null block:
    a sequence whose index is <= 0 touches no state and gets a zero output (invalid_slot="negative"
    skips only negative slots). Returns o [B, T, HV, V] and the pool itself.
    """
    if initial_state is None:
        raise ValueError("initial_state (the state pool) is required: cudelta updates a pool in place")
    if not inplace_final_state:
        raise ValueError("inplace_final_state=False is not supported: cudelta updates the pool in place")
    if num_accepted_tokens is not None:
        raise ValueError("num_accepted_tokens (speculative decoding, several tokens per sequence) is not supported")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K]; got {tuple(q.shape)}")
    B, T = q.shape[:2]
    if cu_seqlens is not None:
        if B != 1 or cu_seqlens.numel() != T + 1:
            raise ValueError(f"cu_seqlens must describe {T} sequences of one token each with B=1; got B={B} and "
                             f"{cu_seqlens.numel()} offsets (only the decode step, T=1 per sequence, is served)")
    elif T != 1:
        raise ValueError(f"only the decode step is served: T must be 1 without cu_seqlens; got T={T}")
    N = B * T
    flat = lambda x: x.reshape(N, *x.shape[2:])  # noqa: E731  (views for contiguous inputs)
    qf, kf, vf, gf = flat(q), flat(k), flat(v), flat(g)
    bf = flat(beta) if beta is not None else torch.ones(N, v.shape[2], device=v.device, dtype=torch.float32)
    if ssm_state_indices is None:
        idx = torch.arange(N, device=q.device, dtype=torch.int32)
        invalid_slot = "negative"  # state n of sequence n: slot 0 is a real state here
    else:
        idx = ssm_state_indices.reshape(-1) if ssm_state_indices.dim() == 2 and ssm_state_indices.shape[1] == 1 \
            else ssm_state_indices
        if idx.dim() != 1 or idx.shape[0] != N:
            raise ValueError(f"ssm_state_indices must be [{N}] (one slot per sequence); got {tuple(ssm_state_indices.shape)}")
    op = kda_decode if gf.dim() == 3 else gdn_decode
    o = op(qf, kf, vf, gf, bf, initial_state, idx, scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, layout=layout,
           invalid_slot=invalid_slot)
    return o.view(B, T, *o.shape[1:]), initial_state
