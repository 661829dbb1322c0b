"""One decode call as a value: what the public API received, handed whole to the reference and to
the kernel path, so an option is declared here once and read where it is used.

GDN and KDA are the same call with a different decay: `kind` says which ("kda": a per-channel
log-decay over the K key channels), and it is the only difference between them downstream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

KINDS = ("gdn", "kda")


def gate_lower_bound_problem(lower_bound) -> Optional[str]:
    """What is wrong with a gate_lower_bound, or None: it is None (the softplus form) or a finite
    number < 0."""
    if lower_bound is None or (isinstance(lower_bound, (int, float)) and math.isfinite(lower_bound)
                               and lower_bound < 0):
        return None
    return f"gate_lower_bound must be a finite number < 0 (or None); got {lower_bound!r}"


@dataclass(frozen=True)
class DecodeCall:
    """The arguments of cudelta.gdn_decode / kda_decode (their docstrings say what each means)."""

    kind: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: Optional[torch.Tensor]
    beta: Optional[torch.Tensor]
    state: torch.Tensor
    idx: torch.Tensor
    a: Optional[torch.Tensor] = None
    b: Optional[torch.Tensor] = None
    A_log: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None
    scale: Optional[float] = None
    use_qk_l2norm: bool = False
    layout: str = "kv"
    invalid_slot: str = "negative"
    out: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    num_accepted_tokens: Optional[torch.Tensor] = None
    output_gate: Optional[torch.Tensor] = None
    norm_weight: Optional[torch.Tensor] = None
    norm_eps: Optional[float] = None
    gate_activation: Optional[str] = None
    gate_lower_bound: Optional[float] = None
    output_scale: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is not accepted; expected one of {KINDS}")
        lb = self.gate_lower_bound
        if lb is not None:
            # The bounded form is KDA's (vLLM's Kimi K3 "safe gate") and is a form of the raw gate.
            if self.kind != "kda" or self.a is None:
                raise ValueError(f"gate_lower_bound={lb!r} needs kda_decode with the raw gate a (A_log, dt_bias); "
                                 f"got kind {self.kind!r}{'' if self.a is not None else ' without a'}")
            problem = gate_lower_bound_problem(lb)
            if problem:
                raise ValueError(problem)

    @property
    def per_channel(self) -> bool:
        return self.kind == "kda"

    @property
    def resolved_scale(self) -> float:
        return self.q.shape[-1] ** -0.5 if self.scale is None else float(self.scale)

    @property
    def multi_token(self) -> bool:
        """Anything beyond one token a request read and written in place at idx[n], no epilogue."""
        return (self.q.dim() == 4 or self.cu_seqlens is not None or self.idx.dim() == 2
                or self.output_gate is not None)
