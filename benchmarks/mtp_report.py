"""The pure half of mtp_bench.py (no torch, no GPU): the bytes one MTP step moves and the copy that
moves as many, the merge of several processes' measurements into medians, and the markdown tables
with the issue's targets read off them (issue 17, "Targets").

A measurement is a dict {"state": "bfloat16", "B": 8, "T": 2, "impl": "cudelta", "us": 9.3}; a
process's result is {"device": str, "copy_GBps": float, "times": [...], "skips": [{..., "reason"}],
"checks": [{..., "ok": bool, "out_max_abs": float, "state_max_abs": float, "detail": str}]}.

    python benchmarks/mtp_report.py mtp-16-32.json   # the tables again from mtp_bench.py's numbers
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

CUDELTA = "cudelta"  # cudelta.vllm_compat.fused_gdn_decode_post_conv_mtp
VLLM_CUDA = "vllm-cuda"  # torch.ops._C.fused_gdn_decode_post_conv_mtp from vLLM's wheel
VLLM_TRITON = "vllm-triton"  # vLLM's Triton port of the same op
T1_ALONE = "cudelta-t1"  # cudelta.gdn_decode, one token, no epilogue (T=1 cells only)
COPY = "copy"  # a device copy moving the step's bytes (copy_equivalent_us)
STEP_IMPLS = (CUDELTA, VLLM_CUDA, VLLM_TRITON)  # the same call, the same arguments
IMPLS = STEP_IMPLS + (T1_ALONE,)
NAMES = {CUDELTA: "cudelta", VLLM_CUDA: "vLLM CUDA", VLLM_TRITON: "vLLM Triton", T1_ALONE: "cudelta T=1 decode alone"}

COPY_CAP_BYTES = 256 << 20  # the copy never exceeds this; beyond it, its time is scaled by the bytes
TARGET_SPEEDUP_SMALL_B = 1.5  # over vLLM's CUDA op at B <= 8
SMALL_B = 8
TARGET_PCT_COPY = 93.0  # of the copy's bandwidth at B*T >= 256
LARGE_BT = 256
TARGET_EPILOGUE_COST = 0.05  # T=1 with the epilogue within 5% of T=1 decode alone


def step_bytes(B: int, T: int, state_itemsize: int, *, H: int = 16, HV: int = 32, K: int = 128, V: int = 128,
               act_itemsize: int = 2) -> int:
    """The bytes an MTP step must move: each request's state read once and written T times (one
    checkpoint per token), and per token q, k (H*K each), v, z and the output (HV*V each) in the
    activation dtype. The gates a, b (2*HV per token), A_log, dt_bias, the norm weight and the
    indices are left out: under 1% of the rest."""
    state = HV * V * K * state_itemsize
    tokens = B * T
    return B * state + tokens * state + tokens * (2 * H * K + 3 * HV * V) * act_itemsize


def copy_chunk_bytes(moved: int, cap: int = COPY_CAP_BYTES, align: int = 16) -> int:
    """Size of the reference copy: a copy of n bytes reads n and writes n, so half the step's bytes
    move as many; capped at `cap`, whole multiples of `align` (16-byte vectors), at least one."""
    return max(align, min(moved // 2, cap) // align * align)


def copy_equivalent_us(chunk_us: float, chunk_bytes: int, moved: int) -> float:
    """The copy's time scaled to the step's bytes: its bandwidth is what a capped copy measures."""
    return chunk_us * (moved / 2) / chunk_bytes


def pct_of_copy(us: float, copy_us: float) -> float:
    """Share of the copy's bandwidth that a step moving the same bytes in `us` reaches."""
    return 100.0 * copy_us / us


Key = tuple  # (state, B, T, impl)

# Nominal DRAM bandwidth from the spec sheets (GB/s), by the name torch reports: the copy's share of
# it puts "% of copy" on the other scale. A device not listed gets no such line.
NOMINAL_DRAM_GBPS = {"NVIDIA H100 80GB HBM3": 3352.0, "NVIDIA H200": 4800.0}


def nominal_dram_GBps(device: str) -> float | None:
    """The nominal peak of the device a report names ("NVIDIA H200, torch 2.11.0+cu130")."""
    return NOMINAL_DRAM_GBPS.get(device.split(",")[0].strip())


def copy_of_nominal(m: "Merged") -> str:
    peak = nominal_dram_GBps(m.device)
    if peak is None or not math.isfinite(m.copy_GBps):
        return ""
    return (f" ({100 * m.copy_GBps / peak:.0f}% of its nominal {peak:.0f} GB/s: a cell's % of nominal DRAM peak "
            f"is its % of copy times {m.copy_GBps / peak:.2f})")


def key(m: dict) -> Key:
    return (m["state"], int(m["B"]), int(m["T"]), m["impl"])


@dataclass
class Merged:
    """Per-cell medians over the processes, and what each process could not time or check."""

    procs: int
    device: str
    copy_GBps: float
    median: dict = field(default_factory=dict)  # Key -> µs
    spread: dict = field(default_factory=dict)  # Key -> (max - min) / median
    runs: dict = field(default_factory=dict)  # Key -> number of processes that timed it
    modes: dict = field(default_factory=dict)  # Key -> "graph" or "eager"
    skips: dict = field(default_factory=dict)  # Key -> reason (the first process's)
    checks: dict = field(default_factory=dict)  # Key -> merged check (ok only if every process agreed)


def merge_runs(runs: list[dict]) -> Merged:
    """Per (state, B, T, impl): the median over the processes that timed it and their spread; a
    check fails if it failed in any process (its largest differences are kept)."""
    if not runs:
        raise ValueError("merge_runs: no process result to merge")
    values: dict[Key, list[float]] = {}
    merged = Merged(procs=len(runs), device=runs[0].get("device", "?"),
                    copy_GBps=statistics.median(r.get("copy_GBps", math.nan) for r in runs))
    for run in runs:
        for m in run.get("times", []):
            values.setdefault(key(m), []).append(float(m["us"]))
            if m.get("mode", "graph") != "graph":
                merged.modes[key(m)] = m["mode"]
        for s in run.get("skips", []):
            merged.skips.setdefault(key(s), s["reason"])
        for c in run.get("checks", []):
            k = key(c)
            old = merged.checks.get(k)
            if old is None:
                merged.checks[k] = dict(c)
                continue
            old["ok"] = old["ok"] and c["ok"]
            for f in ("out_max_abs", "state_max_abs"):
                old[f] = max(old.get(f, 0.0), c.get(f, 0.0))
            if not c["ok"] and old.get("detail", "") == "":
                old["detail"] = c.get("detail", "")
    for k, vs in values.items():
        med = statistics.median(vs)
        merged.median[k] = med
        merged.spread[k] = (max(vs) - min(vs)) / med if med > 0 else 0.0
        merged.runs[k] = len(vs)
        merged.skips.pop(k, None)  # timed in some process: the others' failures show as fewer runs
    return merged


def _disagrees(m: Merged, k: Key) -> bool:
    c = m.checks.get(k)
    return c is not None and not c["ok"]


def us_text(us: float) -> str:
    """A time as the tables print it: a tenth of a µs below 100, whole µs from there."""
    return f"{us:.1f}" if us < 100 else f"{us:.0f}"


def _us(m: Merged, k: Key) -> str:
    if k not in m.median:
        return "—"
    text = us_text(m.median[k])
    if m.modes.get(k, "graph") != "graph":
        text += "ᵉ"
    if _disagrees(m, k):
        text += " ✗"
    return text


def pct(m: Merged, state: str, B: int, T: int, impl: str) -> float | None:
    """impl's % of copy in the cell, None where either was not timed."""
    k, c = (state, B, T, impl), (state, B, T, COPY)
    if k not in m.median or c not in m.median:
        return None
    return pct_of_copy(m.median[k], m.median[c])


def _pct(m: Merged, state: str, B: int, T: int, impl: str) -> str:
    p = pct(m, state, B, T, impl)
    return "—" if p is None else f"{p:.0f}%"


def ratio(m: Merged, state: str, B: int, T: int, num: str = VLLM_CUDA, den: str = CUDELTA) -> float | None:
    a, b = m.median.get((state, B, T, num)), m.median.get((state, B, T, den))
    return None if a is None or b is None else a / b


def cell_text(m: Merged, state: str, B: int, T: int) -> str:
    """'cudelta / vLLM CUDA / vLLM Triton µs · vLLM CUDA ÷ cudelta · % of copy (cudelta / vLLM CUDA)'."""
    times = " / ".join(_us(m, (state, B, T, i)) for i in STEP_IMPLS)
    r = ratio(m, state, B, T)
    return (f"{times} · {'—' if r is None else f'{r:.2f}x'} · "
            f"{_pct(m, state, B, T, CUDELTA)} / {_pct(m, state, B, T, VLLM_CUDA)}")


def t1_text(m: Merged, state: str, B: int) -> str:
    """cudelta's T=1 decode alone: µs (% of copy), and what the epilogue costs on top of it."""
    k = (state, B, 1, T1_ALONE)
    if k not in m.median:
        return "—"
    text = f"{_us(m, k)} ({_pct(m, state, B, 1, T1_ALONE)})"
    r = ratio(m, state, B, 1, CUDELTA, T1_ALONE)
    return text + (f" · epilogue {100 * (r - 1):+.1f}%" if r is not None else "")


def render_table(m: Merged, state: str, batches: list[int], tokens: list[int]) -> str:
    head = ["B", *[f"T={t}" for t in tokens]]
    with_t1 = 1 in tokens
    if with_t1:
        head.append(NAMES[T1_ALONE])
    lines = [f"**state {state}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for B in batches:
        cells = [str(B), *[cell_text(m, state, B, T) for T in tokens]]
        if with_t1:
            cells.append(t1_text(m, state, B))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def state_name(state: str) -> str:
    return "bf16" if state == "bfloat16" else "fp32" if state == "float32" else state


def _cell_name(state: str, B: int, T: int) -> str:
    return f"{state_name(state)} B={B} T={T}"


def _normalised(reason: str) -> str:
    return re.sub(r"\d+", "#", reason)


def skip_notes(m: Merged, grid_cells: int | None = None, t1_cells: int | None = None) -> list[str]:
    """One line per (implementation, reason): where it was not timed and why ("every cell" when the
    grid's cells for it, grid_cells or t1_cells for the T=1 decode, were all skipped alike)."""
    groups: dict[tuple[str, str], list[Key]] = {}
    first: dict[tuple[str, str], str] = {}
    for k, reason in sorted(m.skips.items()):
        g = (k[3], _normalised(reason))
        groups.setdefault(g, []).append(k)
        first.setdefault(g, reason)
    lines = []
    for g, keys in groups.items():
        total = t1_cells if g[0] == T1_ALONE else grid_cells
        if total is not None and len(keys) == total:
            where = f"every cell ({total})"
        else:
            where = f"{len(keys)} cell(s): " + ", ".join(_cell_name(*k[:3]) for k in keys[:6]) + (
                f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        lines.append(f"- {NAMES.get(g[0], g[0])} not timed in {where}: {first[g]}")
    return lines


def check_notes(m: Merged) -> list[str]:
    """Per implementation: in how many cells it agreed with the reference, its largest differences,
    and every cell where it did not."""
    lines = []
    for impl in IMPLS:
        cs = {k: c for k, c in m.checks.items() if k[3] == impl}
        if not cs:
            continue
        bad = {k: c for k, c in cs.items() if not c["ok"]}
        out = max(c.get("out_max_abs", 0.0) for c in cs.values())
        st = max(c.get("state_max_abs", 0.0) for c in cs.values())
        line = (f"- {NAMES[impl]}: agrees in {len(cs) - len(bad)}/{len(cs)} cells; largest |Δ out| {out:.2e}, "
                f"|Δ state| {st:.2e}")
        if bad:
            line += "; **DISAGREES** in " + "; ".join(f"{_cell_name(*k[:3])}: {c.get('detail', '')}"
                                                       for k, c in sorted(bad.items()))
        lines.append(line)
    return lines


@dataclass(frozen=True)
class Target:
    """One of the issue's targets over a grid: each cell's value (None: not measured) and whether a
    result it rests on disagreed with the reference (such a cell misses whatever its value)."""

    name: str
    cells: list  # (Key, value or None, wrong result)
    ok: Callable[[float], bool]
    fmt: Callable[[float], str]

    def measured(self) -> list:
        return [(k, v, wrong) for k, v, wrong in self.cells if v is not None]

    def misses(self) -> list:
        return [(k, v, wrong) for k, v, wrong in self.measured() if wrong or not self.ok(v)]

    def line(self) -> str:
        """'name: met in all n cells' or the cells that miss it."""
        measured, misses = self.measured(), self.misses()
        if not measured:
            return f"- {self.name}: not measured"
        if not misses:
            text = f"- {self.name}: met in all {len(measured)} cells"
        else:
            text = f"- {self.name}: MISSED in {len(misses)} of {len(measured)} cells: " + ", ".join(
                f"{_cell_name(*k[:3])} {self.fmt(v)}{' (wrong result)' if wrong else ''}" for k, v, wrong in misses)
        if len(measured) < len(self.cells):
            text += f"; {len(self.cells) - len(measured)} cell(s) not measured"
        return text


def targets(m: Merged, states: list[str], batches: list[int], tokens: list[int]) -> list[Target]:
    """The issue's targets against vLLM's CUDA op, read off the medians: never slower, 1.5x at small
    B, the copy's share at large B·T, the T=1 epilogue's cost (in that order)."""
    grid = [(s, B, T) for s in states for B in batches for T in tokens]

    def wrong(s, B, T, *impls):
        return any(_disagrees(m, (s, B, T, i)) for i in impls)

    vs = [((s, B, T, CUDELTA), ratio(m, s, B, T), wrong(s, B, T, CUDELTA, VLLM_CUDA)) for s, B, T in grid]
    small = [c for c in vs if c[0][1] <= SMALL_B]
    copy = [((s, B, T, CUDELTA), pct(m, s, B, T, CUDELTA), wrong(s, B, T, CUDELTA)) for s, B, T in grid
            if B * T >= LARGE_BT]
    t1 = [((s, B, 1, CUDELTA), ratio(m, s, B, 1, CUDELTA, T1_ALONE), wrong(s, B, 1, CUDELTA, T1_ALONE))
          for s in states for B in batches if 1 in tokens]
    speedup = lambda r: f"{r:.2f}x"  # noqa: E731
    return [
        Target("never slower than vLLM's CUDA op (vLLM ÷ cudelta >= 1)", vs, lambda r: r >= 1.0, speedup),
        Target(f">= {TARGET_SPEEDUP_SMALL_B}x vLLM's CUDA op at B <= {SMALL_B}", small,
               lambda r: r >= TARGET_SPEEDUP_SMALL_B, speedup),
        Target(f">= {TARGET_PCT_COPY:.0f}% of copy at B·T >= {LARGE_BT}", copy, lambda p: p >= TARGET_PCT_COPY,
               lambda p: f"{p:.0f}%"),
        Target(f"T=1 + epilogue within {100 * TARGET_EPILOGUE_COST:.0f}% of cudelta's T=1 decode alone", t1,
               lambda r: r <= 1 + TARGET_EPILOGUE_COST, lambda r: f"{100 * (r - 1):+.1f}%"),
    ]


def target_lines(m: Merged, states: list[str], batches: list[int], tokens: list[int]) -> list[str]:
    """The targets' lines, and under the 1.5x one where its misses stand against the copy."""
    found = targets(m, states, batches, tokens)
    lines = [t.line() for t in found]
    missed = [k[:3] for k, r, bad in found[1].measured() if not bad and r < TARGET_SPEEDUP_SMALL_B]
    reach = speedup_reach(m, missed)
    if reach:
        lines.insert(2, reach)
    return lines


def speedup_reach(m: Merged, cells: list[tuple[str, int, int]]) -> str:
    """Where the 1.5x cells missed stand against the copy: cudelta at 1.5x vLLM's speed would move
    the step's bytes at 1.5 times vLLM's share of the copy's bandwidth, past 100% where vLLM's op
    already runs at 2/3 of it or more. '' when no missed cell has both shares."""
    shares = {c: (TARGET_SPEEDUP_SMALL_B * v, own) for c in cells
              if (v := pct(m, *c, VLLM_CUDA)) is not None and (own := pct(m, *c, CUDELTA)) is not None}
    if not shares:
        return ""
    beyond = [(c, need) for c, (need, _) in shares.items() if need > 100.0]
    within = [(c, need, own) for c, (need, own) in shares.items() if need <= 100.0]
    text = (f"  - {TARGET_SPEEDUP_SMALL_B}x vLLM's op means {TARGET_SPEEDUP_SMALL_B} times its share of copy: "
            f"beyond the copy in {len(beyond)} of the {len(shares)} cells missed")
    if beyond:
        text += " (" + ", ".join(f"{_cell_name(*c)} {need:.0f}%" for c, need in beyond) + ")"
    if within:
        text += f"; under it in {len(within)} (" + ", ".join(
            f"{_cell_name(*c)} {need:.0f}% (cudelta {own:.0f}%)" for c, need, own in within) + ")"
    return text


def spread_line(m: Merged) -> str:
    if not m.spread:
        return "Spread across processes: nothing timed."
    worst = max(m.spread, key=m.spread.get)
    typical = statistics.median(m.spread.values())
    lo, hi = min(m.runs.values()), max(m.runs.values())
    return (f"Spread across processes, (max - min) / median: median {100 * typical:.1f}%, largest "
            f"{100 * m.spread[worst]:.1f}% ({NAMES.get(worst[3], worst[3])}, {_cell_name(*worst[:3])}); each "
            f"timed value is the median of {lo if lo == hi else f'{lo} to {hi}'} of {m.procs} processes.")


def render_report(m: Merged, states: list[str], batches: list[int], tokens: list[int], method: str,
                  heads: tuple[int, int] = (16, 32)) -> str:
    """The whole report: header, one table per state dtype, targets, agreement, skips, spread."""
    legend = ("Cell: cudelta / vLLM CUDA / vLLM Triton µs · vLLM CUDA ÷ cudelta · % of copy (cudelta / vLLM "
              "CUDA). — not timed (see below); ✗ disagrees with the reference; ᵉ not a CUDA graph (capture failed: "
              "eager launches).")
    parts = [f"MTP decode step (H={heads[0]}, HV={heads[1]}, K=V=128, bf16 q/k/v/z/out, gated RMSNorm epilogue, vLLM's padded "
             f"pool); {m.device}; copy {m.copy_GBps:.0f} GB/s{copy_of_nominal(m)}; median of {m.procs} processes", "",
             method, "",
             legend]
    for state in states:
        parts += ["", render_table(m, state, batches, tokens)]
    parts += ["", "Targets (issue 17), cudelta against vLLM's CUDA op:", *target_lines(m, states, batches, tokens)]
    checks = check_notes(m)
    if checks:
        parts += ["", "Agreement with cudelta's PyTorch reference (fp32 math, on the GPU) before timing, one input "
                  "set per cell, the whole check pool compared (bytes outside the written state blocks "
                  "bit-identical):", *checks]
    skips = skip_notes(m, len(states) * len(batches) * len(tokens),
                       len(states) * len(batches) if 1 in tokens else 0)
    if skips:
        parts += ["", "Not timed:", *skips]
    parts += ["", spread_line(m)]
    return "\n".join(parts) + "\n"


def render_dump(dump: dict) -> str:
    """The report again from what mtp_bench.py --out writes beside its tables (its .json): the same
    tables and targets from the same per-process numbers, under a report module that may be newer."""
    a = dump["args"]
    return render_report(merge_runs(dump["processes"]), a["states"], a["batches"], a["tokens"],
                         dump.get("method", "Method: not recorded in this file."), heads=tuple(a["heads"]))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/mtp_report.py MTP_BENCH_OUT.json")
    print(render_dump(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))), end="")
