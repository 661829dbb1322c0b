"""Kimi K3's fused KDA decode step (conv, gates, delta rule, gated RMSNorm in one call), as vLLM's
Kimi K3 layer runs it: cudelta's drop-in beside vLLM 0.33's CUDA op, with a device copy of the same
bytes as the yardstick.

    python benchmarks/fetch_vllm_ops.py --cache /tmp/vllm-wheel   # once, where PyPI is reachable
    # on the GPU machine (carry [".peers/cuda_op"]), cudelta built there:
    python -P benchmarks/kda_bench.py --out $OUT/kda.md                  # H 12 48, B 1 4 8 32 128 512
    python -P benchmarks/kda_bench.py --heads 12 24 48 96 --out $OUT/kda-all.md
    #   [--batches ...] [--procs 3] [--back-to-back] [--cuda-op vllm_C_stable.so.xz] [--conv-layout DS]

Shapes: H heads (q, k and v heads all H) in 12, 24, 48, 96 (Kimi K3 at tensor-parallel 8, 4, 2, 1),
head dim 128, conv width 4, one token per request, B requests; gate lower bound -5, norm eps 1e-5.
One table per H, rows B: cudelta µs, vLLM CUDA µs, vLLM ÷ cudelta, % of copy of each; under it
"never slower than vLLM's CUDA op" read off the medians, the checks, what was not timed and the
spread across processes. The tables go to --out too, the per-process numbers to --out's .json.

Implementations (the same call, the same tensors, positionally in vLLM's order):
- cudelta: cudelta.vllm_compat.fused_kda_decode (the signature of vLLM's wrapper
  vllm._custom_ops.fused_kda_decode). An import failure, or a missing native library on a GPU run,
  is a skip line, not a crash.
- vLLM CUDA: torch.ops._C.fused_kda_decode from vLLM's wheel (.peers/cuda_op/*.so.xz, decompressed
  with lzma into a temporary folder, torch.ops.load_library; mtp_bench's unpack_cuda_op).
- reference (checks only): cudelta.vllm_compat.fused_kda_decode_reference, the same signature,
  cudelta's PyTorch reference (fp32 math) on the tensors' device.

Method (mtp_bench's: no L2 hits on the state, no overlap of a call with itself that an engine
would not see, no number without a check):
- The pool is vLLM's: one int8 page per slot holding the conv state ([3 (state_len), 3*H*128 (dim)]
  bf16, vLLM's default "SD" layout, handed to the op as its transposed view [slots, dim, 3], strides
  (page elements, 1, dim)), then the recurrent state [H, 128 (V), 128 (K)] fp32, the page padded to a
  multiple of 32 KiB; both are strided views into the pages. Slot 0 is the null block: never named.
- Inputs as the layer holds them: x a view of a wider bf16 projection row [B, 3*H*128 | H*128 | ...]
  (row stride free), output_gate [B, H, 128] from the same row; raw_beta a strided view of a [B, 2H]
  tensor; raw_g, out contiguous; the same tensors every call.
- State from DRAM: each call of the graph takes the next of `sets` disjoint sets of B slots, the sets'
  pages covering >= 256 MiB together (L2 is 50 MB), the graph holding max(50, sets) calls.
- Before timing, each implementation runs the cell's step on its own copy of a check pool (the B
  slots, the null block and 8 spare slots, random bytes, finite conv and recurrent states) and is
  compared with the reference run on another copy: the outputs (1/64 relative + 1/128 of the
  largest), every slot's recurrent state (1/128 relative + 1/128 of the largest: the conv's outputs
  reach the step in bf16, and a bf16 ulp of q, k or v moves both by about 2^-8; TOL_STATE), the written
  slots' conv states byte for byte (the window holds copies of bf16 inputs: exact), and every byte
  not written (null block, spare slots, page padding) bit-identical. Its largest differences are
  printed; one that disagrees is still timed, marked ✗, and counts as a miss.
- Time: a CUDA graph of the calls, best of 5 replays (kernel_bench.graph_us via mtp_bench.time_call;
  eager launches where capture fails, marked ᵉ). After each call a one-element kernel, its own time
  subtracted, so that no call overlaps the one before it through programmatic dependent launch, as
  none can in a model (--back-to-back: without it). The script re-runs itself in --procs processes
  (3): per-cell medians, and the spread (max - min) / median.
- Copy: "% of copy" is the bytes the step must move (request_bytes) ÷ its time, as a share of the
  bandwidth of a 256 MiB device-to-device copy measured once a process. A copy moving each cell's own
  bytes (copying half of them, mtp_bench.copy_us) is timed too and kept in the .json: at 10-100 MB a
  single copy kernel reached only 2.0-3.1 TB/s on an H200 against 4.25 at 256 MiB, so as a
  yardstick it put steps at 102-135% there. Per request: the recurrent
  state read and written (2 * H*128*128*4), the conv window read and written (2 * 3 * 3*H*128 * 2:
  the op reads the 3 old columns and writes 3 shifted ones), the x row (3*H*128*2), raw_g (H*128*2),
  raw_beta (H*2), output_gate (H*128*2) and out (H*128*2). The weights (conv weight, A_log, dt_bias,
  norm weight) are read once per call for all requests and are not counted.

vLLM's op, as 0.33.0's wheel defines and calls it (vllm/_custom_ops.py, the library's check
messages, vllm/models/kimi_k3/nvidia/kda.py; 0.34.0's wrapper, call and kernel instantiations are
the same):
- torch.ops._C.fused_kda_decode(Tensor x, Tensor weight, Tensor? bias, Tensor! conv_state,
  Tensor raw_g, Tensor raw_beta, Tensor A_log, Tensor dt_bias, Tensor state_indices, Tensor! state,
  Tensor! out, float? lower_bound=None, Tensor? output_gate=None, Tensor? norm_weight=None,
  float norm_eps=1e-5) -> (); registered by vllm/_C_stable_libtorch.abi3.so for CUDA. vLLM's wrapper
  allocates out [1, B, H, 128] (x's dtype) when None and returns it. The layer takes it
  (is_fused_kda_decode_supported) for H in (12, 24, 48, 96), head dim 128, conv width 4, no
  speculative tokens, bf16 inputs and conv state, fp32 recurrent state, on SM90/SM10x/SM12x, for
  batches of decodes only (no prefill in the batch).
- x [B, 3*H*128] bf16: q, k, v projections side by side before the conv, channels contiguous, the
  row stride free. weight [3, 4, H*128] fp32 contiguous (decode_conv1d_weight: per q/k/v, tap-major;
  weight[s, t, c] is conv1d.weight[s*H*128 + c, t]); bias None for Kimi (or fp32 [3*H*128]).
  conv_state [slots, 3*H*128, 3] bf16 (SD or DS layout, strides read at launch): the window before
  this token, oldest first; the op convolves [window, x] with SiLU and shifts x into the window.
- raw_g [1, B, H, 128] bf16 contiguous, raw_beta [1, B, H] bf16 (heads contiguous), A_log [H] fp32,
  dt_bias [H*128] fp32: per key channel decay exp(lower_bound * sigmoid(exp(A_log) * (raw_g +
  dt_bias))), lower_bound in [-5, 0) (the layer asserts _KDA_GATE_LOGBOUND_MIN <= lb < 0), beta
  sigmoid(raw_beta). q and k L2-normalised in the kernel, q scaled by 128^-0.5.
- state_indices [B] int32 contiguous: request n's conv state and recurrent state are slot
  state_indices[n] of both; a slot <= 0 is skipped (0 is vLLM's null block).
- state [slots, H, 128 (V), 128 (K)] fp32, each slot's [H, V, K] contiguous, the slot stride free.
- output_gate [B, H, 128] bf16 (head rows contiguous, row stride free), norm_weight [128] fp32, out
  [1, B, H, 128] bf16 contiguous: o rounded to bf16 * rsqrt(mean(o^2) + norm_eps) * norm_weight *
  sigmoid(output_gate).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections import namedtuple
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # mtp_bench, mtp_report, kernel_bench (also under `python -P`)

import mtp_bench as mb  # noqa: E402  (DEVICE, DRAM_BYTES, time_call, copy_us, excess, the cuda op's unpacking)
import mtp_report as report  # noqa: E402

D = 128  # head dim (q, k, v all D)
WIDTH = 4  # conv width: the window keeps WIDTH - 1 columns
HEADS = (12, 24, 48, 96)  # what vLLM's op accepts
DEFAULT_HEADS = [12, 48]
BATCHES = [1, 4, 8, 32, 128, 512]
LOWER_BOUND = -5.0  # Kimi's gate_lower_bound
NORM_EPS = 1e-5  # Kimi's o_norm eps
ROW_TAIL = 128  # elements of the projection row past x and the output gate: a row stride that is not 4*H*128
CUDELTA, VLLM_CUDA, COPY = report.CUDELTA, report.VLLM_CUDA, report.COPY
IMPLS = (CUDELTA, VLLM_CUDA)
NAMES = {CUDELTA: "cudelta", VLLM_CUDA: "vLLM CUDA"}
# The chain rounds the conv's outputs to bf16 before the step (cudelta and its reference; vLLM's fused op
# may keep them in fp32): a bf16 ulp of q, k or v moves the state and the normalised output by about
# 2^-8 of their scale, far past fp32's 1e-4 (measured on an H200: up to 0.006 of states of magnitude ~1
# between cudelta and its reference, 0.011 to vLLM's; outputs 1-2 bf16 ulps). (rtol, fraction of the
# largest |expected|): a wrong gate, norm or slot is off by its whole scale.
TOL_STATE = (1 / 128, 1 / 128)
TOL_OUT = (1 / 64, 1 / 128)

Pool = namedtuple("Pool", "pages conv state")  # the int8 pages and the op's two views into them


def head_key(H: int) -> str:
    """The "state" field of a measurement (mtp_report's key): here the head count."""
    return f"H={H}"


def request_bytes(H: int) -> int:
    """Bytes one request's step must move (see the docstring's Copy)."""
    dim = 3 * H * D
    return (2 * H * D * D * 4  # recurrent state read + written
            + 2 * (WIDTH - 1) * dim * 2  # conv window read + written
            + dim * 2  # x
            + H * D * 2 + H * 2  # raw_g, raw_beta
            + H * D * 2 + H * D * 2)  # output_gate, out


# ---------------------------------------------------------------- tables (pure: data in, text out)


def _us(m: report.Merged, k) -> str:
    if k not in m.median:
        return "—"
    v = m.median[k]
    text = f"{v:.1f}" if v < 100 else f"{v:.0f}"
    if m.modes.get(k) == "eager":  # ("cpu": the dry run's clock)
        text += "ᵉ"
    c = m.checks.get(k)
    return text + (" ✗" if c is not None and not c["ok"] else "")


def ratio(m: report.Merged, H: int, B: int) -> float | None:
    """vLLM's median ÷ cudelta's: above 1, cudelta is faster."""
    v, c = m.median.get((head_key(H), B, 1, VLLM_CUDA)), m.median.get((head_key(H), B, 1, CUDELTA))
    return v / c if v and c else None


def pct(m: report.Merged, H: int, B: int, impl: str) -> str:
    """The step's bytes ÷ its time, as a share of the copy's bandwidth at 256 MiB (m.copy_GBps). Not
    of a copy of the cell's own bytes: a single copy kernel of 10-100 MB measured only 2.0-3.1 TB/s on
    an H200 against 4.25 at 256 MiB, and steps beat it there."""
    us = m.median.get((head_key(H), B, 1, impl))
    if not us or not math.isfinite(m.copy_GBps) or m.copy_GBps <= 0:
        return "—"
    return f"{100.0 * request_bytes(H) * B / (us * m.copy_GBps * 1e3):.0f}%"


def table(m: report.Merged, H: int, batches: list[int]) -> list[str]:
    lines = [f"**H={H}** ({3 * H * D} conv channels, {request_bytes(H) / 1e6:.2f} MB moved per request)", "",
             "| B | cudelta µs | vLLM CUDA µs | vLLM ÷ cudelta | cudelta % of copy | vLLM % of copy |",
             "|---|---|---|---|---|---|"]
    for B in batches:
        r = ratio(m, H, B)
        lines.append(f"| {B} | {_us(m, (head_key(H), B, 1, CUDELTA))} | {_us(m, (head_key(H), B, 1, VLLM_CUDA))} | "
                     f"{'—' if r is None else f'{r:.2f}x'} | {pct(m, H, B, CUDELTA)} | {pct(m, H, B, VLLM_CUDA)} |")
    return lines


def target_line(m: report.Merged, H: int, batches: list[int]) -> str:
    """"never slower than vLLM's CUDA op": vLLM ÷ cudelta >= 1 with cudelta's check passed, over the
    cells where both were timed; the misses listed with their ratios."""
    cells = [(B, r) for B in batches if (r := ratio(m, H, B)) is not None]
    if not cells:
        return "- never slower than vLLM's CUDA op: not measured (no cell has both timed)"

    def wrong(B):
        c = m.checks.get((head_key(H), B, 1, CUDELTA))
        return c is not None and not c["ok"]

    misses = [(B, r) for B, r in cells if r < 1 or wrong(B)]
    line = f"- never slower than vLLM's CUDA op: met in {len(cells) - len(misses)} of {len(cells)} cells"
    if misses:
        line += "; missed at " + ", ".join(f"B={B} {r:.2f}x{' ✗' if wrong(B) else ''}" for B, r in misses)
    return line


def check_lines(m: report.Merged, H: int) -> list[str]:
    lines = []
    for impl in IMPLS:
        cs = {k: c for k, c in m.checks.items() if k[0] == head_key(H) and k[3] == impl}
        if not cs:
            continue
        bad = {k: c for k, c in cs.items() if not c["ok"]}
        out = max(c.get("out_max_abs", 0.0) for c in cs.values())
        st = max(c.get("state_max_abs", 0.0) for c in cs.values())
        conv = max(c.get("conv_max_abs", 0.0) for c in cs.values())
        line = (f"- {NAMES[impl]}: agrees in {len(cs) - len(bad)}/{len(cs)} cells; largest |Δ out| {out:.2e}, "
                f"|Δ state| {st:.2e}, |Δ conv state| {conv:.2e}")
        if bad:
            line += "; **DISAGREES** at " + "; ".join(f"B={k[1]}: {c.get('detail', '')}"
                                                       for k, c in sorted(bad.items(), key=lambda kc: kc[0][1]))
        lines.append(line)
    return lines


def skip_lines(m: report.Merged, H: int, batches: list[int]) -> list[str]:
    """One line per (implementation, reason), with the cells (or "every cell")."""
    groups: dict[tuple[str, str], list[int]] = {}
    for k, reason in m.skips.items():
        if k[0] == head_key(H):
            groups.setdefault((k[3], reason), []).append(k[1])
    lines = []
    for (impl, reason), bs in sorted(groups.items()):
        where = "every cell" if set(bs) >= set(batches) else "B=" + ", ".join(map(str, sorted(bs)))
        lines.append(f"- {NAMES.get(impl, impl)} not timed in {where}: {reason}")
    return lines


def spread_line(m: report.Merged, H: int) -> str:
    spreads = {k: v for k, v in m.spread.items() if k[0] == head_key(H)}
    if not spreads:
        return "- spread across processes: nothing timed"
    worst = max(spreads, key=spreads.get)
    runs = [m.runs[k] for k in spreads]
    lo, hi = min(runs), max(runs)
    typical = statistics.median(spreads.values())
    return (f"- spread across processes, (max - min) / median: median {100 * typical:.1f}%, "
            f"largest {100 * spreads[worst]:.1f}% ({NAMES.get(worst[3], worst[3])} B={worst[1]}); each value the "
            f"median of {lo if lo == hi else f'{lo} to {hi}'} of {m.procs} processes")


def render(m: report.Merged, heads: list[int], batches: list[int], method: str, notes: list[str] = ()) -> str:
    parts = [f"Kimi K3 fused KDA decode step (head dim {D}, conv width {WIDTH}, T=1, lower bound {LOWER_BOUND}, "
             f"gated RMSNorm epilogue, vLLM's padded pool); {m.device}; copy {m.copy_GBps:.0f} GB/s; median of "
             f"{m.procs} processes", "", method, "",
             "— not timed (see below); ✗ disagrees with the reference; ᵉ eager launches (graph capture failed). "
             "vLLM ÷ cudelta above 1: cudelta faster. % of copy: the step's bytes ÷ its time, as a share of the "
             f"bandwidth of a {report.COPY_CAP_BYTES >> 20} MiB device copy ({m.copy_GBps:.0f} GB/s)."]
    for H in heads:
        parts += ["", *table(m, H, batches), "", target_line(m, H, batches), *check_lines(m, H),
                  *skip_lines(m, H, batches), spread_line(m, H)]
    return "\n".join(parts + ["", *notes]).rstrip() + "\n"


# ---------------------------------------------------------------- a worker: one process on the GPU


class Cell:
    """One (H, B): the step's inputs as vLLM's Kimi K3 layer holds them, and its pool's layout."""

    def __init__(self, H: int, B: int, seed: int, conv_layout: str = "SD"):
        import torch

        self.torch, self.H, self.B, self.conv_layout = torch, H, B, conv_layout
        dev, bf16 = mb.DEVICE, torch.bfloat16
        self.dim = 3 * H * D
        self.conv_bytes = (WIDTH - 1) * self.dim * 2
        self.block = H * D * D * 4
        self.page = -(-(self.conv_bytes + self.block) // mb.PAGE_ALIGN) * mb.PAGE_ALIGN
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        # The projection row: x (before the conv) and the output gate are views of it.
        row = torch.randn(B, self.dim + H * D + ROW_TAIL, device=dev, dtype=bf16, generator=self.gen)
        self.x = row[:, :self.dim]
        self.z = row[:, self.dim:self.dim + H * D].unflatten(1, (H, D))
        self.weight = 0.5 * torch.randn(3, WIDTH, H * D, device=dev, generator=self.gen)
        self.raw_g = torch.randn(1, B, H, D, device=dev, dtype=bf16, generator=self.gen)
        gb = torch.randn(B, 2 * H, device=dev, dtype=bf16, generator=self.gen)
        self.raw_beta = gb[:, :H].unsqueeze(0)  # heads contiguous, rows 2H apart
        self.A_log = torch.randn(H, device=dev, generator=self.gen) * 0.5
        self.dt_bias = torch.randn(H * D, device=dev, generator=self.gen)
        self.norm_weight = 1 + 0.1 * torch.randn(D, device=dev, generator=self.gen)
        self.out = torch.empty(1, B, H, D, device=dev, dtype=bf16)
        self.moved = B * request_bytes(H)
        self.sets = max(2, math.ceil(mb.DRAM_BYTES / (B * self.page)))

    def views(self, pages) -> Pool:
        """The op's conv_state [slots, dim, 3] (SD: the transposed view of each page's [3, dim]; DS:
        the page's [dim, 3] itself) and state [slots, H, V, K] over the pages."""
        torch, n = self.torch, pages.shape[0]
        conv = pages[:, :self.conv_bytes].view(torch.bfloat16)
        conv = (conv.view(n, WIDTH - 1, self.dim).transpose(1, 2) if self.conv_layout == "SD"
                else conv.view(n, self.dim, WIDTH - 1))
        state = pages[:, self.conv_bytes:self.conv_bytes + self.block].view(torch.float32).view(n, self.H, D, D)
        return Pool(pages, conv, state)

    def pool(self, slots: int, random_bytes: bool) -> Pool:
        """vLLM's pages, finite conv and recurrent states (random bytes would hold NaNs), the rest
        random where random_bytes (the check pool: padding and null block must come back as they were)."""
        pages = self.torch.empty(slots, self.page, device=mb.DEVICE, dtype=self.torch.int8)
        if random_bytes:
            pages.random_(-128, 128, generator=self.gen)
        p = self.views(pages)
        p.conv.normal_(0.0, 1.0, generator=self.gen)
        p.state.normal_(0.0, 0.1, generator=self.gen)
        return p

    def slot_sets(self, sets: int):
        """sets index tensors [B] int32 over slots 1..sets*B (no slot twice, never the null block)."""
        torch = self.torch
        perm = torch.randperm(sets * self.B, device=mb.DEVICE, generator=self.gen).to(torch.int32) + 1
        return [perm[i * self.B:(i + 1) * self.B].contiguous() for i in range(sets)]

    def call(self, fn):
        """fn(...) in vLLM's argument order, positionally (the op and the drop-in alike): call(pool, idx)."""
        return lambda p, idx: fn(self.x, self.weight, None, p.conv, self.raw_g, self.raw_beta, self.A_log,
                                 self.dt_bias, idx, p.state, self.out, LOWER_BOUND, self.z, self.norm_weight, NORM_EPS)


def compare(cell: Cell, p: Pool, ref: Pool, base, written) -> tuple[float, float, float, list[str]]:
    """(max |Δ state|, its worst ratio, max |Δ conv state|, problems) of pool p against the
    reference's, every slot's state in chunks; bytes not written against base."""
    torch = cell.torch
    st_abs = st_ratio = 0.0
    for s in range(0, p.state.shape[0], 64):
        d, r = mb.excess(p.state[s:s + 64], ref.state[s:s + 64], TOL_STATE)
        st_abs, st_ratio = max(st_abs, d), max(st_ratio, r)
    is_written = torch.zeros(p.pages.shape[0], dtype=torch.bool, device=mb.DEVICE)
    is_written[written] = True
    problems = []
    if st_ratio > 1:
        problems.append(f"state max |Δ| {st_abs:.3g} ({st_ratio:.3g}x its tolerance)")
    conv, ref_conv = p.conv[is_written].float(), ref.conv[is_written].float()
    conv_abs = float((conv - ref_conv).abs().nan_to_num(math.inf).max()) if conv.numel() else 0.0
    if not torch.equal(p.pages[is_written, :cell.conv_bytes], ref.pages[is_written, :cell.conv_bytes]):
        problems.append(f"a written conv state differs from the reference's (max |Δ| {conv_abs:.3g})")
    if not torch.equal(p.pages[~is_written], base[~is_written]):
        problems.append("a slot no call names (null block or spare) changed")
    end = cell.conv_bytes + cell.block
    if not torch.equal(p.pages[is_written, end:], base[is_written, end:]):
        problems.append("a padding byte of a written page changed")
    return st_abs, st_ratio, conv_abs, problems


def check(cell: Cell, impl: str, call, base, ref: Pool, ref_out, idx) -> dict:
    """impl's step on its own copy of the check pool against the reference's."""
    p = cell.views(base.clone())
    cell.out.fill_(float("nan"))
    call(p, idx)
    mb.sync()
    out_abs, out_ratio = mb.excess(cell.out, ref_out, TOL_OUT)
    st_abs, _, conv_abs, problems = compare(cell, p, ref, base, idx.long())
    if out_ratio > 1:
        problems.insert(0, f"out max |Δ| {out_abs:.3g} ({out_ratio:.3g}x its tolerance)")
    return dict(state=head_key(cell.H), B=cell.B, T=1, impl=impl, ok=not problems, out_max_abs=out_abs,
                state_max_abs=st_abs, conv_max_abs=conv_abs, detail="; ".join(problems))


def check_cell(cell: Cell, calls: dict, reference, skip, result: dict) -> dict:
    """Each implementation against the reference on a pool of the cell's slots, the null block and
    spare slots (freed on return); returns those whose check ran, to be timed."""
    base = cell.pool(1 + cell.B + mb.SPARE_SLOTS, random_bytes=True).pages
    idx = cell.slot_sets(1)[0]
    if reference is None:
        for name in calls:
            skip(name, "no reference to check against (cudelta.vllm_compat.fused_kda_decode_reference)")
        return {}
    ref = cell.views(base.clone())
    cell.call(reference)(ref, idx)
    ref_out = cell.out.clone()
    checked = {}
    for name, call in calls.items():
        try:
            c = check(cell, name, call, base, ref, ref_out, idx)
        except Exception as exc:  # noqa: BLE001  (a refusal of the shape, a missing kernel, ...)
            skip(name, mb.short(exc))
            if not isinstance(exc, (NotImplementedError, ValueError, TypeError)):
                traceback.print_exc()
            continue
        result["checks"].append(c)
        checked[name] = call
        print(f"kda_bench: H={cell.H} B={cell.B} {name}: max |Δ out| {c['out_max_abs']:.3g}, |Δ state| "
              f"{c['state_max_abs']:.3g}, |Δ conv state| {c['conv_max_abs']:.3g} against the reference"
              + ("" if c["ok"] else f"; DISAGREES: {c['detail']}"), file=sys.stderr)
    return checked


def time_cell(cell: Cell, checked: dict, skip, result: dict, separate: bool) -> str:
    """Each checked implementation on a pool whose slot sets cycle over >= 256 MiB of pages (freed
    on return), by mtp_bench's SeparatedClock; returns the progress line."""
    pool = cell.pool(1 + cell.sets * cell.B, random_bytes=False)
    sets = cell.slot_sets(cell.sets)
    clock = mb.SeparatedClock(cell.sets, separate)
    line = [clock.describe() + ":"]
    for name, call in checked.items():
        try:
            us, mode = clock.time(lambda i, call=call: call(pool, sets[i]))
        except Exception as exc:  # noqa: BLE001
            skip(name, mb.short(exc))
            continue
        result["times"].append(dict(state=head_key(cell.H), B=cell.B, T=1, impl=name, us=us, mode=mode))
        line.append(f"{name} {us:.1f}")
    return " ".join(line)


def run_cell(H: int, B: int, impls: dict, reference, result: dict, separate: bool = True,
             conv_layout: str = "SD") -> None:
    cell = Cell(H, B, seed=1000 * H + B, conv_layout=conv_layout)
    calls = {name: cell.call(fn) for name, fn in impls.items()}

    def skip(impl, reason):
        result["skips"].append(dict(state=head_key(H), B=B, T=1, impl=impl, reason=reason))
        print(f"kda_bench: H={H} B={B} {impl}: not timed: {reason}", file=sys.stderr)

    checked = check_cell(cell, calls, reference, skip, result)
    mb.empty_cache()
    line = time_cell(cell, checked, skip, result, separate)
    mb.empty_cache()
    us = mb.copy_us(cell.moved)
    result["times"].append(dict(state=head_key(H), B=B, T=1, impl=COPY, us=us, mode="graph"))
    print(f"kda_bench: H={H} B={B} ({line} µs), copy {us:.1f} µs", file=sys.stderr, flush=True)


def load_vllm_kda(so: str, reason: str):
    """vLLM's op, or the reason it is not there."""
    return mb.load_vllm_cuda(so, reason, "fused_kda_decode")


def load_cudelta():
    """(drop-in, reference, why the drop-in is missing); the dry run's drop-in is the reference."""
    try:
        from cudelta import _native, vllm_compat
    except Exception as exc:  # noqa: BLE001  (any import failure is a skip line, never a crash)
        return None, None, f"cannot import cudelta: {mb.short(exc)}"
    reference = getattr(vllm_compat, "fused_kda_decode_reference", None)
    fn = getattr(vllm_compat, "fused_kda_decode", None)
    if mb.DEVICE == "cpu":
        return reference, reference, "" if reference else "cudelta.vllm_compat has no fused_kda_decode_reference"
    if fn is None:
        return None, reference, "cudelta.vllm_compat has no fused_kda_decode (this cudelta predates it)"
    st = _native.status()
    if not st.loaded:  # CUDA tensors would run the PyTorch reference: no kernel to time
        return None, reference, f"cudelta's native library is not loaded: {st.reason}"
    return fn, reference, ""


def work(args, impls: dict, reasons: dict, reference, save=None) -> dict:
    """Every cell of the sweep with the given implementations (those None are skipped with their
    reason) and reference; save(result) after every cell, so that a crash keeps the rest."""
    import torch

    mb.DEVICE, mb.DRAM_BYTES = args.device, args.dram_mib << 20
    loaded = {n: f for n, f in impls.items() if f is not None}
    name = torch.cuda.get_device_name(0) if mb.DEVICE != "cpu" else "CPU dry run"
    result = {"device": f"{name}, torch {torch.__version__}", "times": [], "skips": [], "checks": []}
    chunk = min(report.COPY_CAP_BYTES, mb.DRAM_BYTES)
    result["copy_GBps"] = 2 * chunk / mb.copy_us(2 * chunk) / 1e3
    for H in args.heads:
        for B in args.batches:
            for n, f in impls.items():
                if f is None:
                    result["skips"].append(dict(state=head_key(H), B=B, T=1, impl=n, reason=reasons[n]))
            try:
                run_cell(H, B, loaded, reference, result, separate=not args.back_to_back,
                         conv_layout=args.conv_layout)
            except Exception as exc:  # noqa: BLE001  (the cells done so far still count)
                traceback.print_exc()
                for n in loaded:
                    result["skips"].append(dict(state=head_key(H), B=B, T=1, impl=n,
                                                reason=f"cell failed: {mb.short(exc)}"))
                if "CUDA error" in str(exc):  # the context is lost: every later call would fail alike
                    result["lost"] = True
                    break
            if save is not None:
                save(result)
        if result.get("lost"):
            break
    return result


def run_worker(args) -> int:
    import torch

    mb.DEVICE = args.device
    if mb.DEVICE != "cpu" and not torch.cuda.is_available():
        print("kda_bench: needs an NVIDIA GPU", file=sys.stderr)
        return 2
    fn, reference, why = load_cudelta()
    impls, reasons = {CUDELTA: fn}, {CUDELTA: why}
    if mb.DEVICE == "cpu":
        impls[VLLM_CUDA], reasons[VLLM_CUDA] = None, "dry run (--device cpu): vLLM's op needs a GPU"
    else:
        impls[VLLM_CUDA], reasons[VLLM_CUDA] = load_vllm_kda(args.cuda_op_so, args.cuda_op_reason)
    out = Path(args.worker)
    result = work(args, impls, reasons, reference, save=lambda r: out.write_text(json.dumps(r)))
    out.write_text(json.dumps(result))
    return 3 if result.get("lost") else 0


# ---------------------------------------------------------------- the parent: processes, medians, tables


def method_text(args, procs_done: int, seconds: float) -> str:
    between = ("calls back to back (a call may overlap the previous one: PDL)" if args.back_to_back else
               "a one-element kernel after each call, its time subtracted (no call overlaps the previous one)")
    clock = "wall-clock times of CPU calls (dry run: the plumbing, not the numbers)" if args.device == "cpu" else \
        f"CUDA graph of >= {mb.MIN_CALLS} calls, best of 5 replays, per process"
    conv = "[3, 3H*128] (SD)" if args.conv_layout == "SD" else "[3H*128, 3] (DS)"
    return (f"Pool: vLLM's padded pages (conv state {conv} bf16, state [H, 128, 128] fp32, padding to 32 KiB; "
            f"slot 0 the null block), slot sets cycling over >= {args.dram_mib} MiB of pages; {clock}; {between}. "
            f"% of copy: the step's bytes (per request: state read + written, conv window read + written, x, "
            f"raw_g, raw_beta, output_gate, out) ÷ its time, against a {report.COPY_CAP_BYTES >> 20} MiB copy's "
            f"bandwidth (a copy of each "
            f"cell's own bytes is timed too, in the .json). {procs_done} of {args.procs} processes, "
            f"{seconds:.0f} s. Peer: vLLM's op ({mb.fetched_version(mb.CUDA_OP_DIR)}).")


def worker_command(args, so: str, so_reason: str, result: Path) -> list[str]:
    safe_path = ["-P"] if getattr(sys.flags, "safe_path", False) else []  # as the parent was started
    return [sys.executable, *safe_path, str(Path(__file__).resolve()), "--worker", str(result),
            "--heads", *map(str, args.heads), "--batches", *map(str, args.batches), "--device", args.device,
            "--dram-mib", str(args.dram_mib), "--cuda-op-so", so, "--cuda-op-reason", so_reason,
            "--conv-layout", args.conv_layout] + (
        ["--back-to-back"] if args.back_to_back else [])


def write_out(args, text: str, method: str, merged: report.Merged, runs: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    dump = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "method": method,
            "median": [dict(H=int(k[0][2:]), B=k[1], impl=k[3], us=v, spread=merged.spread[k], runs=merged.runs[k])
                       for k, v in merged.median.items()],
            "processes": runs}
    args.out.with_suffix(".json").write_text(json.dumps(dump, indent=1))


def run_parent(args) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kda_bench-") as tmp:
        so, so_reason = ("", "dry run") if args.device == "cpu" else \
            mb.unpack_cuda_op(mb.cuda_op_archive(args.cuda_op), Path(tmp))
        runs, failures = mb.run_processes("kda_bench", args.procs,
                                          lambda result: worker_command(args, so, so_reason, result), Path(tmp))
    if not runs:
        return 1
    merged = report.merge_runs(runs)
    method = method_text(args, len(runs), time.monotonic() - started)
    text = render(merged, args.heads, args.batches, method, failures)
    print(text, end="")
    if args.out:
        write_out(args, text, method, merged, runs)
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", default=DEFAULT_HEADS, metavar="H",
                        help=f"heads, of {list(HEADS)} (vLLM's op takes no other); default {DEFAULT_HEADS}")
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES, help=f"default {BATCHES}")
    parser.add_argument("--procs", type=int, default=3, help="processes to take medians over (default 3)")
    parser.add_argument("--back-to-back", action="store_true",
                        help="no kernel between calls: a call may overlap the previous one (PDL), not as in a model")
    parser.add_argument("--conv-layout", choices=["SD", "DS"], default="SD",
                        help="the conv state's layout in each page: SD [3, dim] (vLLM's default, handed to the op "
                             "transposed) or DS [dim, 3]; default SD")
    parser.add_argument("--cuda-op", type=Path, help="vLLM's library (.so or .so.xz); default .peers/cuda_op/*.so.xz")
    parser.add_argument("--out", type=Path, help="write the tables here (markdown) and the numbers beside it (.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    # A dry run of every step without a GPU (CPU tensors, cudelta's reference as cudelta, vLLM
    # skipped, wall-clock times, small pools via --dram-mib; any head count): what tests/unit runs.
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--dram-mib", type=int, default=mb.DRAM_BYTES >> 20, help=argparse.SUPPRESS)
    parser.add_argument("--cuda-op-so", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cuda-op-reason", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.procs < 1 or any(b < 1 for b in args.batches) or args.dram_mib < 1:
        parser.error(f"--procs, --batches and --dram-mib must be >= 1; got {args.procs}, {args.batches}, "
                     f"{args.dram_mib}")
    if args.device != "cpu" and not set(args.heads) <= set(HEADS):
        parser.error(f"--heads must be of {list(HEADS)} (vLLM's op takes no other); got {args.heads}")
    if any(h < 1 for h in args.heads):
        parser.error(f"--heads must be >= 1; got {args.heads}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_worker(args) if args.worker else run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
