"""Why cudelta's KDA drop-in loses in the band of 384-3,072 (request, head) pairs: the launch
statistics and occupancy ncu reports for both sides' kernels, at the cells given.

    python benchmarks/fetch_vllm_ops.py --cache /tmp/vllm-wheel    # here; carry .peers/cuda_op
    python -P benchmarks/ncu_kda.py [--heads 12] [--batches 22 23 32 48] [--out FILE]   # GPU machine
    python -P benchmarks/ncu_kda.py --stalls --heads 12 --batches 32 128 512 --calls 3
    python -P benchmarks/ncu_kda.py --source --heads 12 --batches 128 --calls 4

One workload process builds each cell as kda_bench.py does (vLLM's pages, the bounded gate, the
epilogue) and makes --calls calls of cudelta.vllm_compat.fused_kda_decode and of vLLM's op on it,
alternating, each on its own slot set, under `ncu --clock-control none`. The default table
(ncu flushes the caches before each launch, so the state comes from DRAM): grid and block,
registers a thread, shared memory a block, the blocks an SM can hold and what limits them, waves
per SM, achieved occupancy, duration and DRAM throughput, a row a launch. --stalls: a row a kernel
a cell, medians over the calls (caches flushed as above), with ncu_mtp.py's columns (time, DRAM %
of peak, occupancy, cycles per issued instruction), the DRAM bytes read and written and the three
largest warp stall reasons. --source: where each side's warps wait, instruction by instruction
(ncu_mtp.py --source's method: no cache flush, application replay, the second half of the calls
sampled). The numbers ncu prints are the evidence; nothing here is timed for a table.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ncu_mtp  # noqa: E402

KERNELS = "regex:conv_update|decode_vk|kda|Kda|KDA"
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy")
METRICS = {  # ncu's metric name -> the table's heading
    "Registers Per Thread": "regs",
    "Static Shared Memory Per Block": "static smem",
    "Dynamic Shared Memory Per Block": "dyn smem",
    "Block Limit Registers": "blocks/SM by regs",
    "Block Limit Shared Mem": "by smem",
    "Block Limit Warps": "by warps",
    "Waves Per SM": "waves/SM",
    "Achieved Occupancy": "achieved occ. %",
    "Duration": "duration",
    "DRAM Throughput": "DRAM %",
}


def workload(heads: list[int], batches: list[int], calls: int = 1) -> None:
    import torch

    import kda_bench as kb
    import mtp_bench as mb
    from cudelta import vllm_compat

    with tempfile.TemporaryDirectory() as tmp:
        so, why = mb.unpack_cuda_op(mb.cuda_op_archive(None), Path(tmp))
        op, why = kb.load_vllm_kda(so, why)
    if op is None:
        raise SystemExit(f"ncu_kda: vLLM's op did not load: {why}")
    for H in heads:
        for B in batches:
            cell = kb.Cell(H, B, seed=1000 * H + B)
            pool = cell.pool(1 + cell.sets * B, random_bytes=False)
            sets = cell.slot_sets(cell.sets)
            for c in range(calls):
                cell.call(vllm_compat.fused_kda_decode)(pool, sets[2 * c % cell.sets])
                cell.call(op)(pool, sets[(2 * c + 1) % cell.sets])
            torch.cuda.synchronize()
            del pool


UNITS = {"register/thread": "", "block": "", "byte/block": " B", "%": "%", "ns": " ns", "": ""}


def cell_of(launch: int, cells: list[tuple[int, int]], calls: int) -> str:
    """The cell the workload's launch number `launch` belongs to: three launches a call (cudelta's
    conv, cudelta's step, vLLM's op), `calls` calls a cell, cells in the workload's order."""
    i = launch // (3 * calls)
    return f"H={cells[i][0]} B={cells[i][1]}" if i < len(cells) else "H=? B=?"


def check_launches(count: int, cells: list[tuple[int, int]], calls: int) -> None:
    """Labels are by position, so a launch missing or extra would shift every label after it."""
    expected = 3 * calls * len(cells)
    if count != expected:
        raise SystemExit(f"ncu_kda: ncu profiled {count} launches, expected {expected} "
                         f"(3 a call: cudelta's conv and step, vLLM's op; {calls} calls a cell; {len(cells)} cells)")


def table(text: str, cells: list[tuple[int, int]], calls: int = 1) -> str:
    """ncu's --csv --page details output -> one row a launch, in launch order: three a call
    (cudelta's conv, cudelta's step, vLLM's op), `calls` calls a cell, labelled with `cells` in the
    workload's order."""
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit("ncu_kda: ncu printed no metrics\n" + text[-3000:])
    launches: dict[str, dict] = {}
    for rec in csv.DictReader(io.StringIO(text[start:])):
        row = launches.setdefault(rec["ID"], {"kernel": ncu_mtp.short_name(rec["Kernel Name"]),
                                              "grid": rec.get("Grid Size", ""), "block": rec.get("Block Size", "")})
        if rec.get("Metric Name") in METRICS:
            unit = rec.get("Metric Unit", "")
            row[METRICS[rec["Metric Name"]]] = rec["Metric Value"] + UNITS.get(unit, f" {unit}")
    ids = sorted(launches, key=int)
    check_launches(len(ids), cells, calls)
    heads = ["cell", "kernel", "grid", "block", *METRICS.values()]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for i, launch_id in enumerate(ids):
        row = launches[launch_id]
        out.append("| " + " | ".join([cell_of(i, cells, calls), *(str(row.get(h, "")) for h in heads[1:])]) + " |")
    return "\n".join(out)


# --stalls: ncu_mtp.py's sections and columns, and the DRAM bytes each launch moved (in MB, as
# ncu_mtp.SCALE reads them).
STALL_COLUMNS = {**ncu_mtp.COLUMNS, "dram__bytes_read.sum": "DRAM read MB", "dram__bytes_write.sum": "DRAM write MB"}


def stall_table(rows: list[dict], cells: list[tuple[int, int]], calls: int) -> list[str]:
    """ncu's raw page -> a row a (cell, kernel): medians over the cell's calls, launches labelled by
    cell_of."""
    check_launches(len(rows), cells, calls)
    groups: dict[tuple[str, str], list[dict]] = {}
    for i, row in enumerate(rows):
        kernel = ncu_mtp.short_name(row.get("Kernel Name", ("?", ""))[0])
        groups.setdefault((cell_of(i, cells, calls), kernel), []).append(row)
    heads = ["cell", "kernel grid x block", "launches", *STALL_COLUMNS.values(),
             "top stalls (cycles per issued instruction)"]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for (cell, kernel), launches in groups.items():
        out.append(f"| {cell} | {kernel} {ncu_mtp.launch_shape(launches)} | {len(launches)} | "
                   + " | ".join(ncu_mtp.medians(launches, STALL_COLUMNS))
                   + f" | {ncu_mtp.top_stalls(launches)} |")
    return out


# --source: each side's kernels apart, as ncu_mtp.py --source profiles them.
SOURCE_KERNELS = {"cudelta": "regex:conv_update|decode_vk", "vLLM": "regex:kda_decode"}


def workload_command(heads: list[int], batches: list[int], calls: int) -> list[str]:
    return [sys.executable, "-P", str(Path(__file__).resolve()), "--workload", "--calls", str(calls),
            "--heads", *map(str, heads), "--batches", *map(str, batches)]


def main_stalls(args) -> list[str]:
    rows = ncu_mtp.raw_profile(args.ncu, KERNELS, workload_command(args.heads, args.batches, args.calls),
                               STALL_COLUMNS)
    cells = [(H, B) for H in args.heads for B in args.batches]
    return [f"ncu --clock-control none, caches flushed before each launch; medians of {args.calls} calls", "",
            *stall_table(rows, cells, args.calls)]


def main_source(args) -> list[str]:
    lines = [f"ncu --clock-control none --cache-control none --replay-mode application, warp-stall sampling "
             f"every 32 cycles; the last {args.calls - args.calls // 2} of {args.calls} calls of each side, summed", "",
             "| cell | impl | kernel | warp instructions a launch (thousands) | top stalls (% of samples) | "
             "hottest instruction (% of samples) |", "|---|---|---|---|---|---|"]
    for H in args.heads:
        for B in args.batches:
            for impl, kernels in SOURCE_KERNELS.items():
                per_call = 2 if impl == "cudelta" else 1  # a cudelta call is two launches (conv, step)
                profiles = ncu_mtp.source_profiles(args.ncu, kernels, per_call * (args.calls // 2),
                                                   per_call * (args.calls - args.calls // 2),
                                                   workload_command([H], [B], args.calls))
                lines += ncu_mtp.summarise_source(f"H={H} B={B}", impl, profiles)
                print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[12])
    ap.add_argument("--batches", type=int, nargs="+", default=[22, 23, 32, 48])
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--calls", type=int, default=1, help="calls of each side a cell, alternating")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--stalls", action="store_true", help="a row a kernel: time, DRAM, warp stall reasons")
    mode.add_argument("--source", action="store_true", help="where each side's warps wait, a SASS instruction at a time")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls {args.calls}: give 1 or more")
    if args.workload:
        workload(args.heads, args.batches, args.calls)
        return 0
    if args.stalls or args.source:
        lines = main_stalls(args) if args.stalls else main_source(args)
        return ncu_mtp.write_table(lines, args.out)
    cmd = [args.ncu, "--clock-control", "none", "-k", KERNELS, "--csv", "--page", "details",
           *(x for s in SECTIONS for x in ("--section", s)), *workload_command(args.heads, args.batches, args.calls)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if args.out:  # ncu's own output is kept even when it cannot be tabled
        args.out.write_text(run.stdout)
    text = table(run.stdout, [(H, B) for H in args.heads for B in args.batches], args.calls)
    print(text)
    if args.out:
        args.out.write_text(text + "\n\n" + run.stdout)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
