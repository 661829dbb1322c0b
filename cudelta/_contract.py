"""What one decode call may be given (ARCHITECTURE.md, "The decode step"), checked without computing
anything: the token forms, the slots, the gates, the epilogue and its FP8 output, the pool rule, and
that what a call writes (out, the pool's slots) shares no memory with what it reads.

The reference checks every call with `check_call` and `check_token_values`; the kernel path
(cudelta.ops) with `check_call` only, which reads no tensor's values and so never synchronises a
GPU. Every error names the bad value and what is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from ._call import DecodeCall

LAYOUTS = ("kv", "vk")
INVALID_SLOT_RULES = ("negative", "nonpositive")
HEAD_DIMS = (64, 128, 256)
STATE_DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
GATE_ACTIVATIONS = ("silu", "sigmoid")
DEFAULT_NORM_EPS = 1e-5  # vLLM's fused_gdn_decode_post_conv_mtp default
FP8_DTYPE = torch.float8_e4m3fn  # the epilogue's quantized output (output_scale), vLLM's FP8 activations
FP8_MAX = 448.0  # e4m3fn's largest finite value: quantized outputs are clamped to +-FP8_MAX


@dataclass(frozen=True)
class Shape:
    """The sizes of a checked call. `lead` is the leading shape of every per-token tensor: (N,) for
    one token per request, (N, T) for T each, (L,) for a flat token dimension with cu_seqlens."""

    lead: tuple[int, ...]
    N: int
    L: int
    H: int
    K: int
    HV: int
    V: int
    columns: int  # idx [N]: 0; idx [N, C]: C slots per request


def min_valid_slot(invalid_slot: str) -> int:
    """The lowest slot that holds a state: 0, or 1 where slot 0 is the engine's null block (vLLM)."""
    if invalid_slot not in INVALID_SLOT_RULES:
        raise ValueError(f"invalid_slot={invalid_slot!r} is not accepted; expected one of {INVALID_SLOT_RULES}")
    return 0 if invalid_slot == "negative" else 1


def check_head_dims(K: int, V: int) -> None:
    for name, size in (("K", K), ("V", V)):
        if size not in HEAD_DIMS:
            raise ValueError(f"head dim {name}={size} is not supported; accepted: {', '.join(map(str, HEAD_DIMS))}")


def _dims(shape) -> str:
    return f"[{', '.join(map(str, shape))}]"


def check_gates(kind, lead, HV, K, g, beta, a, b, A_log, dt_bias) -> None:
    """The gate errors, named: g or a is lead + [HV] (GDN) or lead + [HV, K] (KDA), beta or b lead + [HV];
    lead is q's leading shape, or N for one token per request."""
    lead = (lead,) if isinstance(lead, int) else tuple(lead)
    per_channel = kind == "kda"
    g_shape = lead + ((HV, K) if per_channel else (HV,))
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
        hint = " (per-channel gates are KDA)" if not per_channel and g.dim() == len(g_shape) + 1 else ""
        raise ValueError(f"{kind.upper()} g must be {list(g_shape)}; got {list(g.shape)}{hint}")
    if (beta is None) == (b is None):
        raise ValueError("pass exactly one of beta (in (0, 1)) and b (raw, sigmoid applied)")
    x = beta if beta is not None else b
    if tuple(x.shape) != lead + (HV,):
        raise ValueError(f"{'beta' if beta is not None else 'b'} must be {_dims(lead + (HV,))}; got {list(x.shape)}")


def check_pool(state: torch.Tensor, layout: str) -> None:
    """The pool rule: each slot's [HV, K, V] (or [HV, V, K]) block is contiguous; slots may lie any
    whole number of elements apart, at least one block (vLLM's padded pages: a page holds the conv
    state, this state and padding)."""
    block = state.shape[1] * state.shape[2] * state.shape[3]
    inner = (state.shape[2] * state.shape[3], state.shape[3], 1)
    bad = [d for d in (1, 2, 3) if state.shape[d] > 1 and state.stride(d) != inner[d - 1]]
    names = "[HV, K, V]" if layout == "kv" else "[HV, V, K]"
    if bad:
        raise ValueError(f"state's slot block {names} must be contiguous (strides {inner}); got strides "
                         f"{tuple(state.stride())[1:]} for shape {tuple(state.shape)}")
    if state.shape[0] > 1 and state.stride(0) < block:
        raise ValueError(f"state's slot stride must be at least one slot's block of {block} elements (a multiple "
                         f"of the element size, padding allowed); got {state.stride(0)}")


def check_kernel_pool(state: torch.Tensor) -> None:
    """The kernels' one rule beyond the pool rule (their state accesses are 16-byte vectors): the
    pool starts on 16 bytes and its slots lie a whole number of 16-byte units apart, so every slot
    starts aligned. vLLM's pages are (its own CUDA op requires the same). csrc/ops.cpp checks it
    too; this names it for the Python API, in the same words."""
    size = state.element_size()
    stride = state.stride(0) if state.shape[0] > 1 else math.prod(state.shape[1:])
    if (stride * size) % 16:
        raise ValueError(f"state's slot stride of {stride} elements ({stride * size} bytes) is not a multiple of 16 "
                         "bytes; accepted on CUDA: slots a multiple of 16 bytes apart (the kernels' 16-byte state "
                         "accesses; vLLM's pages are)")
    if state.data_ptr() % 16:
        raise ValueError(f"state must start on 16 bytes; got address offset {state.data_ptr() % 16} (a view "
                         "starting mid-row is not)")


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    """[first, end) of the bytes x addresses (every argument here has non-negative strides)."""
    if x.numel() == 0:
        return (0, 0)
    last = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    first = x.data_ptr()
    return first, first + (last + 1) * x.element_size()


def _meets_slots(state: torch.Tensor, span: tuple[int, int]) -> bool:
    """Whether the bytes [lo, hi) meet a slot's block of the pool; the padding between blocks is not
    the pool's (vLLM keeps each page's conv state there)."""
    lo, hi = span
    if lo == hi or state.numel() == 0:
        return False
    size, base = state.element_size(), state.data_ptr()
    block = math.prod(state.shape[1:]) * size
    stride = state.stride(0) * size if state.shape[0] > 1 else block
    first = max(0, (lo - base - block) // stride + 1)  # the first slot whose block ends past lo
    return first < state.shape[0] and base + first * stride < hi


def check_no_overlap(state: torch.Tensor, out: Optional[torch.Tensor],
                     inputs: dict[str, Optional[torch.Tensor]]) -> None:
    """out and the pool are written while the inputs are still read, so none of them may share a
    byte with another argument: an out that aliases output_gate, or tokens inside the pool, would be
    read back overwritten. A traced call has no addresses: the op checks it when it runs."""
    if torch.compiler.is_compiling() or state.device.type == "meta":
        return
    named = [(n, x) for n, x in inputs.items() if x is not None and x.device == state.device]
    accepted = "accepted: buffers that share no byte with each other"
    if out is not None and out.device == state.device:
        out_span = _byte_span(out)
        if _meets_slots(state, out_span):
            raise ValueError(f"out shares memory with the state pool; {accepted} (out is written, the pool "
                             "read and written)")
        for name, x in named:
            lo, hi = _byte_span(x)
            if lo < out_span[1] and out_span[0] < hi:
                raise ValueError(f"out shares memory with {name}; {accepted} (out is written while {name} is "
                                 "still read)")
    for name, x in named:
        if _meets_slots(state, _byte_span(x)):
            raise ValueError(f"{name} shares memory with the state pool's slots; {accepted} (the pool is "
                             f"written while {name} is still read)")


def _check_index(name: str, x: torch.Tensor, shape: tuple, what: str) -> None:
    if x.dtype not in INDEX_DTYPES or tuple(x.shape) != shape:
        raise ValueError(f"{name} must be an int32/int64 tensor of shape {_dims(shape)} ({what}); "
                         f"got {x.dtype} {tuple(x.shape)}")


def _check_tokens(q, k, v, cu_seqlens):
    """(lead, N, L, H, K, HV, V) from q, k, v and cu_seqlens."""
    if cu_seqlens is not None:
        if q.dim() != 3 or k.shape != q.shape:
            raise ValueError(f"with cu_seqlens, q and k must both be [tokens, H, K]; got {tuple(q.shape)} and "
                             f"{tuple(k.shape)}")
        if cu_seqlens.dtype not in INDEX_DTYPES or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be an int32/int64 tensor [N+1] of token offsets; got "
                             f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        lead, N = (q.shape[0],), cu_seqlens.numel() - 1
    else:
        if q.dim() not in (3, 4) or k.shape != q.shape:
            raise ValueError(f"q and k must both be [N, H, K] (one token per request) or [N, T, H, K]; got "
                             f"{tuple(q.shape)} and {tuple(k.shape)}")
        lead, N = tuple(q.shape[:-2]), q.shape[0]
    H, K = q.shape[-2], q.shape[-1]
    if v.dim() != q.dim() or tuple(v.shape[:-2]) != lead or H == 0 or v.shape[-2] % H:
        raise ValueError(f"v must be {_dims(lead + ('HV', 'V'))} with HV a multiple of H={H}; got {tuple(v.shape)}")
    L = math.prod(lead)
    return lead, N, L, H, K, v.shape[-2], v.shape[-1]


def _check_slots(idx, num_accepted_tokens, lead, N) -> int:
    """The number of slot columns: 0 for idx [N], C for idx [N, C]."""
    if idx.dtype not in INDEX_DTYPES or idx.dim() not in (1, 2) or idx.shape[0] != N or (
            idx.dim() == 2 and idx.shape[1] < 1):
        raise ValueError(f"idx must be an int32/int64 tensor of shape [{N}] (a slot per request) or [{N}, T] (a "
                         f"slot per token); got {idx.dtype} {tuple(idx.shape)}")
    columns = idx.shape[1] if idx.dim() == 2 else 0
    if columns and len(lead) == 2 and columns < lead[1]:
        raise ValueError(f"idx [N, T] needs a slot for each of the T={lead[1]} tokens; got {columns} columns")
    if num_accepted_tokens is not None:
        if not columns:
            raise ValueError("num_accepted_tokens picks the starting slot among idx[n, :]: idx must be [N, T] "
                             f"(a slot per token); got idx {tuple(idx.shape)}")
        _check_index("num_accepted_tokens", num_accepted_tokens, (N,), "accepted tokens per request")
    return columns


def _check_epilogue(v, output_gate, norm_weight, norm_eps, gate_activation) -> None:
    if (output_gate is None) != (norm_weight is None):
        raise ValueError("the gated RMSNorm epilogue needs both output_gate and norm_weight; got only "
                         f"{'output_gate' if norm_weight is None else 'norm_weight'}")
    if output_gate is None:
        given = [n for n, x in (("norm_eps", norm_eps), ("gate_activation", gate_activation)) if x is not None]
        if given:
            verb = "belong" if len(given) > 1 else "belongs"
            raise ValueError(f"{' and '.join(given)} {verb} to the gated RMSNorm epilogue: pass output_gate and "
                             "norm_weight too")
        return
    if tuple(output_gate.shape) != tuple(v.shape) or not output_gate.dtype.is_floating_point:
        raise ValueError(f"output_gate must be a float tensor of v's shape {tuple(v.shape)}; got "
                         f"{output_gate.dtype} {tuple(output_gate.shape)}")
    V = v.shape[-1]
    if tuple(norm_weight.shape) != (V,) or not norm_weight.dtype.is_floating_point:
        raise ValueError(f"norm_weight must be a float tensor [V] = [{V}]; got {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")
    if norm_eps is not None and (isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float))
                                 or not math.isfinite(norm_eps) or norm_eps < 0):
        raise ValueError(f"norm_eps must be a finite number >= 0; got {norm_eps!r}")
    if gate_activation is not None and gate_activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gate_activation={gate_activation!r} is not accepted; expected one of {GATE_ACTIVATIONS}")


def _check_output_scale(v, output_gate, output_scale) -> None:
    if output_scale is None:
        return
    if output_gate is None:
        raise ValueError("output_scale quantizes the gated RMSNorm epilogue's output to FP8: pass output_gate and "
                         "norm_weight too")
    if not isinstance(output_scale, torch.Tensor) or output_scale.dtype != torch.float32 or output_scale.numel() != 1:
        got = (f"{output_scale.dtype} {tuple(output_scale.shape)}" if isinstance(output_scale, torch.Tensor)
               else repr(output_scale))
        raise ValueError("output_scale must be a float32 tensor of one element (a static per-tensor FP8 scale, "
                         f"as vLLM's); got {got}")
    if output_scale.device != v.device:
        raise ValueError(f"output_scale must be on v's device ({v.device}); got {output_scale.device}")


def _check_out(v, out, output_scale) -> None:
    if out is None:
        return
    want = v.dtype if output_scale is None else FP8_DTYPE
    if tuple(out.shape) != tuple(v.shape) or out.dtype != want:
        why = " (output_scale is given: the output is FP8)" if output_scale is not None else (
            " (an FP8 out needs output_scale)" if out.dtype == FP8_DTYPE else "")
        raise ValueError(f"out must be a {want} tensor of shape {_dims(v.shape)}{why}; got {out.dtype} "
                         f"{tuple(out.shape)}")


def check_call(q, k, v, state, idx, layout, out, cu_seqlens=None, num_accepted_tokens=None, output_gate=None,
               norm_weight=None, norm_eps=None, gate_activation=None, overlap: bool = True,
               output_scale=None) -> Shape:
    """Every check that reads no tensor's values; returns the call's sizes. overlap=False leaves
    check_no_overlap to the op (the kernel path before it launches: the op compares the addresses
    itself, in C++, where a Python comparison would add about 40 us to an eager call)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not accepted; expected one of {LAYOUTS}")
    lead, N, L, H, K, HV, V = _check_tokens(q, k, v, cu_seqlens)
    check_head_dims(K, V)
    want = (HV, K, V) if layout == "kv" else (HV, V, K)
    if state.dim() != 4 or tuple(state.shape[1:]) != want:
        raise ValueError(f"state must be [P, {', '.join(map(str, want))}] for layout {layout!r}; got "
                         f"{tuple(state.shape)}")
    if state.dtype not in STATE_DTYPES:
        raise ValueError(f"state dtype {state.dtype} is not accepted; expected one of: float32, bfloat16")
    check_pool(state, layout)
    columns = _check_slots(idx, num_accepted_tokens, lead, N)
    _check_epilogue(v, output_gate, norm_weight, norm_eps, gate_activation)
    _check_output_scale(v, output_gate, output_scale)
    _check_out(v, out, output_scale)
    if overlap:
        check_no_overlap(state, out, {"q": q, "k": k, "v": v, "idx": idx, "cu_seqlens": cu_seqlens,
                                      "num_accepted_tokens": num_accepted_tokens, "output_gate": output_gate,
                                      "norm_weight": norm_weight, "output_scale": output_scale})
    return Shape(lead=lead, N=N, L=L, H=H, K=K, HV=HV, V=V, columns=columns)


def check_decode_call(call: DecodeCall, overlap: bool = True) -> Shape:
    """check_call on a whole call value: what the reference and the kernel path both check first
    (overlap: as check_call's, over every tensor of the call, the gates too)."""
    shape = check_call(call.q, call.k, call.v, call.state, call.idx, call.layout, call.out, call.cu_seqlens,
                       call.num_accepted_tokens, call.output_gate, call.norm_weight, call.norm_eps,
                       call.gate_activation, overlap=False, output_scale=call.output_scale)
    if overlap:
        check_call_overlap(call)
    return shape


def check_call_overlap(call: DecodeCall) -> None:
    """check_no_overlap over every tensor of a call value, in the C++ op's order."""
    check_no_overlap(call.state, call.out, {
        "q": call.q, "k": call.k, "v": call.v, "idx": call.idx, "cu_seqlens": call.cu_seqlens,
        "num_accepted_tokens": call.num_accepted_tokens, "output_gate": call.output_gate,
        "norm_weight": call.norm_weight, "g": call.g, "beta": call.beta, "a": call.a, "b": call.b,
        "A_log": call.A_log, "dt_bias": call.dt_bias, "output_scale": call.output_scale})


def check_token_values(shape: Shape, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """Token offsets [N+1] (int64, on the CPU): cu_seqlens checked, or those of the dense forms. Reads
    cu_seqlens' values: the reference's check, never the kernel path's."""
    if cu_seqlens is None:
        T = shape.lead[1] if len(shape.lead) == 2 else 1
        return torch.arange(shape.N + 1, dtype=torch.int64) * T
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) < 0 or int(cu[-1]) > shape.L or bool((lens < 0).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing offsets within the {shape.L} tokens; got "
                         f"{cu.tolist()}")
    if shape.columns and shape.N and int(lens.max()) > shape.columns:
        n = int(lens.argmax())
        raise ValueError(f"request {n} has {int(lens[n])} tokens (cu_seqlens) but idx has {shape.columns} columns: "
                         "idx [N, T] needs a slot for each token")
    return cu
