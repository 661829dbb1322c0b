"""One multi-token decode call (speculative decoding: several tokens per request, state checkpoints,
the accepted-token start, the gated RMSNorm epilogue, vLLM's padded pool) as a case: built on any
device, run through the public API, checked against the float64 loop of tests/unit/decode_loop.py.

The GPU tests (tests/gpu/test_mtp_gpu.py) run the kernels through it; tests/unit/test_mtp_cases.py
runs the same cases on CPU tensors, where the public API is the PyTorch reference, so the builder
and the checker are themselves tested without a GPU.

    step = build(case, "cuda")       # inputs made on the CPU from case.seed, then moved: alike on every device
    before = snapshot(step)
    out = call(case, step)
    check(case, step, before, out)   # outputs and stored states element by element, every other pool byte as it was

Tolerances: tests/step_tolerance.py (token_magnitudes: t + 1 steps' worth for token t;
epilogue_tolerance: what the output's own tolerance does to the norm).
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "unit"))  # decode_loop.py, the float64 loop
from decode_loop import loop_epilogue, loop_reference  # noqa: E402
from step_tolerance import (  # noqa: E402
    TokenMagnitudes,
    assert_within,
    epilogue_tolerance,
    token_magnitudes,
    tolerance,
)

import cudelta  # noqa: E402
from cudelta.reference import gated_rms_norm, static_fp8  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
LOWEST = {"negative": 0, "nonpositive": 1}
# The token forms: "single" is q [N, H, K] (one token each, today's call), "T<n>" q [N, n, H, K],
# "varlen" a flat token dimension with cu_seqlens: these counts (one request has none) in an order
# the seed picks, then PAD_TOKENS tokens after cu_seqlens[N] that belong to no request.
TOKEN_FORMS = ("single",) + tuple(f"T{t}" for t in range(1, 9)) + ("varlen",)
VARLEN = (3, 0, 8, 1, 5, 2)
PAD_TOKENS = 2
# "varlen2" and "varlen4" the same with at most two or four tokens a request (vLLM's call with one
# or three draft tokens, some requests short or empty): the few-token kernel's forms, not in
# TOKEN_FORMS (the matrix's pairs stay as they are); "varlen1" vLLM's call without draft tokens;
# "varlen9" vLLM 0.34's call with eight draft tokens, its op's most (S <= 9).
VARLEN_COUNTS = {"varlen": VARLEN, "varlen1": (1, 0, 1, 1, 1, 1), "varlen2": (2, 0, 1, 2, 2, 1),
                 "varlen4": (4, 0, 3, 1, 4, 2), "varlen9": (9, 0, 9, 2, 1, 9)}


def takes_the_few_token_kernel(pairs: int, sms: int, fp32: bool, columns: int, profile_on_sm90: bool = False) -> bool:
    """kernels/mtp_few.cuh's few_token_call for a GDN call (layout vk, K = V = 128) with idx [N,
    columns] and `pairs` (request, value head) pairs on `sms` SMs: which kernel a GPU test's case
    reaches (tests/unit/test_few_token_rule.py holds this to the C++). profile_on_sm90: the call is
    vLLM's exact one (in_vllm_profile) and the GPU loads an sm_90 image (capability 9.0), where a
    bf16 state takes fp32's rules but one (its four-column build only up to 4 pairs an SM, in waves
    of one block an SM, not two)."""
    wide_rules = fp32 or profile_on_sm90
    rows = 16 if fp32 or columns == 2 else 8  # a warp's, in the build past one pair an SM
    wave = (2 if rows >= 16 else 1) * sms  # its blocks an SM (few_blocks_per_sm)
    full_waves = pairs <= wave or pairs * 10 >= -(-pairs // wave) * wave * 9
    if columns > 2:
        return wide_rules and columns <= 4 and pairs * 10 >= sms * 9 and pairs <= (32 if fp32 else 4) * sms and full_waves
    return columns == 2 and (pairs <= wave or (wide_rules and pairs <= 128 * sms and full_waves))


def in_vllm_profile(case: "Case") -> bool:
    """Whether the case's call is vLLM's exact one as kernels/mtp_common.cuh's vllm_profile asks it:
    GDN with bf16 io, raw gates, int32 indices, l2-normalised q and k, V = 128 (no FP8 output: the
    FP8 tests make that call apart)."""
    return (case.kind == "gdn" and case.io == "bf16" and case.gates == "raw" and case.index == "int32" and case.l2norm
            and case.V == 128)


def few_cluster_blocks(pairs: int, sms: int, fp32: bool, columns: int, epilogue: bool, V: int = 128) -> int:
    """kernels/mtp_few.cuh's few_cluster_blocks on an sm_90+ image: the blocks of a cluster a head's
    rows take in the few-token kernel (1: no cluster)."""
    def rows(blocks: int) -> int:  # a warp's, in a block of the cluster
        return (4 if blocks == 4 else 16) if fp32 else 8

    if not epilogue or columns != 2:
        return 1
    return next((blocks for blocks in (4, 2) if pairs * blocks <= sms and V % (blocks * rows(blocks)) == 0), 1)


@dataclass(frozen=True)
class Case:
    """One call's options (defaults: what vLLM's MTP step passes)."""

    kind: str = "gdn"  # gdn, kda
    layout: str = "vk"  # kv, vk
    state: str = "bf16"  # the pool's dtype: fp32, bf16
    gates: str = "raw"  # pre (g, beta), raw (a, b, A_log, dt_bias)
    rule: str = "nonpositive"  # invalid_slot: negative, nonpositive (slot 0 the null block)
    tokens: str = "varlen"  # TOKEN_FORMS
    slots: str = "accepted"  # final: idx [N]; ckpt: idx [N, C]; accepted: idx [N, C] and num_accepted_tokens
    columns: str = "T"  # C = the most tokens of a request ("T"), or one more ("T+1")
    epilogue: str = "silu"  # none, silu, sigmoid
    eps: Optional[float] = 1e-3  # norm_eps (None: the default, 1e-5)
    group: int = 2  # HV / H
    io: str = "bf16"  # q, k, v, z, a, b and the output: bf16, fp16, fp32
    out: str = "buffer"  # buffer: out= a NaN-filled buffer; new: the call allocates
    pool: str = "pages"  # contiguous, pages (vLLM's padded page layout)
    conv_bytes: int = 4096  # pages: the conv state before the state in each page
    pad_bytes: int = 528  # pages: padding after it (a multiple of 16: the kernels' slot rule)
    l2norm: bool = True  # use_qk_l2norm (without it: unit-norm-sized k and scale=0.3, so the state stays bounded)
    index: str = "int32"  # idx, cu_seqlens, num_accepted_tokens dtype
    H: int = 2
    K: int = 128
    V: int = 128
    N: int = 6  # requests (varlen: len(VARLEN))
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [self.kind, self.layout, f"{self.state}state", self.gates, self.rule, self.tokens, self.slots]
        parts += [f"C={self.columns}"] if self.slots != "final" else []
        parts += [self.epilogue, f"HV={self.group}H", f"{self.io}io", self.out, self.pool,
                  "l2" if self.l2norm else "nol2", self.index]
        if (self.K, self.V) != (128, 128):
            parts.append(f"K{self.K}V{self.V}")
        if (self.H, self.N) != (2, 6):
            parts.append(f"H{self.H}N{self.N}")
        if self.pool == "pages" and (self.conv_bytes, self.pad_bytes) != (4096, 528):
            parts.append(f"conv{self.conv_bytes}pad{self.pad_bytes}")
        return "-".join(parts)


def case_id(case: Case) -> str:
    return case.id


@dataclass
class Step:
    """A built call: its device tensors (in the call's shapes; None where the case has none), the
    pool, and the raw bytes of the pool's whole allocation (for pages: the conv states and padding
    too)."""

    case: Case
    t: dict[str, Optional[torch.Tensor]]
    lens: list[int]
    state: torch.Tensor
    storage: torch.Tensor  # uint8 [bytes], a view of the allocation the pool lives in
    base: int  # byte offset of slot 0's block in storage
    out: Optional[torch.Tensor]  # the NaN-filled out= buffer (case.out == "buffer")

    @property
    def slot_bytes(self) -> int:
        return self.state.stride(0) * self.state.element_size()

    @property
    def block_bytes(self) -> int:
        return math.prod(self.state.shape[1:]) * self.state.element_size()


@dataclass
class Snapshot:
    """What a call starts from: every input and the pool's values on the CPU (for the loop), the
    pool's values and a copy of the allocation's bytes on the pool's device (for the magnitudes and
    the comparisons, which a pool of gigabytes makes too slow on the host)."""

    t: dict[str, Optional[torch.Tensor]]
    state: torch.Tensor
    device_state: torch.Tensor
    storage: torch.Tensor


def token_lens(case: Case) -> list[int]:
    """Tokens per request. varlen, varlen2, varlen4: their VARLEN_COUNTS over the N requests in an
    order the seed picks (the total depends on N alone, so two seeds give calls of the same shapes)."""
    if case.tokens in VARLEN_COUNTS:
        counts = VARLEN_COUNTS[case.tokens]
        gen = torch.Generator().manual_seed(case.seed)
        return [counts[i % len(counts)] for i in torch.randperm(case.N, generator=gen).tolist()]
    return [1 if case.tokens == "single" else int(case.tokens[1:])] * case.N


def scale_of(case: Case) -> float:
    """The call's scale: K^-0.5 (the default, not passed) with the l2 norm, else 0.3 (passed)."""
    return case.K ** -0.5 if case.l2norm else 0.3


def _markers(case: Case, P: int) -> tuple[int, int]:
    """Two invalid slot values for the case's rule, each meaning "no state here": the null block 0
    (nonpositive) or a negative slot, and a slot past the pool."""
    return (0, P + 1) if case.rule == "nonpositive" else (-1, P + 5)


def _slots(case: Case, lens: list[int], gen: torch.Generator):
    """(idx, accepted, P): idx [N] or [N, C], each valid slot named once, with the rows the contract
    singles out. Roles, on rows the seed picks: an invalid starting slot (zero outputs, nothing
    written); with checkpoints, a row with invalid columns (not written; the state goes on), a
    column past P; with accepted tokens, acc = 0 and acc = C + 1 (no starting column) and rejected
    drafts (acc < C: start at idx[n, acc - 1], a slot this step overwrites). Under "negative" slot 0
    is an ordinary slot and named; under "nonpositive" it is the null block."""
    N, T = len(lens), max(lens)
    C = 0 if case.slots == "final" else T + (1 if case.columns == "T+1" else 0)
    lowest = LOWEST[case.rule]
    P = N * max(C, 1) + 3  # three slots no request names
    valid = (torch.randperm(P - lowest, generator=gen) + lowest).tolist()
    marks = _markers(case, P)
    order = torch.randperm(N, generator=gen).tolist()
    rows = [n for n in order if lens[n]] + [n for n in order if not lens[n]]  # roles go to rows with tokens
    acc = None
    if case.slots == "final":
        idx = torch.tensor(valid[:N])
        if N > 2:  # a request without a state and one past the pool, others that run
            idx[rows[0]], idx[rows[1]] = marks
    else:
        idx = torch.tensor(valid[:N * C]).reshape(N, C)
        if case.slots == "accepted":
            acc = torch.randint(1, C + 1, (N,), generator=gen)
            if N > 5:  # no starting column twice; a draft rejected at its first token; every draft accepted
                acc[rows[2]], acc[rows[3]], acc[rows[4]], acc[rows[5]] = 0, C + 1, 1, C
        start = (acc - 1) if acc is not None else torch.zeros(N, dtype=torch.long)
        if N > 1:
            idx[rows[0], int(start[rows[0]])] = marks[0]  # no starting slot
        if C > 1 and N > 4:  # invalid checkpoint columns besides the start: not written, the state carried on
            holes = [c for c in range(C) if c != int(start[rows[1]])]
            for c, mark in zip(holes, marks):
                idx[rows[1], c] = mark
            idx[rows[4], C - 1 if C - 1 != int(start[rows[4]]) else 0] = P + 2  # past the pool
    if lowest == 0 and not bool((idx == 0).any()):  # slot 0 is a state like any other: name it somewhere
        named = ((idx >= 0) & (idx < P)).view(-1).nonzero().squeeze(1)
        idx.view(-1)[named[int(torch.randint(0, len(named), (1,), generator=gen))]] = 0
    return idx, acc, P


def build(case: Case, device) -> Step:
    """The case's call on `device`. Every value comes from case.seed on the CPU, then moves: the same
    case builds the same call on any device."""
    gen = torch.Generator().manual_seed(case.seed)
    lens = token_lens(case)
    N, L = len(lens), sum(lens) + (PAD_TOKENS if case.tokens in VARLEN_COUNTS else 0)
    H, HV, K, V = case.H, case.H * case.group, case.K, case.V
    io, kda = DTYPES[case.io], case.kind == "kda"
    # without the l2 norm, k of about unit length keeps beta k k^T a contraction over 8 tokens
    qk_scale = 1.0 if case.l2norm else K ** -0.5
    gate_shape = (L, HV, K) if kda else (L, HV)
    t = dict(
        q=torch.randn(L, H, K, generator=gen) * qk_scale, k=torch.randn(L, H, K, generator=gen) * qk_scale,
        v=torch.randn(L, HV, V, generator=gen),
        g=-torch.rand(*gate_shape, generator=gen) * 0.5, beta=torch.rand(L, HV, generator=gen),
        a=torch.randn(*gate_shape, generator=gen) * 3, b=torch.randn(L, HV, generator=gen) * 2,
        A_log=torch.randn(HV, generator=gen) * 0.5, dt_bias=torch.randn(*gate_shape[1:], generator=gen),
        z=torch.randn(L, HV, V, generator=gen) * 2, w=1 + torch.randn(V, generator=gen) * 0.2,
    )
    t["a"].view(-1)[::37] = 25.0  # past softplus' threshold of 20: softplus(x) = x there
    for name in ("q", "k", "v", "z", "a", "b"):
        t[name] = t[name].to(io)
    if case.gates == "pre":
        t.update(a=None, b=None, A_log=None, dt_bias=None)
    else:
        t.update(g=None, beta=None)
    if case.epilogue == "none":
        t.update(z=None, w=None)
    idx, acc, P = _slots(case, lens, gen)
    index = INDEX_DTYPES[case.index]
    t["idx"] = idx.to(index)
    t["accepted"] = None if acc is None else acc.to(index)
    t["cu_seqlens"] = None
    if case.tokens in VARLEN_COUNTS:
        t["cu_seqlens"] = torch.tensor([0] + list(itertools.accumulate(lens))).to(index)
    elif case.tokens != "single":  # [N, T, ...]: the same tokens, request-major
        T = lens[0]
        for name in ("q", "k", "v", "g", "beta", "a", "b", "z"):
            if t[name] is not None:
                t[name] = t[name].reshape(N, T, *t[name].shape[1:])
    state, pages = _pool(case, P, HV, K, V, gen)
    t = {n: None if x is None else x.to(device) for n, x in t.items()}
    if pages is None:
        state = state.to(device)
        storage, base = state.view(-1).view(torch.uint8), 0
    else:
        pages = pages.to(device)
        nbytes = state[0].numel() * state.element_size()
        state = pages[:, case.conv_bytes:case.conv_bytes + nbytes].view(state.dtype).view(P, *state.shape[1:])
        storage, base = pages.view(-1).view(torch.uint8), case.conv_bytes
    out = torch.full(t["v"].shape, float("nan"), dtype=io, device=device) if case.out == "buffer" else None
    return Step(case, t, lens, state, storage, base, out)


def _pool(case: Case, P, HV, K, V, gen):
    """(state, pages): the pool's values; for "pages", vLLM's mamba cache pages holding them
    (MambaBase.bind_kv_cache: [P, conv | state | padding] int8, every byte random first)."""
    inner = (HV, K, V) if case.layout == "kv" else (HV, V, K)
    state = (torch.randn(P, *inner, generator=gen) * 0.1).to(DTYPES[case.state])
    if case.pool == "contiguous":
        return state, None
    nbytes = state[0].numel() * state.element_size()
    pages = torch.randint(-128, 128, (P, case.conv_bytes + nbytes + case.pad_bytes), generator=gen, dtype=torch.int8)
    pages[:, case.conv_bytes:case.conv_bytes + nbytes].view(state.dtype).view(P, *inner).copy_(state)
    return state, pages


def snapshot(step: Step) -> Snapshot:
    return Snapshot({n: None if x is None else x.detach().cpu().clone() for n, x in step.t.items()},
                    step.state.detach().cpu().clone(), step.state.detach().clone(), step.storage.clone())


def call_args(case: Case, t: dict, out: Optional[torch.Tensor]) -> tuple[tuple, dict]:
    """The public call's (args, kwargs) for the case on the tensors t."""
    kw = dict(a=t["a"], b=t["b"], A_log=t["A_log"], dt_bias=t["dt_bias"], use_qk_l2norm=case.l2norm,
              layout=case.layout, invalid_slot=case.rule, out=out)
    if not case.l2norm:
        kw["scale"] = scale_of(case)
    if t["cu_seqlens"] is not None:
        kw["cu_seqlens"] = t["cu_seqlens"]
    if t["accepted"] is not None:
        kw["num_accepted_tokens"] = t["accepted"]
    if case.epilogue != "none":
        kw.update(output_gate=t["z"], norm_weight=t["w"], norm_eps=case.eps, gate_activation=case.epilogue)
    return (t["q"], t["k"], t["v"], t["g"], t["beta"]), kw


def call(case: Case, step: Step) -> torch.Tensor:
    """cudelta.gdn_decode / kda_decode with the case's options: the kernels on CUDA tensors, the
    reference on CPU tensors."""
    args, kw = call_args(case, step.t, step.out)
    fn = cudelta.kda_decode if case.kind == "kda" else cudelta.gdn_decode
    return fn(*args, step.state, step.t["idx"], **kw)


def gates64(t: dict, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log-decay and beta from either form, vectorised (decode_loop.loop_gates does it element
    by element, too slowly for the GPU cases; tests/unit/test_mtp_cases.py holds the two equal)."""
    if t["g"] is not None:
        return t["g"].double(), t["beta"].double()
    x = t["a"].double() + t["dt_bias"].double()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    decay = torch.exp(t["A_log"].double())
    g = -(decay[:, None] if kind == "kda" else decay) * softplus
    return g, 1.0 / (1.0 + torch.exp(-t["b"].double()))


@dataclass
class Expected:
    """The float64 loop's result, flat: out [tokens, HV, V] (v's dtype), o the output before the
    epilogue, the pool after (CPU); the magnitudes (on the pool's device, out on the CPU); the
    tokens whose output must be exactly 0 [tokens]."""

    out: torch.Tensor
    o: torch.Tensor
    state: torch.Tensor
    mags: TokenMagnitudes
    zero: torch.Tensor


def _flat(x: Optional[torch.Tensor], lead: int) -> Optional[torch.Tensor]:
    return None if x is None else x.reshape(-1, *x.shape[lead:])


def expect(case: Case, before: Snapshot) -> Expected:
    """What the call must do, from the float64 loop on the snapshot (CPU), and its magnitudes."""
    t = before.t
    lead = 2 if t["q"].dim() == 4 else 1
    q, k, v, z = (_flat(t[n], lead) for n in ("q", "k", "v", "z"))
    g, beta = gates64(t, case.kind)
    g, beta = _flat(g, lead), _flat(beta, lead)
    lens = token_lens(case)
    cu = [0] + list(itertools.accumulate(lens))
    lowest = LOWEST[case.rule]
    pool = before.state.clone()
    o = loop_reference(q, k, v, g, beta, pool, t["idx"], scale_of(case), case.l2norm, case.layout, lowest,
                       cu_seqlens=cu, accepted=t["accepted"])
    dev = before.device_state.device
    mags = token_magnitudes(q.to(dev), k.to(dev), v.to(dev), g.to(dev), beta.to(dev), before.device_state, t["idx"],
                            cu, accepted=t["accepted"], scale=scale_of(case), use_qk_l2norm=case.l2norm,
                            layout=case.layout, lowest=lowest)
    mags = TokenMagnitudes(mags.out.cpu(), mags.state)
    ran = torch.zeros(q.shape[0], dtype=torch.bool)
    for n in range(len(lens)):
        if _start(t["idx"], t["accepted"], n, lowest, pool.shape[0]) is not None:
            ran[cu[n]:cu[n + 1]] = True
    out = o
    if case.epilogue != "none":
        eps = 1e-5 if case.eps is None else case.eps
        out = torch.zeros_like(o)
        for r, hv in itertools.product(ran.nonzero().squeeze(1).tolist(), range(o.shape[1])):
            out[r, hv] = loop_epilogue(o[r, hv], z[r, hv], t["w"], eps, case.epilogue)
    return Expected(out, o, pool, mags, ~ran)


def _start(idx, accepted, n, lowest, P) -> Optional[int]:
    """Request n's starting slot, or None (the contract's rule, for the rows that must stay zero)."""
    if idx.dim() == 1:
        s = int(idx[n])
    else:
        acc = 1 if accepted is None else int(accepted[n])
        s = int(idx[n, acc - 1]) if 1 <= acc <= idx.shape[1] else -1
    return s if lowest <= s < P else None


def written_mask(step: Step, slots) -> torch.Tensor:
    """The bytes of the allocation a call may write: the state blocks of `slots`."""
    mask = torch.zeros(step.storage.shape, dtype=torch.bool, device=step.storage.device)
    for s in slots:
        at = step.base + s * step.slot_bytes
        mask[at:at + step.block_bytes] = True
    return mask


def output_tol(case: Case, exp: Expected, before: Snapshot) -> torch.Tensor:
    """Each output element's tolerance around the loop's: the step's (tests/step_tolerance.py), or
    after the epilogue what the norm makes of the step's."""
    if case.epilogue == "none":
        return tolerance(exp.out, exp.mags.out)
    z = _flat(before.t["z"], 2 if before.t["q"].dim() == 4 else 1)
    eps = 1e-5 if case.eps is None else case.eps
    return epilogue_tolerance(exp.out, exp.o, tolerance(exp.o, exp.mags.out), z, before.t["w"], eps, case.epilogue)


def state_tol(exp: Expected, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored states the loop expects at `slots` and their tolerances, on the magnitudes' device."""
    mags = torch.stack([exp.mags.state[s] for s in slots])
    expected = exp.state[slots].to(mags.device)
    return expected, tolerance(expected, mags)


def check(case: Case, step: Step, before: Snapshot, out: torch.Tensor) -> Expected:
    """The call that went from `before` to `step`'s pool with output `out`, against the float64 loop:
    the output of v's shape and dtype (into out= when given), each element within its own tolerance,
    exactly 0 for the tokens of requests without a starting slot and tokens after cu_seqlens[N];
    each stored state within its own tolerance; every other byte of the pool's allocation (other
    slots, named slots that must not be written, vLLM's conv states and padding) bit-identical."""
    exp = expect(case, before)
    v = step.t["v"]
    assert out.shape == v.shape and out.dtype == v.dtype, f"output {out.dtype} {tuple(out.shape)}, v {v.dtype} " \
        f"{tuple(v.shape)}"
    if step.out is not None:
        assert out is step.out, "the call did not return the out= buffer"
    o = out.detach().cpu().reshape(exp.out.shape)
    unwritten = o.isnan().flatten(1).any(1).nonzero().squeeze(1).tolist()
    assert not unwritten, f"output elements never written (NaN) at tokens {unwritten}"
    zero = exp.zero.nonzero().squeeze(1).tolist()
    nonzero = [r for r in zero if bool((o[r] != 0).any())]
    assert not nonzero, f"tokens {nonzero} have no starting slot (or no request) but a non-zero output"
    if case.epilogue == "none":
        assert_within(o, exp.out, output_tol(case, exp, before), "output", exp.mags.out)
    else:
        assert_within(o, exp.out, output_tol(case, exp, before), f"output after the {case.epilogue} epilogue")
    check_pool(step, before, exp)
    return exp


def check_pool(step: Step, before: Snapshot, exp: Expected) -> None:
    """check's pool half: each state the call stored within its own tolerance of the float64 loop's
    (exp), every other byte of the pool's allocation as it was `before`."""
    slots = sorted(exp.mags.state)
    if slots:
        expected, tol = state_tol(exp, slots)
        assert_within(step.state[slots].detach(), expected, tol, "state stored", rows=slots)
    keep = ~written_mask(step, slots)
    changed = (step.storage != before.storage) & keep
    assert not bool(changed.any()), _changed_bytes(step, changed)


def _changed_bytes(step: Step, changed: torch.Tensor) -> str:
    """Names the first changed bytes: each one's slot (its page) and whether it lies in the slot's
    state block or around it (vLLM's conv state and padding)."""
    where = []
    for b in changed.nonzero().squeeze(1)[:8].tolist():
        slot, within = divmod(b, step.slot_bytes)
        part = "state block" if step.base <= within < step.base + step.block_bytes else "conv state or padding"
        where.append(f"byte {b} (slot {slot}'s {part})")
    return f"{int(changed.sum())} bytes changed that the call must not write: " + ", ".join(where)


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_and_check(case: Case, device) -> Expected:
    step = build(case, device)
    before = snapshot(step)
    out = call(case, step)
    synchronize(device)
    return check(case, step, before, out)


def check_fused_epilogue(case: Case, device) -> None:
    """The epilogue's output against the reference's epilogue (cudelta.reference.gated_rms_norm) of
    the same call's output without it, on the same pool: the fused norm normalises the output
    rounded to its dtype, as the unfused path does; besides, the fused call is checked as every
    call is. The two calls' outputs before the norm may differ by each one's tolerance (two fp32
    computations), so each element may move by what that does to the norm."""
    assert case.epilogue != "none"
    plain = replace(case, epilogue="none")
    fused, unfused = build(case, device), build(plain, device)  # the same values: z and w are drawn either way
    before = snapshot(fused)
    y, o = call(case, fused), call(plain, unfused)
    synchronize(device)
    exp = check(case, fused, before, y)
    o = o.detach().cpu().reshape(exp.o.shape)
    z = _flat(before.t["z"], 2 if before.t["q"].dim() == 4 else 1)
    eps = 1e-5 if case.eps is None else case.eps
    by_reference = gated_rms_norm(o, z, before.t["w"], eps, case.epilogue)
    tol = epilogue_tolerance(by_reference, o, 2 * tolerance(o, exp.mags.out), z, before.t["w"], eps, case.epilogue)
    assert_within(y.detach().cpu().reshape(o.shape), by_reference, tol,
                  "fused epilogue against the reference's epilogue of the unfused output")


def compare(case: Case, a: Step, out_a: torch.Tensor, b: Step, out_b: torch.Tensor, before: Snapshot) -> None:
    """Two runs of the same call from the same pool (e.g. on CUDA and on the CPU): outputs and stored
    states within twice each element's tolerance of each other (each run may be its tolerance away
    from the exact result, on either side), every other byte of both allocations as it was."""
    exp = expect(case, before)
    oa, ob = out_a.detach().cpu().reshape(exp.out.shape), out_b.detach().cpu().reshape(exp.out.shape)
    assert_within(oa, ob, 2 * output_tol(case, exp, before), "output, one run against the other")
    slots = sorted(exp.mags.state)
    if slots:
        _, tol = state_tol(exp, slots)
        assert_within(a.state[slots].to(tol.device), b.state[slots].to(tol.device), 2 * tol,
                      "state stored, one run against the other", rows=slots)
    for step in (a, b):
        keep = ~written_mask(step, slots)
        changed = (step.storage != before.storage.to(step.storage.device)) & keep
        assert not bool(changed.any()), _changed_bytes(step, changed)


def pairwise(factors: dict[str, tuple]) -> list[dict]:
    """Rows that hold every pair of values of every two factors at least once (greedy, deterministic):
    each row starts from the first pair not yet covered, then takes for each other factor the value
    that covers the most new pairs with the values already chosen (the earlier value on a tie)."""
    names = sorted(factors, key=lambda n: -len(factors[n]))  # the widest factors first
    order = {n: i for i, n in enumerate(names)}

    def pair(a, x, b, y):
        return (a, x, b, y) if order[a] < order[b] else (b, y, a, x)

    seen = {pair(a, x, b, y): 0 for a, b in itertools.combinations(names, 2) for x in factors[a] for y in factors[b]}
    rows = []
    while min(seen.values()) == 0:
        a, x, b, y = min((p for p, times in seen.items() if not times),
                         key=lambda p: (order[p[0]], factors[p[0]].index(p[1]), order[p[2]], factors[p[2]].index(p[3])))
        row = {a: x, b: y}
        for n in names:
            if n not in row:  # most new pairs; on a tie the pairs seen least so far (spread), then the earlier value
                row[n] = max(factors[n], key=lambda val: (sum(not seen[pair(m, row[m], n, val)] for m in row),
                                                          -sum(seen[pair(m, row[m], n, val)] for m in row),
                                                          -factors[n].index(val)))
        for m, n in itertools.combinations(row, 2):
            seen[pair(m, row[m], n, row[n])] += 1
        rows.append({n: row[n] for n in factors})
    return rows


# Every option of the call, each value paired with every value of every other option at least once.
FACTORS = {
    "tokens": TOKEN_FORMS,
    "slots": ("final", "ckpt", "accepted"),
    "epilogue": ("none", "silu", "sigmoid"),
    "group": (1, 2, 4),
    "io": ("bf16", "fp16", "fp32"),
    "kind": ("gdn", "kda"),
    "layout": ("kv", "vk"),
    "state": ("fp32", "bf16"),
    "gates": ("pre", "raw"),
    "rule": ("negative", "nonpositive"),
    "pool": ("contiguous", "pages"),
    "out": ("buffer", "new"),
    "columns": ("T", "T+1"),
    "l2norm": (True, False),
    "index": ("int32", "int64"),
}
MATRIX = [Case(**row, seed=100 + i) for i, row in enumerate(pairwise(FACTORS))]

# The other head dims, on fewer cases: each on both layouts and state dtypes, vLLM's full call
# otherwise (flat tokens, checkpoints, accepted tokens), GDN and KDA, gate forms, rules, epilogues
# and pools in turn; and K != V twice.
HEAD_DIMS = [
    Case(K=K, V=V, layout=layout, state=state, kind=kind, gates=gates, rule=rule, epilogue=act, pool=pool,
         seed=200 + i)
    for i, (K, V, layout, state, kind, gates, rule, act, pool) in enumerate([
        (64, 64, "kv", "fp32", "gdn", "raw", "nonpositive", "silu", "contiguous"),
        (64, 64, "vk", "bf16", "kda", "pre", "negative", "sigmoid", "pages"),
        (64, 64, "kv", "bf16", "kda", "raw", "negative", "none", "pages"),
        (64, 64, "vk", "fp32", "gdn", "pre", "nonpositive", "sigmoid", "contiguous"),
        (256, 256, "kv", "fp32", "kda", "pre", "nonpositive", "sigmoid", "pages"),
        (256, 256, "vk", "bf16", "gdn", "raw", "negative", "silu", "contiguous"),
        (256, 256, "kv", "bf16", "gdn", "pre", "nonpositive", "none", "contiguous"),
        (256, 256, "vk", "fp32", "kda", "raw", "negative", "silu", "pages"),
        (64, 256, "vk", "bf16", "gdn", "raw", "nonpositive", "silu", "pages"),
        (256, 128, "kv", "fp32", "kda", "pre", "negative", "sigmoid", "contiguous"),
    ])
]

# Engine batches, vLLM's MTP call (flat or dense tokens, checkpoints, accepted tokens, the epilogue,
# its pages) at Qwen3-Next's heads (H=16, HV=32), its TP=4 split (4/8) and HV=64, from one request
# to 128: whatever launch shapes the kernels pick by batch, heads and T, each is reached by some.
ENGINE = [
    Case(H=16, N=1, tokens="T8", seed=300),
    Case(H=16, N=8, tokens="varlen", state="fp32", seed=301),
    Case(H=16, N=40, tokens="T2", layout="kv", kind="kda", epilogue="sigmoid", seed=302),
    Case(H=16, N=128, tokens="T2", seed=303),
    Case(H=4, N=128, tokens="T4", state="fp32", epilogue="none", seed=304),
    Case(H=16, group=4, N=24, tokens="T4", seed=305),
]

# vLLM's MTP call as its GDN layer makes it, at T = 1, 2, 4, 8, T varying per request and up to 9 (vLLM 0.34),
# with both state dtypes.
VLLM_CALLS = [Case(tokens=tokens, state=state, seed=400 + i) for i, (tokens, state) in enumerate(
    [("single", "bf16"), ("T2", "fp32"), ("T4", "bf16"), ("T8", "fp32"), ("varlen", "bf16"), ("varlen", "fp32"),
     ("varlen9", "bf16")])]

# The epilogue's FP8 output (output_scale), rounded in each kernel's final store (store_out): one
# token at a small grid (the one-warp grid's clusters) and a large one (the block kernel), vLLM's MTP
# call (flat tokens, checkpoints, accepted tokens, its pages: the streaming kernel), the few-token
# kernel's form (which FP8 calls leave to the streaming kernel), the kv layout (the resident kernel),
# KDA, fp32 state, fp16 io and K = V = 64.
FP8_OUTPUT = [
    Case(tokens="single", slots="final", pool="contiguous", N=1, H=16, seed=900),
    Case(tokens="single", slots="final", pool="contiguous", N=64, H=16, state="fp32", seed=901),
    Case(seed=902),
    Case(tokens="varlen2", epilogue="sigmoid", seed=903),
    Case(tokens="T4", slots="ckpt", layout="kv", state="fp32", pool="contiguous", seed=904),
    Case(kind="kda", tokens="T3", io="fp16", seed=905),
    Case(K=64, V=64, seed=906),
]


# The few-token kernel's FP8 builds (decode_vk_few_kernel's F8, kernels/mtp_few.cuh), as shares of
# the GPU's SMs filled with (request, value head) pairs (sized_for): vLLM's call with one draft token
# in clusters of 4 and of 2 (sm_90+ images; elsewhere one block a pair), one block a pair of 8-row
# warps (bf16, 0.9 of the SMs) and of 16 (1.9), and fp32 state's three tokens.
FP8_FEW_TOKEN = [(0.25, Case(H=16, tokens="T2", seed=960)),
                 (0.5, Case(H=16, tokens="T2", epilogue="sigmoid", seed=961)),
                 (0.25, Case(H=16, tokens="T2", state="fp32", seed=962)),
                 (0.9, Case(H=16, tokens="T2", seed=963)),
                 (1.9, Case(H=16, tokens="varlen2", state="fp32", index="int64", seed=964)),
                 (1.9, Case(H=16, tokens="T3", state="fp32", slots="ckpt", seed=965))]


def sized_for(share: float, case: Case, sms: int) -> Case:
    """The case with as many requests as fill `share` of `sms` SMs with (request, value head) pairs."""
    return replace(case, N=max(1, int(share * sms / (case.H * case.group))))


def kernels_launched(fn) -> list[str]:
    """The names of the decode kernels that `fn()` launches, as the CUDA profiler records them
    (the template arguments name the build)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA" and "decode" in e.name]


def fp8_call(case: Case, t: dict, state: torch.Tensor, scale: torch.Tensor, out: Optional[torch.Tensor]):
    """The case's public call with the FP8 output (output_scale), writing out= when given."""
    args, kw = call_args(case, t, out)
    fn = cudelta.kda_decode if case.kind == "kda" else cudelta.gdn_decode
    return fn(*args, state, t["idx"], output_scale=scale, **kw)


def run_fp8_pair(case: Case, device, scale: float, out: bool):
    """The case run twice from the same inputs and pool, without and with output_scale (into a
    NaN-filled out= buffer when `out`): (the unscaled step, its snapshot before, its output, the
    scaled step, its FP8 output, the scale tensor)."""
    plain, fp8 = build(case, device), build(case, device)
    before = snapshot(plain)
    o = call(case, plain)
    s = torch.tensor([scale], device=device)
    buffer = torch.full(o.shape, float("nan"), device=device).to(torch.float8_e4m3fn) if out else None
    q8 = fp8_call(case, fp8.t, fp8.state, s, buffer)
    assert buffer is None or q8 is buffer
    return plain, before, o, fp8, q8, s


def check_fp8_output(case: Case, device) -> None:
    """run_fp8_pair at a scale of 0.02: the unscaled call checked against the float64 loop (check),
    the FP8 output written into out= and, byte for byte, static_fp8 of the unscaled output, the
    pool's whole allocation written alike (both calls take the same kernel: each kernel that makes
    the epilogue has an FP8 store)."""
    plain, before, o, fp8, q8, scale = run_fp8_pair(case, device, 0.02, out=True)
    check(case, plain, before, o)
    assert q8.dtype == torch.float8_e4m3fn
    assert torch.equal(q8.view(torch.uint8), static_fp8(o, scale).view(torch.uint8))
    assert torch.equal(fp8.storage, plain.storage)
    assert q8.float().abs().max() > 0  # not a call whose rows were all skipped


# 1 / scale in the kernels against torch's reciprocal: scales across the float range, subnormal and
# near its top, ordinary ones, 0 and infinity.
FP8_SCALES = [2.0 ** -149, 1e-40, 2.0 ** -126, 1e-3, 0.02, 1 / 3, 1.0, 7.0, 2.0 ** 125, 2.0 ** 126, 3e38, 0.0,
              float("inf")]


def check_fp8_scale(scale: float, device) -> None:
    """vLLM's call with the FP8 output at `scale`: byte for byte static_fp8 of the unscaled call."""
    _, _, o, _, q8, s = run_fp8_pair(Case(seed=940), device, scale, out=False)
    assert torch.equal(q8.view(torch.uint8), static_fp8(o, s).view(torch.uint8))
