"""PyTorch reference of the causal-conv1d update that precedes the step in vLLM's GDN layer.

vLLM 0.33 runs `causal_conv1d_update` (a Triton kernel of its own) on the projected `mixed_qkv`
before `fused_gdn_decode_post_conv_mtp`; cudelta runs it as a kernel of its own too
(cudelta.conv.causal_conv1d_update, kernels/conv_update.cuh), not fused into the step
(ARCHITECTURE.md, "Not fused yet"). This is the semantics both keep, and a fused step must, and
what benchmarks/conv_share.py checks vLLM's kernel and cudelta's against before timing them:

- conv_state [slots, dim, state_len], any strides (vLLM's default "SD" layout stores each page's
  state as [state_len, dim] and passes the transposed view). Request n's window lives in slot
  conv_state_indices[n] (vLLM: the first column of the spec-decode block table); a slot equal to
  null_block_id is skipped: nothing read or written, its output rows left as they were.
- The request's sequence is its window conv_state[slot, :, off : off + width - 1] followed by its
  tokens x[bos:eos], where off = num_accepted_tokens[n] - 1 (0 without speculative decoding): the
  window of a step whose first acc tokens were accepted starts acc - 1 columns in.
- Output of token t: act(bias + sum_j weight[:, j] * seq[t + j]), fp32 math, act SiLU or none,
  rounded to conv_state's dtype (vLLM converts x to it first) and then to x's.
- The window advances by one column: seq[1:] (width - 2 + tokens columns) is written to
  conv_state[slot, :, 0 : width - 2 + tokens]; later columns keep their bytes. With one token
  (vLLM's decode without drafts) that is the classic shift; with drafts it keeps the history a
  rejected draft rolls back to ("[history2..historyM, draft1..draftN]" in vLLM's kernel).

The two forms vLLM calls are taken: one token a row (x [N, dim], no cu_seqlens, no
num_accepted_tokens) and the speculative varlen form (cu_seqlens [N+1] and num_accepted_tokens [N]).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")


def check_conv_call(x, conv_state, weight, bias, activation, conv_state_indices, cu_seqlens, num_accepted_tokens,
                    out) -> None:
    """The shape, dtype and form rules of a conv update call: ValueError naming the bad argument. The
    per-request data (slots, spans, accepted counts) the reference checks as it plans."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, dim]; got shape {tuple(x.shape)}")
    if conv_state.dim() != 3:
        raise ValueError(f"conv_state must be [slots, dim, state_len]; got shape {tuple(conv_state.shape)}")
    dim = x.shape[1]
    segmented = weight.dim() == 3 and weight.shape[0] >= 1 and weight.shape[0] * weight.shape[2] == dim
    if not (segmented or (weight.dim() == 2 and weight.shape[0] == dim)) or weight.shape[1] < 2:
        raise ValueError(f"weight must be [dim={dim}, width >= 2], or [segments, width, dim / segments] (vLLM's KDA "
                         f"decode layout); got shape {tuple(weight.shape)}")
    width = weight.shape[1]
    if conv_state.shape[1] != dim or conv_state.shape[2] < width - 1:
        raise ValueError(f"conv_state must be [slots, dim={dim}, state_len >= width - 1 = {width - 1}]; "
                         f"got shape {tuple(conv_state.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must be [dim={dim}] or None; got shape {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if conv_state_indices.dim() != 1 or conv_state_indices.dtype.is_floating_point:
        raise ValueError(f"conv_state_indices must be an integer tensor [N]; got {conv_state_indices.dtype} "
                         f"{tuple(conv_state_indices.shape)}")
    N = conv_state_indices.shape[0]
    if (cu_seqlens is None) != (num_accepted_tokens is None):
        raise ValueError("cu_seqlens and num_accepted_tokens go together (vLLM's speculative form) or not at all "
                         "(one token a row)")
    if cu_seqlens is None and x.shape[0] != N:
        raise ValueError(f"one token a row: x has {x.shape[0]} rows for {N} conv_state_indices")
    if cu_seqlens is not None:
        if tuple(cu_seqlens.shape) != (N + 1,):
            raise ValueError(f"cu_seqlens must be [N + 1 = {N + 1}]; got shape {tuple(cu_seqlens.shape)}")
        if tuple(num_accepted_tokens.shape) != (N,):
            raise ValueError(f"num_accepted_tokens must be [N = {N}]; got shape {tuple(num_accepted_tokens.shape)}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"out must match x ({x.dtype} {tuple(x.shape)}); got {out.dtype} {tuple(out.shape)}")


def dim_major(weight: torch.Tensor) -> torch.Tensor:
    """weight as [dim, width]: vLLM's KDA decode layout [segments, width, dim / segments] (q, k and v
    each tap-major) has channel s * (dim / segments) + i's tap j at weight[s, j, i]."""
    return weight if weight.dim() == 2 else weight.permute(0, 2, 1).reshape(-1, weight.shape[1])


def causal_conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    conv_state_indices: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    null_block_id: int = 0,
    out: Optional[torch.Tensor] = None,
    round_products_to: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The conv outputs of x's rows (into out, else a copy of x whose skipped rows keep x's values,
    as vLLM's in-place default leaves them); conv_state is updated in place. See the module doc.

    round_products_to: each weight x input product rounded to this dtype before the fp32 sum, as
    vLLM's Triton kernel computes it (bf16 times bf16 stays bf16 there; torch.bfloat16 models it).
    Its error grows with the products, not with their sum, so a check of vLLM's kernel against the
    fp32 products needs a tolerance as loose as the largest product; against this, one ulp."""
    check_conv_call(x, conv_state, weight, bias, activation, conv_state_indices, cu_seqlens, num_accepted_tokens, out)
    width, state_len, slots = weight.shape[1], conv_state.shape[2], conv_state.shape[0]
    result = x.clone() if out is None else out
    indices = conv_state_indices.tolist()
    spans = ([(n, n + 1) for n in range(len(indices))] if cu_seqlens is None
             else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())))
    accepted = [1] * len(indices) if num_accepted_tokens is None else num_accepted_tokens.tolist()
    # Every request is checked before any is computed: a bad one leaves the pool as it was.
    plan = []
    for n, (slot, (bos, eos), acc) in enumerate(zip(indices, spans, accepted)):
        if slot == null_block_id or eos == bos:
            continue
        tokens = eos - bos
        if not 0 <= slot < slots:
            raise ValueError(f"conv_state_indices[{n}] = {slot} is outside the pool's slots 0..{slots - 1}")
        if bos < 0 or eos < bos or eos > x.shape[0]:
            raise ValueError(f"request {n}'s rows {bos}..{eos} are outside x's {x.shape[0]} rows")
        off = acc - 1
        if off < 0 or off + width - 1 > state_len or width - 2 + tokens > state_len:
            raise ValueError(f"request {n}: num_accepted_tokens {acc} with {tokens} tokens needs columns "
                             f"{max(off, 0)}..{off + width - 2} read and 0..{width - 3 + tokens} written; "
                             f"conv_state has {state_len}")
        plan.append((slot, bos, eos, off))
    if len({slot for slot, *_ in plan}) != len(plan):
        raise ValueError(f"conv_state_indices name a slot twice among the requests computed: {indices}")
    w = dim_major(weight).float()
    b = bias.float() if bias is not None else torch.zeros(w.shape[0], device=x.device)
    for slot, bos, eos, off in plan:
        tokens = eos - bos
        seq = torch.cat([conv_state[slot, :, off:off + width - 1], x[bos:eos].to(conv_state.dtype).T], dim=1)
        products = [w[:, j:j + 1] * seq[:, j:j + tokens].float() for j in range(width)]
        if round_products_to is not None:
            products = [p.to(round_products_to).float() for p in products]
        y = b[:, None] + sum(products)
        if activation is not None:
            y = F.silu(y)
        result[bos:eos] = y.T.to(conv_state.dtype).to(x.dtype)
        conv_state[slot, :, : width - 2 + tokens] = seq[:, 1:]
    return result
