"""Full runs of mtp_bench.py side by side: the issue's targets counted per head shape for each run,
and the cells where cudelta's time moved against a base run. A run is a folder of mtp_bench.py's
.json files (mtp-16-32.json, ...: what mtp_tables.sh returns in numbers.tar.gz), one a head shape.

    python benchmarks/mtp_compare.py RUN [RUN ...]              # the targets, a column a run
    python benchmarks/mtp_compare.py RUN [RUN ...] --base OLD   # and what moved since OLD
    python benchmarks/mtp_compare.py RUN --ratios 16/32          # and README's table of one head shape

A cell "moved" when cudelta's median moved past --threshold (3%) the same way in every run; vLLM's op
is shown beside it, since a peer that moved as much says the machine did, not the kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mtp_report as r  # noqa: E402

TARGET_HEADERS = ("never slower", f">= {r.TARGET_SPEEDUP_SMALL_B}x at B <= {r.SMALL_B}",
                  f">= {r.TARGET_PCT_COPY:.0f}% of copy at B·T >= {r.LARGE_BT}",
                  f"T=1 epilogue within {100 * r.TARGET_EPILOGUE_COST:.0f}%")


@dataclass(frozen=True)
class Table:
    """One head shape's run: its merged medians and the grid it covered."""

    heads: tuple[int, int]
    merged: r.Merged
    states: list[str]
    batches: list[int]
    tokens: list[int]

    def targets(self) -> list[r.Target]:
        return r.targets(self.merged, self.states, self.batches, self.tokens)


def table_from_dump(dump: dict) -> Table:
    a = dump["args"]
    return Table(tuple(a["heads"]), r.merge_runs(dump["processes"]), a["states"], a["batches"], a["tokens"])


def load_run(folder: Path) -> dict[tuple[int, int], Table]:
    """The run's tables by head shape, from its mtp-*.json files."""
    paths = sorted(folder.glob("mtp-*.json"))
    if not paths:
        raise ValueError(f"{folder}: no mtp-*.json (mtp_bench.py --out writes one beside each table)")
    tables = {}
    for path in paths:
        try:
            table = table_from_dump(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not mtp_bench.py's numbers ({type(e).__name__}: {e})") from None
        tables[table.heads] = table
    return tables


def heads_name(heads: tuple[int, int]) -> str:
    return f"{heads[0]}/{heads[1]}"


def targets_table(runs: list[dict[tuple[int, int], Table]]) -> str:
    """A row a head shape, a column a target: cells met of cells measured, run after run ("a / b")."""
    shapes = [h for h in runs[0] if all(h in run for run in runs)]
    rows = ["| heads | " + " | ".join(TARGET_HEADERS) + " |", "|---" * (len(TARGET_HEADERS) + 1) + "|"]
    for h in shapes:
        per_run = [run[h].targets() for run in runs]
        cells = []
        for i in range(len(TARGET_HEADERS)):
            counts = [(len(t[i].measured()) - len(t[i].misses()), len(t[i].measured())) for t in per_run]
            of = {n for _, n in counts}
            cells.append(" / ".join(str(met) for met, _ in counts) + f" of {of.pop()}" if len(of) == 1
                         else " / ".join(f"{met} of {n}" for met, n in counts))
        rows.append(f"| {heads_name(h)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


@dataclass(frozen=True)
class Moved:
    heads: tuple[int, int]
    state: str
    B: int
    T: int
    base_us: float
    run_us: tuple[float, ...]
    base_ratio: float | None  # vLLM's op ÷ cudelta
    run_ratio: tuple[float | None, ...]
    base_vllm_us: float | None
    run_vllm_us: tuple[float | None, ...]

    @property
    def faster(self) -> bool:
        return self.run_us[0] < self.base_us  # every run moved the same way


def moved_cells(base: dict[tuple[int, int], Table], runs: list[dict[tuple[int, int], Table]],
                threshold: float = 0.03) -> list[Moved]:
    """The cells whose cudelta median is past threshold faster, or slower, than base's in every run."""
    moved = []
    for h, old in base.items():
        if not all(h in run for run in runs):
            continue
        for state, B, T in itertools.product(old.states, old.batches, old.tokens):
            k, v = (state, B, T, r.CUDELTA), (state, B, T, r.VLLM_CUDA)
            if k not in old.merged.median or not all(k in run[h].merged.median for run in runs):
                continue
            was = old.merged.median[k]
            now = tuple(run[h].merged.median[k] for run in runs)
            if not (all(x <= was * (1 - threshold) for x in now) or all(x >= was * (1 + threshold) for x in now)):
                continue
            moved.append(Moved(h, state, B, T, was, now, r.ratio(old.merged, state, B, T),
                               tuple(r.ratio(run[h].merged, state, B, T) for run in runs),
                               old.merged.median.get(v), tuple(run[h].merged.median.get(v) for run in runs)))
    return moved


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def moved_table(moved: list[Moved]) -> str:
    rows = ["| heads | state | B | T | cudelta µs, base -> runs | time ÷ base | vLLM's op µs, base -> runs | "
            "vLLM ÷ cudelta, base -> runs |", "|---|---|---|---|---|---|---|---|"]
    for c in moved:
        rows.append(f"| {heads_name(c.heads)} | {r.state_name(c.state)} | {c.B} | {c.T} | "
                    f"{_us(c.base_us)} -> {' / '.join(_us(x) for x in c.run_us)} | "
                    f"{' / '.join(f'{x / c.base_us:.3f}' for x in c.run_us)} | "
                    f"{_us(c.base_vllm_us)} -> {' / '.join(_us(x) for x in c.run_vllm_us)} | "
                    f"{_x(c.base_ratio)} -> {' / '.join(_x(x) for x in c.run_ratio)} |")
    return "\n".join(rows)


def ratio_table(table: Table) -> str:
    """vLLM's op's time ÷ cudelta's, a row a batch and the states side by side, with cudelta's own
    time in the corner cells (first and last batch, first and last token count) as README shows it."""
    head = ["B"] + [f"{r.state_name(st)} state, T={T}" if i == 0 else f"T={T}"
                    for st in table.states for i, T in enumerate(table.tokens)]
    rows = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    corners = {(B, T) for B in (table.batches[0], table.batches[-1]) for T in (table.tokens[0], table.tokens[-1])}
    for B in table.batches:
        cells = [str(B)]
        for st in table.states:
            for T in table.tokens:
                x = r.ratio(table.merged, st, B, T)
                us = table.merged.median.get((st, B, T, r.CUDELTA))
                text = _x(x)
                if (B, T) in corners and us is not None and x is not None:
                    text += f" ({r.us_text(us)} µs)"
                cells.append(text)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parse_heads(text: str) -> tuple[int, int]:
    try:
        h, hv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: heads as H/HV, e.g. 16/32") from None
    return h, hv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="folders of mtp_bench.py's .json, one a run")
    ap.add_argument("--base", type=Path, help="a run to compare cudelta's times against")
    ap.add_argument("--threshold", type=float, default=0.03, help="the share a time must move by (0.03)")
    ap.add_argument("--ratios", type=parse_heads, metavar="H/HV",
                    help="also the first run's table of vLLM ÷ cudelta at these heads")
    args = ap.parse_args(argv)
    if not 0 < args.threshold < 1:
        ap.error(f"--threshold {args.threshold}: a share between 0 and 1 (0.03 is 3%)")
    if args.base is not None and any(run.resolve() == args.base.resolve() for run in args.runs):
        # A cell moves only when every run moved it: the base among the runs never has.
        ap.error(f"--base {args.base} is also one of the runs: nothing can move against itself; "
                 "name it as --base only")
    try:
        runs = [load_run(f) for f in args.runs]
        base = load_run(args.base) if args.base else None
    except (OSError, ValueError) as e:
        print(f"mtp_compare: {e}", file=sys.stderr)
        return 2
    if args.ratios is not None and args.ratios not in runs[0]:
        have = ", ".join(heads_name(h) for h in runs[0])
        print(f"mtp_compare: --ratios {heads_name(args.ratios)}: not in {args.runs[0]} (it has {have})",
              file=sys.stderr)
        return 2
    print("Targets (issue 17), cells met, run after run:\n")
    print(targets_table(runs))
    if base is not None:
        moved = moved_cells(base, runs, args.threshold)
        faster = sum(c.faster for c in moved)
        print(f"\nMoved by {100 * args.threshold:g}% or more against the base in every run: {faster} faster, "
              f"{len(moved) - faster} slower\n")
        print(moved_table(moved))
    if args.ratios is not None:
        print(f"\nvLLM's op ÷ cudelta at {heads_name(args.ratios)} heads ({args.runs[0]}):\n")
        print(ratio_table(runs[0][args.ratios]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
