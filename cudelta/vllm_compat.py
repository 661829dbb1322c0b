"""A drop-in for vLLM's GDN decode calls (and Kimi K3's KDA layer step, `fused_kda_decode`, below),
with vLLM's signatures and argument rules (0.33's and 0.34's: the calls' Python signatures are the
same in both, and 0.34's MTP op takes up to 9 tokens a request where 0.33's took 8):

    # before
    from vllm.third_party.flash_linear_attention.ops import fused_recurrent_gated_delta_rule_packed_decode
    from vllm._custom_ops import fused_gdn_decode_post_conv_mtp
    # after
    from cudelta.vllm_compat import fused_recurrent_gated_delta_rule_packed_decode, fused_gdn_decode_post_conv_mtp

Both read q, k and v in place from the packed `mixed_qkv` (views, no copies) and update vLLM's state
pool in place ([slots, HV, V, K], slot 0 the null block; a padded page layout is a view whose slot
stride exceeds the block). Arguments are checked with the rules vLLM applies (its Python checks for
the packed decode; the CUDA op's checks for the MTP step, K = V = 128 and bf16 activations
included), then with cudelta's own (head dims 64/128/256, fp32 or bf16 state), each error naming
the value. On CPU tensors both run the PyTorch reference. On CUDA tensors the packed decode runs
the kernels, on vLLM's padded pool as allocated: the packed decode the one-token kernel, the MTP
step (several tokens, a checkpoint per token, the gated RMSNorm epilogue) the multi-token kernel.

Where vLLM's result is undefined, cudelta's is not: a slot >= the pool's size counts as invalid, a
request with more tokens than state_indices has columns is refused, and output rows after
cu_seqlens[N] (an engine's padding tokens, which vLLM leaves as they were) are zeroed.

`causal_conv1d_update` (vLLM's vllm/model_executor/layers/mamba/ops/causal_conv1d.py signature), the
conv that precedes the step in vLLM's GDN layer, runs cudelta's conv kernel (cudelta.conv; not fused
into the step yet) in the two forms the layer's decode calls: one token a row ([batch, dim]), and
the speculative varlen form (query_start_loc with num_accepted_tokens), widths up to 7 as vLLM 0.34
checks. Like vLLM's, it writes x in place unless `out` is given. On an H100 it is within 1% of
vLLM's Triton kernel or faster at B <= 8 and at most 5% slower elsewhere; the layer step is
fastest as one call, `conv_then_gdn_decode_post_conv_mtp` (benchmarks/results-h100-90d34eb.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _native, conv
from ._call import DecodeCall, gate_lower_bound_problem
from .conv_reference import causal_conv1d_update_reference, check_conv_call
from .ops import _decode, gdn_decode
from .reference import decode_reference

MTP_HEAD_DIM = 128  # the CUDA op's K = V
MTP_MAX_TOKENS = 9  # state_indices [N, S] with 1 <= S <= 9 (vLLM 0.34; 0.33 took S <= 8)
MTP_HEAD_GROUPS = (1, 2, 3, 4, 8)  # HV / H
MTP_ACTIVATIONS = ("silu", "sigmoid")
CONV_WIDTHS = (2, 7)  # causal_conv1d_update's, from vLLM 0.34 (0.33 did not check)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"cudelta.vllm_compat: {message}")


def _same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    _require(all(d == first for d in devices.values()),
             f"all inputs must be on one device; got {', '.join(f'{n} on {d}' for n, d in devices.items())}")


def _split_qkv(mixed_qkv: torch.Tensor, H: int, HV: int, K: int, V: int):
    """q, k [tokens, H, K] and v [tokens, HV, V]: views of mixed_qkv's rows."""
    q = mixed_qkv[:, : H * K].unflatten(1, (H, K))
    k = mixed_qkv[:, H * K: 2 * H * K].unflatten(1, (H, K))
    v = mixed_qkv[:, 2 * H * K:].unflatten(1, (HV, V))
    return q, k, v


def fused_recurrent_gated_delta_rule_packed_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: mixed_qkv [B, 2*H*K + HV*V], raw gates a, b [B, HV], A_log and dt_bias
    [HV], the pool initial_state [slots, HV, V, K] updated in place at ssm_state_indices [B] (<= 0:
    no state, zero output), out [B, 1, HV, V] written; returns (out, initial_state)."""
    _require(mixed_qkv.ndim == 2,
             f"mixed_qkv must be a 2D tensor [B, 2*H*K + HV*V]; got shape {tuple(mixed_qkv.shape)}")
    _require(mixed_qkv.stride(-1) == 1,
             f"mixed_qkv must be contiguous in the last dim; got strides {mixed_qkv.stride()}")
    _require(a.ndim == 2 and b.ndim == 2,
             f"a and b must be 2D tensors [B, HV]; got a {tuple(a.shape)}, b {tuple(b.shape)}")
    _require(a.stride(-1) == 1 and b.stride(-1) == 1,
             f"a and b must be contiguous in the last dim; got strides a {a.stride()}, b {b.stride()}")
    _require(A_log.ndim == 1 and dt_bias.ndim == 1,
             f"A_log and dt_bias must be 1D tensors [HV]; got A_log {tuple(A_log.shape)}, dt_bias "
             f"{tuple(dt_bias.shape)}")
    _require(A_log.stride(0) == 1 and dt_bias.stride(0) == 1,
             f"A_log and dt_bias must be contiguous; got strides A_log {A_log.stride()}, dt_bias {dt_bias.stride()}")
    _require(ssm_state_indices.ndim == 1,
             f"ssm_state_indices must be 1D [B] for packed decode; got shape {tuple(ssm_state_indices.shape)}")
    _require(out.is_contiguous(), f"out must be contiguous; got strides {out.stride()} for shape {tuple(out.shape)}")
    _same_device(mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, out=out,
                 ssm_state_indices=ssm_state_indices)
    B = mixed_qkv.shape[0]
    _require(a.shape[0] == B and b.shape[0] == B,
             f"a and b must have mixed_qkv's batch size B={B}; got a.shape[0]={a.shape[0]}, b.shape[0]={b.shape[0]}")
    _require(ssm_state_indices.shape[0] == B,
             f"ssm_state_indices must have shape ({B},); got {tuple(ssm_state_indices.shape)}")
    _require(initial_state.ndim == 4,
             f"initial_state must be a 4D tensor [slots, HV, V, K]; got shape {tuple(initial_state.shape)}")
    _require(initial_state.stride(-1) == 1,
             f"initial_state must be contiguous in the last dim; got strides {initial_state.stride()}")
    HV, V, K = initial_state.shape[-3:]
    _require(a.shape[1] == HV and b.shape[1] == HV,
             f"a and b must be [B, HV] with HV={HV} (initial_state); got a {tuple(a.shape)}, b {tuple(b.shape)}")
    _require(A_log.numel() == HV and dt_bias.numel() == HV,
             f"A_log and dt_bias must have HV={HV} elements; got {A_log.numel()} and {dt_bias.numel()}")
    _require(tuple(out.shape) == (B, 1, HV, V), f"out must have shape {(B, 1, HV, V)}; got {tuple(out.shape)}")
    H = _heads(mixed_qkv.shape[1], HV, V, K)
    _require(HV % H == 0, f"HV={HV} (initial_state) must be a multiple of H={H} (inferred from mixed_qkv)")
    q, k, v = _split_qkv(mixed_qkv, H, HV, K, V)
    gdn_decode(q, k, v, None, None, initial_state, ssm_state_indices, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
               scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, layout="vk", invalid_slot="nonpositive",
               out=out.view(B, HV, V))
    return out, initial_state


def _heads(width: int, HV: int, V: int, K: int) -> int:
    """H from mixed_qkv's width 2*H*K + HV*V, as vLLM infers it."""
    qk = width - HV * V
    _require(qk > 0 and qk % 2 == 0,
             f"mixed_qkv's last dim {width} is not 2*H*K + HV*V for HV={HV}, V={V}, K={K} and any H >= 1")
    _require((qk // 2) % K == 0, f"the packed q size {qk // 2} (from mixed_qkv's last dim {width}) must be a "
             f"multiple of K={K}")
    return qk // 2 // K


def _mtp_checks(mixed_qkv, a, b, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state,
                output_gate, norm_weight, out, output_gate_activation) -> int:
    """The CUDA op's rules, in its order; returns H."""
    D = MTP_HEAD_DIM
    bf16 = torch.bfloat16
    _require(mixed_qkv.dtype == bf16, f"mixed_qkv must be a bfloat16 tensor; got {mixed_qkv.dtype}")
    for name, x in (("a", a), ("b", b)):
        _require(x.dtype == bf16, f"{name} must be a bfloat16 tensor; got {x.dtype}")
    _require(A_log.dtype == torch.float32, f"A_log must be a float32 tensor; got {A_log.dtype}")
    _require(dt_bias.dtype in (torch.float32, bf16, torch.float16),
             f"dt_bias must be a float32, bfloat16 or float16 tensor; got {dt_bias.dtype}")
    for name, x in (("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
                    ("num_accepted_tokens", num_accepted_tokens)):
        _require(x.dtype == torch.int32, f"{name} must be an int32 tensor; got {x.dtype}")
    _require(state.dtype in (torch.float32, bf16), f"state must be a float32 or bfloat16 tensor; got {state.dtype}")
    _require(norm_weight.dtype in (torch.float32, bf16),
             f"norm_weight must be a float32 or bfloat16 tensor; got {norm_weight.dtype}")
    _require(output_gate.dtype == bf16, f"output_gate must be a bfloat16 tensor; got {output_gate.dtype}")
    _require(out.dtype == bf16, f"out must be a bfloat16 tensor; got {out.dtype}")
    _require(output_gate_activation in MTP_ACTIVATIONS,
             f"output_gate_activation must be 'silu' or 'sigmoid'; got {output_gate_activation!r}")
    _same_device(mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state_indices=state_indices,
                 cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens, state=state,
                 output_gate=output_gate, norm_weight=norm_weight, out=out)
    _require(mixed_qkv.dim() == 2, f"mixed_qkv must have shape [L, 2 * H * {D} + HV * {D}]; got "
             f"{tuple(mixed_qkv.shape)}")
    L = mixed_qkv.shape[0]
    _require(L >= 1, "the MTP step requires at least one token; mixed_qkv has 0 rows")
    _require(state.dim() == 4 and tuple(state.shape[2:]) == (D, D),
             f"state must have shape [slots, HV, {D}, {D}]; got {tuple(state.shape)}")
    HV = state.shape[1]
    qk = mixed_qkv.shape[1] - HV * D
    _require(qk > 0 and qk % (2 * D) == 0, f"mixed_qkv width {mixed_qkv.shape[1]} is inconsistent with state: it "
             f"must be 2 * H * {D} + HV * {D} with HV={HV} and H >= 1")
    H = qk // (2 * D)
    _require(HV % H == 0 and HV // H in MTP_HEAD_GROUPS,
             f"HV/H must be one of {MTP_HEAD_GROUPS}; got HV={HV}, H={H}")
    _require(state_indices.dim() == 2 and 1 <= state_indices.shape[1] <= MTP_MAX_TOKENS,
             f"state_indices must have shape [N, S] with 1 <= S <= {MTP_MAX_TOKENS}; got {tuple(state_indices.shape)}")
    N = state_indices.shape[0]
    _require(cu_seqlens.numel() == N + 1, f"cu_seqlens must have N + 1 = {N + 1} elements; got {cu_seqlens.numel()}")
    _require(num_accepted_tokens.numel() == N,
             f"num_accepted_tokens must have N = {N} elements; got {num_accepted_tokens.numel()}")
    _require(A_log.is_contiguous() and A_log.numel() == HV,
             f"A_log must be contiguous with HV={HV} elements; got {A_log.numel()} elements, strides {A_log.stride()}")
    _require(dt_bias.is_contiguous() and dt_bias.numel() == HV,
             f"dt_bias must be contiguous with HV={HV} elements; got {dt_bias.numel()} elements, strides "
             f"{dt_bias.stride()}")
    for name, x in (("state_indices", state_indices), ("num_accepted_tokens", num_accepted_tokens),
                    ("cu_seqlens", cu_seqlens)):
        _require(x.is_contiguous(), f"{name} must be contiguous; got strides {x.stride()}")
    for name, x in (("output_gate", output_gate), ("out", out)):
        _require(tuple(x.shape) == (L, HV, D), f"{name} must have shape [L, HV, {D}] = [{L}, {HV}, {D}]; got "
                 f"{tuple(x.shape)}")
    _require(mixed_qkv.stride(1) == 1, f"mixed_qkv channels must be contiguous; got strides {mixed_qkv.stride()}")
    for name, x in (("a", a), ("b", b)):
        _require(x.dim() == 2 and tuple(x.shape) == (L, HV),
                 f"{name} must have shape [L, HV] = [{L}, {HV}]; got {tuple(x.shape)}")
    _require(a.stride(1) == 1 and b.stride(1) == 1,
             f"a and b heads must be contiguous; got strides a {a.stride()}, b {b.stride()}")
    _require(state.stride()[1:] == (D * D, D, 1),
             f"state must have contiguous [HV, {D}, {D}] slot contents; got strides {state.stride()}")
    size = state.element_size()
    # A traced call has no address (data_ptr breaks a fullgraph trace): the op checks it when it runs.
    offset = 0 if torch.compiler.is_compiling() else state.data_ptr() % 16
    _require((state.stride(0) * size) % 16 == 0 and offset == 0,
             f"state slots must preserve 16-byte alignment; got a slot stride of {state.stride(0) * size} bytes "
             f"at address offset {offset}")
    _require(output_gate.stride(2) == 1 and output_gate.stride(1) == D,
             f"output_gate head rows must be contiguous; got strides {output_gate.stride()}")
    _require(out.is_contiguous(), f"out must be contiguous; got strides {out.stride()}")
    _require(norm_weight.is_contiguous() and norm_weight.numel() == D,
             f"norm_weight must be contiguous with {D} elements; got {norm_weight.numel()} elements")
    return H


def fused_gdn_decode_post_conv_mtp(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    state: torch.Tensor,
    output_gate: torch.Tensor,
    norm_weight: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    scale: float = 128**-0.5,
    norm_eps: float = 1e-5,
    output_gate_activation: str = "silu",
) -> torch.Tensor:
    """vLLM's speculative (MTP) GDN decode after the conv: mixed_qkv [L, 2*H*128 + HV*128] bf16 (L
    tokens; request n's are cu_seqlens[n]:cu_seqlens[n+1]), raw gates a, b [L, HV] bf16, A_log [HV]
    fp32, dt_bias [HV]; request n starts from the state at state_indices[n, num_accepted_tokens[n] - 1]
    and stores the state after token t at state_indices[n, t] (<= 0: none); q and k L2-normalised;
    the output, rounded to bf16, goes through the gated RMSNorm with output_gate [L, HV, 128] and
    norm_weight [128] into out [L, HV, 128] (allocated when None), which is returned."""
    if out is None:
        out = torch.empty_like(output_gate)
    H = _mtp_checks(mixed_qkv, a, b, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state,
                    output_gate, norm_weight, out, output_gate_activation)
    return _mtp_step(H, mixed_qkv, a, b, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state,
                     output_gate, norm_weight, out, scale, norm_eps, output_gate_activation, early_state=False)


def _mtp_step(H, mixed_qkv, a, b, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state, output_gate,
              norm_weight, out, scale, norm_eps, output_gate_activation, early_state: bool) -> torch.Tensor:
    """The MTP step on arguments _mtp_checks has passed."""
    HV, D = state.shape[1], MTP_HEAD_DIM
    q, k, v = _split_qkv(mixed_qkv, H, HV, D, D)
    call = DecodeCall("gdn", q, k, v, None, None, state, state_indices, a=a, b=b, A_log=A_log.view(HV),
                      dt_bias=dt_bias.view(HV), scale=scale, use_qk_l2norm=True, layout="vk",
                      invalid_slot="nonpositive", out=out, cu_seqlens=cu_seqlens,
                      num_accepted_tokens=num_accepted_tokens, output_gate=output_gate,
                      norm_weight=norm_weight.view(D), norm_eps=norm_eps, gate_activation=output_gate_activation)
    _decode(call, early_state=early_state)
    return out


def conv_then_gdn_decode_post_conv_mtp(
    mixed_qkv: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    state: torch.Tensor,
    output_gate: torch.Tensor,
    norm_weight: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    scale: float = 128**-0.5,
    norm_eps: float = 1e-5,
    output_gate_activation: str = "silu",
    activation: "bool | str | None" = "silu",
    conv_state_indices: Optional[torch.Tensor] = None,
    null_block_id: int = 0,
    conv_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """vLLM's GDN layer step with speculative decoding, its two kernels in one call: the same results
    as

        causal_conv1d_update(mixed_qkv, conv_state, conv_weight, conv_bias, activation,
                             conv_state_indices=state_indices[:, 0], num_accepted_tokens=num_accepted_tokens,
                             query_start_loc=cu_seqlens)   # in place on mixed_qkv
        fused_gdn_decode_post_conv_mtp(mixed_qkv, a, b, A_log, dt_bias, state_indices, cu_seqlens,
                                       num_accepted_tokens, state, output_gate, norm_weight, out, ...)

    with both calls' arguments checked (their rules, above) before either kernel runs. Launched back
    to back from here, the step's kernel starts on sm_90+ while the conv still runs and issues its
    state loads before it waits for the conv's outputs (kernels/launch.h, early_state): the two
    calls made apart cannot, since the step cannot know what ran before it. conv_state_indices:
    the conv state's slots (state_indices[:, 0], vLLM's, when None); conv_out: where the conv's
    outputs go and the step reads them (mixed_qkv itself when None). Returns out."""
    activation = _conv_activation(activation)
    _require(null_block_id is not None, "null_block_id must be an int (vLLM's null block, 0)")
    if conv_out is None:
        conv_out = mixed_qkv
    if out is None:
        out = torch.empty_like(output_gate)
    # The step's rules first: they hold state_indices to [N, S], whose first column is the conv's default.
    H = _mtp_checks(conv_out, a, b, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state,
                    output_gate, norm_weight, out, output_gate_activation)
    if conv_state_indices is None:
        conv_state_indices = state_indices[:, 0]
    _same_device(mixed_qkv=mixed_qkv, conv_state=conv_state, conv_weight=conv_weight,
                 conv_state_indices=conv_state_indices, conv_out=conv_out)
    _conv_width_rule(conv_weight)
    check_conv_call(mixed_qkv, conv_state, conv_weight, conv_bias, activation, conv_state_indices, cu_seqlens,
                    num_accepted_tokens, conv_out)
    conv.run_checked(mixed_qkv, conv_state, conv_weight, conv_bias, activation, conv_state_indices, cu_seqlens,
                     num_accepted_tokens, int(null_block_id), conv_out)
    return _mtp_step(H, conv_out, a, b, A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state,
                     output_gate, norm_weight, out, scale, norm_eps, output_gate_activation, early_state=True)


def _conv_width_rule(weight: torch.Tensor) -> None:
    """vLLM 0.34's causal_conv1d_update refuses a weight [dim, width] wider than CONV_WIDTHS' last
    (cudelta's conv takes any width >= 2, and names a narrower weight and the other shapes itself)."""
    _require(weight.dim() != 2 or weight.shape[1] <= CONV_WIDTHS[1],
             f"causal_conv1d_update supports widths {CONV_WIDTHS[0]} to {CONV_WIDTHS[1]} (vLLM 0.34's rule), got "
             f"{weight.shape[1]}")


def _conv_activation(activation: "bool | str | None") -> Optional[str]:
    """vLLM's conv `activation` (True, False, None, "silu" or "swish") as cudelta.conv takes it."""
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    _require(activation in (None, "silu", "swish"),
             f"activation must be True, False, None, 'silu' or 'swish'; got {activation!r}")
    return activation


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: "bool | str | None" = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    query_start_loc: Optional[torch.Tensor] = None,
    max_query_len: int = -1,
    null_block_id: int = 0,
    validate_data: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """vLLM's causal-conv1d update (vllm/model_executor/layers/mamba/ops/causal_conv1d.py): x [batch,
    dim] one token a row, or [num_tokens, dim] with query_start_loc [batch+1] and num_accepted_tokens
    [batch] (speculative decoding); conv_state [slots, dim, state_len] (any strides: vLLM passes the
    transposed view of its [state_len, dim] pages) updated in place; weight [dim, width]. Returns
    `out`, x itself when out is None. max_query_len and validate_data are vLLM's and change nothing
    here: the arguments are always checked."""
    activation = _conv_activation(activation)
    _require(x.dim() == 2, f"x must be [batch, dim] or, with query_start_loc, [num_tokens, dim]; got shape "
                           f"{tuple(x.shape)} (the [batch, dim, seqlen] form is not taken)")
    _require((query_start_loc is None) == (num_accepted_tokens is None),
             "query_start_loc and num_accepted_tokens go together (speculative decoding) or not at all "
             "(one token a row); the varlen form without accepted tokens is vLLM's prefill path, not taken")
    _require(null_block_id is not None, "null_block_id must be an int (vLLM's null block, 0)")
    _conv_width_rule(weight)
    if conv_state_indices is None:
        batch = x.shape[0] if query_start_loc is None else query_start_loc.shape[0] - 1
        conv_state_indices = torch.arange(batch, dtype=torch.int32, device=x.device)
    _same_device(x=x, conv_state=conv_state, weight=weight, conv_state_indices=conv_state_indices)
    return conv.causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices, query_start_loc,
                                     num_accepted_tokens, int(null_block_id), x if out is None else out)


KDA_HEAD_DIM = 128  # vLLM's fused KDA op: head_dim 128, conv width 4 over q, k and v
KDA_CONV_WIDTH = 4


def _kda_checks(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out,
                lower_bound, output_gate, norm_weight, norm_eps) -> int:
    """vLLM's fused_kda_decode rules, in its order (its library's check messages), with two of
    cudelta's own: any head count H (vLLM's kernels are built for 12, 24, 48 and 96) and a bf16
    recurrent state beside fp32. Returns H."""
    D, W = KDA_HEAD_DIM, KDA_CONV_WIDTH
    bf16, f32 = torch.bfloat16, torch.float32
    for name, t, want in (("x", x, bf16), ("weight", weight, f32), ("conv_state", conv_state, bf16),
                          ("raw_g", raw_g, bf16), ("raw_beta", raw_beta, bf16), ("A_log", A_log, f32),
                          ("dt_bias", dt_bias, f32), ("out", out, bf16), ("state_indices", state_indices, torch.int32)):
        kind = str(want).removeprefix("torch.")
        _require(t.dtype == want, f"{name} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind} tensor; got {t.dtype}")
    _require(state.dtype in (f32, bf16), f"state must be a float32 (vLLM's) or bfloat16 tensor; got {state.dtype}")
    tensors = dict(x=x, weight=weight, conv_state=conv_state, raw_g=raw_g, raw_beta=raw_beta, A_log=A_log,
                   dt_bias=dt_bias, state_indices=state_indices, state=state, out=out)
    tensors.update({n: t for n, t in (("bias", bias), ("output_gate", output_gate), ("norm_weight", norm_weight))
                    if t is not None})
    _same_device(**tensors)
    _require(x.dim() == 2 and x.shape[1] % (3 * D) == 0 and x.shape[1] > 0,
             f"x must have shape [B, 3 * H * {D}]; got {tuple(x.shape)}")
    H, B = x.shape[1] // (3 * D), x.shape[0]
    _require(B >= 1, "the fused KDA decode requires at least one row; x has 0")
    _require(tuple(weight.shape) == (3, W, H * D), f"weight must have shape [3, {W}, H * {D}] = [3, {W}, {H * D}]; "
             f"got {tuple(weight.shape)}")
    _require(conv_state.dim() == 3 and tuple(conv_state.shape[1:]) == (3 * H * D, W - 1),
             f"conv_state must have shape [slots, 3 * H * {D}, {W - 1}] = [slots, {3 * H * D}, {W - 1}]; got "
             f"{tuple(conv_state.shape)}")
    for name, t, want in (("raw_g", raw_g, (1, B, H, D)), ("raw_beta", raw_beta, (1, B, H)),
                          ("out", out, (1, B, H, D))):
        _require(tuple(t.shape) == want, f"{name} must have shape {list(want)}; got {tuple(t.shape)}")
    for name, t, n in (("A_log", A_log, H), ("dt_bias", dt_bias, H * D), ("state_indices", state_indices, B)):
        _require(t.is_contiguous() and t.numel() == n, f"{name} must be contiguous with {n} elements; got "
                 f"{t.numel()} elements, strides {t.stride()}")
    _require(state.dim() == 4 and tuple(state.shape[1:]) == (H, D, D),
             f"state must have shape [slots, H, {D}, {D}] = [slots, {H}, {D}, {D}]; got {tuple(state.shape)}")
    _require(x.stride(1) == 1, f"x must be contiguous in its channel dimension; got strides {x.stride()}")
    sd = conv_state.stride(1) == 1 and conv_state.stride(2) == 3 * H * D  # pages [3, dim], passed transposed
    ds = conv_state.stride(2) == 1 and conv_state.stride(1) == W - 1      # pages [dim, 3]
    _require(sd or ds, f"conv_state must use the SD or DS cache layout; got strides {conv_state.stride()}")
    _require(state.stride()[1:] == (D * D, D, 1),
             f"state must have contiguous [H, {D}, {D}] slot contents; got strides {state.stride()}")
    _require(raw_beta.stride(2) == 1, f"raw_beta must be contiguous in its head dimension; got {raw_beta.stride()}")
    _require((output_gate is None) == (norm_weight is None), "output_gate and norm_weight must be provided together")
    if output_gate is not None:
        _require(output_gate.dtype == bf16, f"output_gate must be a bfloat16 tensor; got {output_gate.dtype}")
        _require(tuple(output_gate.shape) in ((B, H, D), (1, B, H, D)),
                 f"output_gate must have shape [B, H, {D}] or [1, B, H, {D}] = [{B}, {H}, {D}]; got "
                 f"{tuple(output_gate.shape)}")
        _require(output_gate.stride(-1) == 1 and output_gate.stride(-2) == D,
                 f"output_gate must have contiguous head rows; got strides {output_gate.stride()}")
        _require(norm_weight.dtype == f32, f"norm_weight must be a float32 tensor; got {norm_weight.dtype}")
        _require(norm_weight.is_contiguous() and norm_weight.numel() == D,
                 f"norm_weight must be contiguous with {D} elements; got {norm_weight.numel()}")
    if bias is not None:
        _require(bias.dtype == f32, f"bias must be a float32 tensor; got {bias.dtype}")
        _require(bias.is_contiguous() and bias.numel() == 3 * H * D,
                 f"bias must be contiguous with 3 * H * {D} = {3 * H * D} elements; got {bias.numel()}")
    _require(raw_g.is_contiguous(), f"raw_g must be contiguous; got strides {raw_g.stride()}")
    _require(out.is_contiguous(), f"out must be contiguous; got strides {out.stride()}")
    _require(norm_eps >= 0, f"norm_eps must be non-negative; got {norm_eps}")
    # The step's own rule (cudelta._call.DecodeCall), named before the conv has written anything.
    problem = gate_lower_bound_problem(lower_bound)
    _require(problem is None, problem or "")
    offset = 0 if torch.compiler.is_compiling() else state.data_ptr() % 16
    _require((state.stride(0) * state.element_size()) % 16 == 0 and offset == 0,
             f"state slots must preserve 16-byte alignment; got a slot stride of "
             f"{state.stride(0) * state.element_size()} bytes at address offset {offset}")
    return H


def fused_kda_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    state: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    output_gate: Optional[torch.Tensor] = None,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-5,
) -> torch.Tensor:
    """vLLM's Kimi K3 KDA decode layer step (vllm._custom_ops.fused_kda_decode), one token a request:
    x [B, 3*H*128] bf16, q, k and v before the conv (not written); the causal conv (width 4, SiLU,
    weight [3, 4, H*128] fp32, bias [3*H*128] fp32 or None) advances conv_state [slots, 3*H*128, 3]
    bf16 (vLLM's SD or DS layout) at state_indices [B] int32; then the KDA step on the conv's
    outputs, q and k L2-normalised, q scaled by 128^-0.5, raw gates raw_g [1, B, H, 128] bf16 with
    A_log [H] and dt_bias [H*128] fp32 (decay exp(lower_bound * sigmoid(exp(A_log) * (raw_g +
    dt_bias))), or the softplus form without lower_bound), beta sigmoid(raw_beta [1, B, H]), on
    vLLM's pool state [slots, H, 128 (V), 128 (K)] in place; a slot <= 0 is skipped (zero output,
    nothing written). With output_gate [B, H, 128] bf16 and norm_weight [128] fp32, the output
    (rounded to bf16) goes through the gated RMSNorm with a sigmoid gate. Returns out [1, B, H, 128].

    Two launches where vLLM's op is one: cudelta's conv kernel into a scratch buffer (on vLLM's SD
    pages its build for this fp32 tap-major weight, four channels a thread), then the step, which
    starts its state loads while the conv runs (early_state, as conv_then_gdn_decode_post_conv_mtp);
    the conv outputs are rounded to bf16 between them, where vLLM's op may keep them in fp32 (a bf16
    ulp of q, k, v: benchmarks/results-h200-kda.md)."""
    out = _kda_out(x, out)
    H = _kda_checks(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out,
                    lower_bound, output_gate, norm_weight, norm_eps)
    return _kda_step(H, x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out,
                     lower_bound, output_gate, norm_weight, norm_eps, reference=False)


def fused_kda_decode_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    state: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    output_gate: Optional[torch.Tensor] = None,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-5,
) -> torch.Tensor:
    """fused_kda_decode's PyTorch reference on any device (cudelta.conv_reference, then
    cudelta.reference's step, fp32 math): the same arguments, rules and in-place updates."""
    out = _kda_out(x, out)
    H = _kda_checks(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out,
                    lower_bound, output_gate, norm_weight, norm_eps)
    return _kda_step(H, x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out,
                     lower_bound, output_gate, norm_weight, norm_eps, reference=True)


def _kda_out(x: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """out, or [1, B, H, 128] in x's dtype with H from x's width (checked with the rest after)."""
    if out is not None:
        return out
    heads = max(x.shape[-1] // (3 * KDA_HEAD_DIM), 1) if x.dim() == 2 else 1
    return torch.empty(1, x.shape[0], heads, KDA_HEAD_DIM, dtype=x.dtype, device=x.device)


def kda_step_call(H, conv_out, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out, lower_bound, output_gate,
                  norm_weight, norm_eps) -> DecodeCall:
    """fused_kda_decode's step on the conv's outputs conv_out [B, 3*H*128] as one decode call (q, k, v
    views of its rows); without output_gate, no epilogue. Also benchmarks/kda_parts.py's step alone."""
    D = KDA_HEAD_DIM
    q, k, v = _split_qkv(conv_out, H, H, D, D)
    z = output_gate[0] if output_gate is not None and output_gate.dim() == 4 else output_gate
    return DecodeCall("kda", q, k, v, None, None, state, state_indices, a=raw_g[0], b=raw_beta[0], A_log=A_log,
                      dt_bias=dt_bias.view(H, D), scale=D ** -0.5, use_qk_l2norm=True, layout="vk",
                      invalid_slot="nonpositive", out=out[0], output_gate=z, norm_weight=norm_weight,
                      norm_eps=norm_eps if z is not None else None, gate_activation="sigmoid" if z is not None else None,
                      gate_lower_bound=lower_bound)


def _kda_step(H, x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out,
              lower_bound, output_gate, norm_weight, norm_eps, reference: bool) -> torch.Tensor:
    """The conv, then the step, on arguments _kda_checks has passed."""
    conv_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if reference or _native.kernels_for(x) is None:
        # The reference raises on a slot outside the pool where the kernel skips it: vLLM's padding
        # slot (-1) is skipped like its null block.
        conv_slots = state_indices.clamp(min=0)
        causal_conv1d_update_reference(x, conv_state, weight, bias, "silu", conv_slots, null_block_id=0, out=conv_out)
    else:
        conv.run_checked(x, conv_state, weight, bias, "silu", state_indices, None, None, 0, conv_out)
    call = kda_step_call(H, conv_out, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out, lower_bound,
                         output_gate, norm_weight, norm_eps)
    if reference:
        decode_reference(call)
    else:
        _decode(call, early_state=True)
    return out
