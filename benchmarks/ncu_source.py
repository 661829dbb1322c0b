"""Where a kernel's warps wait, instruction by instruction: ncu's source page (SASS with warp-stall
samples) read into a few figures. ncu_mtp.py --source prints them for cudelta and vLLM's op.

Samples are taken per warp at a fixed interval, so a reason's share of them is its share of the
warps' time. A warp waiting at a block barrier is sampled a few instructions after the BAR.SYNC
(sm_90's BAR.SYNC.DEFER_BLOCKING blocks at the first instruction that must wait for it).
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter
from itertools import groupby
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
# How far after a BAR.SYNC its waits are sampled (sm_90a, decode_mtp_stream_kernel: 3 instructions).
BARRIER_REACH = 4


@dataclass
class SourceProfile:
    """One kernel's source page, summed over the launches it holds."""

    kernel: str
    launches: int = 0
    instructions: list[str] = field(default_factory=list)  # SASS, in address order
    samples: list[float] = field(default_factory=list)  # per instruction
    executed: list[float] = field(default_factory=list)  # warp-level, per instruction
    instruction_reasons: list[Counter] = field(default_factory=list)  # stall reason -> samples, per instruction

    @property
    def total(self) -> float:
        return sum(self.samples)

    @property
    def reasons(self) -> Counter:
        """Stall reason -> samples, over the whole kernel."""
        return self._reasons(0, len(self.instruction_reasons))

    def _reasons(self, a: int, b: int) -> Counter:
        return sum(self.instruction_reasons[a:b], Counter())

    def reason_shares(self, top: int = 4) -> list[tuple[str, float]]:
        """The largest stall reasons, as percentages of all samples."""
        return [(name, 100.0 * n / self.total) for name, n in self.reasons.most_common(top)] if self.total else []

    def hottest(self) -> tuple[float, str]:
        """The instruction with the most samples: its share and text ("after BAR.SYNC" where a
        block barrier is among the BARRIER_REACH instructions before it: its warps wait there)."""
        if not self.total:
            return 0.0, ""
        i = max(range(len(self.samples)), key=self.samples.__getitem__)
        text = self.instructions[i]
        if any("BAR.SYNC" in before for before in self.instructions[max(0, i - BARRIER_REACH):i]):
            text += " (after BAR.SYNC)"
        return 100.0 * self.samples[i] / self.total, text

    def executed_per_launch(self) -> float:
        return sum(self.executed) / self.launches if self.launches else 0.0

    def phases(self, tokens: int) -> list["Phase"]:
        """One warp's path in three phases: the token loop, what comes before it and what after.
        The working warps are the count most instructions ran (straight-line code runs once a warp;
        a grid's extra blocks that return at once run few instructions). With T > 1 the loop is the
        heaviest run of instructions, in address order, that each ran at least twice a working warp
        (unrolled or not: a kernel that takes two tokens an iteration runs its body T / 2 times);
        never-run instructions between them do not break a run. A phase's path is its executed
        instructions over the working warps."""
        counts = Counter(c for c in self.executed if c)
        if not counts:
            return []
        warps = counts.most_common(1)[0][0]
        first = last = len(self.executed)
        if tokens > 1:
            ran = [(i, c) for i, c in enumerate(self.executed) if c]  # never-run ones do not break a run
            runs = [[i for i, _ in run] for repeated, run in groupby(ran, key=lambda ic: ic[1] >= 2 * warps) if repeated]
            if runs:
                heaviest = max(runs, key=lambda r: sum(self.executed[i] for i in r))
                first, last = heaviest[0], heaviest[-1] + 1
        spans = (("before the loop", 0, first), ("token loop", first, last), ("after the loop", last, len(self.executed)))
        return [self._phase(name, a, b, warps) for name, a, b in spans]

    def _phase(self, name: str, a: int, b: int, warps: float) -> "Phase":
        reasons = self._reasons(a, b)
        total = sum(self.samples[a:b])
        return Phase(name, sum(self.executed[a:b]) / warps, 100.0 * total / self.total if self.total else 0.0,
                     [(k, 100.0 * v / total) for k, v in reasons.most_common(3)] if total else [])


@dataclass
class Phase:
    """A stretch of a kernel's code: instructions on one working warp's path, its share of all
    samples (of the warps' time, the grid's extra blocks included), its largest stall reasons (% of
    its own samples)."""

    name: str
    path: float
    share: float
    reasons: list[tuple[str, float]]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def parse(text: str) -> dict[str, SourceProfile]:
    """`ncu --import REPORT --page source --csv --print-source sass`: one block per profiled launch,
    each a "Kernel Name" line, a header and a row per instruction. Kernel name -> its profile, the
    launches of one kernel summed instruction by instruction."""
    profiles: dict[str, SourceProfile] = {}
    for block in re.split(r'^"Kernel Name",', text, flags=re.M)[1:]:
        name_line, _, body = block.partition("\n")
        name = next(csv.reader([name_line]))[0]
        rows = list(csv.reader(io.StringIO(body)))
        if not rows or SAMPLES not in rows[0]:
            continue
        head = rows[0]
        at = {h: i for i, h in enumerate(head)}
        stalls = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
        prof = profiles.setdefault(name, SourceProfile(name))
        rows = [r for r in rows[1:] if len(r) == len(head)]
        if prof.launches and len(rows) != len(prof.instructions):
            raise ValueError(f"{name}: launches with different code ({len(rows)} and {len(prof.instructions)} instructions)")
        if not prof.launches:
            prof.instructions = [r[at["Source"]].strip() for r in rows]
            prof.samples = [0.0] * len(rows)
            prof.executed = [0.0] * len(rows)
            prof.instruction_reasons = [Counter() for _ in rows]
        prof.launches += 1
        for i, r in enumerate(rows):
            prof.samples[i] += _number(r[at[SAMPLES]])
            prof.executed[i] += _number(r[at[EXECUTED]]) if EXECUTED in at else 0.0
            for h in stalls:
                if v := _number(r[at[h]]):
                    prof.instruction_reasons[i][h.removeprefix("stall_")] += v
    return profiles


def main() -> int:
    """A saved source page (ncu_mtp.py --source --pages) read into its phases, kernel by kernel."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("page", type=Path, help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--tokens", type=int, required=True, help="the cell's T (tokens a request)")
    args = parser.parse_args()
    for name, prof in parse(args.page.read_text()).items():
        print(f"{name[:120]}: {prof.executed_per_launch() / 1e3:,.1f} thousand warp instructions a launch")
        for ph in prof.phases(args.tokens):
            stalls = ", ".join(f"{k} {v:.0f}%" for k, v in ph.reasons)
            print(f"  {ph.name:16s} {ph.path:7.0f} instructions a warp, {ph.share:5.1f}% of samples ({stalls})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
