"""The causal-conv1d update that precedes the step in vLLM's GDN layer: cudelta's kernel on CUDA
tensors (kernels/conv_update.cuh), the PyTorch reference (cudelta.conv_reference) elsewhere.

Not fused into the step: both fused steps built so far were slower than this kernel and the step
chained (ARCHITECTURE.md, "Not fused yet"). A kernel of its own, launched with programmatic
dependent launch on sm_90+ like the step, so the layer's decode pair runs on cudelta's kernels.
The semantics are the reference's; one difference a kernel cannot avoid without a host sync: a
request the pool cannot hold (its slot out of range, its rows outside x, its window or new state
past state_len, a slot named twice) raises in the reference, while the kernel skips it, as it skips
a null slot (nothing written, its output rows untouched), and two requests naming one slot race.
vLLM's kernel checks none of these either.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _native
from .conv_reference import check_conv_call, causal_conv1d_update_reference

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NATIVE_WIDTHS = (2, 3, 4)


def causal_conv1d_update(
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
) -> torch.Tensor:
    """The conv outputs of x's rows, into `out` (may be x) or a copy of x whose skipped rows keep x's
    values; conv_state [slots, dim, state_len] (any strides) updated in place. The arguments are
    cudelta.conv_reference.causal_conv1d_update_reference's, and so are the rules."""
    check_conv_call(x, conv_state, weight, bias, activation, conv_state_indices, cu_seqlens, num_accepted_tokens, out)
    return run_checked(x, conv_state, weight, bias, activation, conv_state_indices, cu_seqlens, num_accepted_tokens,
                       null_block_id, out)


def run_checked(x, conv_state, weight, bias, activation, conv_state_indices, cu_seqlens, num_accepted_tokens,
                null_block_id, out) -> torch.Tensor:
    """causal_conv1d_update on arguments check_conv_call has passed: for callers that check a whole
    layer step before they launch any of it (cudelta.vllm_compat's pair)."""
    args = (x, conv_state, weight, bias, activation, conv_state_indices, cu_seqlens, num_accepted_tokens,
            null_block_id)
    st = _native.kernels_for(x)
    if st is None:
        return causal_conv1d_update_reference(*args, out=out)
    dtypes = (x.dtype, conv_state.dtype, weight.dtype) + (() if bias is None else (bias.dtype,))
    if any(d not in _NATIVE_DTYPES for d in dtypes) or weight.shape[1] not in _NATIVE_WIDTHS:
        _native.notice_once(f"conv:{dtypes}:{weight.shape[1]}",
                            f"conv update with dtypes {dtypes} and width {weight.shape[1]} is not a kernel build "
                            f"(dtypes float32, float16, bfloat16; widths {_NATIVE_WIDTHS}); using the reference")
        return causal_conv1d_update_reference(*args, out=out)
    result = x.clone() if out is None else out
    torch.ops.cudelta.conv_update(x, conv_state, weight, bias, conv_state_indices, cu_seqlens, num_accepted_tokens,
                                  result, int(null_block_id), activation is not None, st.pdl)
    return result
