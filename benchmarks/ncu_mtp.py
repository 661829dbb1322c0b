"""What ncu says limits the multi-token step: cudelta's kernels beside vLLM's CUDA op, cell by cell.

    python benchmarks/fetch_vllm_ops.py          # once, on a machine with PyPI: vLLM's op to .peers/
    python -P benchmarks/ncu_mtp.py [--cells bfloat16:512:2 ...] [--calls 3] [--out FILE]
    python -P benchmarks/ncu_mtp.py --source --calls 8 --cells bfloat16:4:2   # where the warps wait
    python -P benchmarks/ncu_mtp.py --source --heads 4/8 --cells bfloat16:1:8    # another head shape
    python -P benchmarks/ncu_mtp.py --source --heads 4/8 --cells bfloat16:32:1 --slots consecutive

Each cell (state dtype, B, T) is built as mtp_bench.py builds it (vLLM's GDN call: packed mixed_qkv,
cu_seqlens, idx [B, T], num_accepted_tokens, the gated RMSNorm), and both implementations make
--calls calls on distinct slot sets under one `ncu --clock-control none` per cell (ncu flushes the
caches before each launch, so the state comes from DRAM). For each kernel of a call the table gives
the medians over the calls: time, DRAM throughput (% of peak) and bytes, achieved occupancy and what
bounds it, and the warp stall reasons (cycles per issued instruction, the largest three), which is
what the closing notes of issue 17 quote.

--slots: each call's slot set drawn at random over the pool (mtp_bench's, the default) or its slots
side by side (Cell.slot_sets(..., consecutive=True)): the one-token block kernel pays for the scatter
at two blocks an SM (benchmarks/results-h100-t1-scatter.md), and --source without the cache flush
is the profile that can set the two orders side by side.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mtp_bench  # noqa: E402
import mtp_report as report  # noqa: E402
import ncu_source  # noqa: E402

DEFAULT_CELLS = ("bfloat16:1:1", "bfloat16:8:2", "bfloat16:32:2", "bfloat16:512:1", "bfloat16:512:2",
                 "bfloat16:512:4", "float32:512:2")
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "MemoryWorkloadAnalysis")
KERNELS = "regex:decode_|gated_rms|gdn_decode_post_conv"
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")
COLUMNS = {  # what the table shows: raw metric -> heading
    "gpu__time_duration.sum": "µs",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "DRAM % of peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "launch__registers_per_thread": "registers",
    "launch__occupancy_limit_registers": "blocks/SM by registers",
    "launch__occupancy_limit_shared_mem": "by smem",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles per issue",
}
# Metrics whose unit ncu picks per launch, scaled to the table's: durations to µs and DRAM bytes to
# MB. ncu's raw page names a unit either way, depending on the version.
TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
TO_MB = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "KB": 1e-3, "MB": 1.0, "GB": 1e3}
SCALE = {"gpu__time_duration.sum": TO_US, "dram__bytes_read.sum": TO_MB, "dram__bytes_write.sum": TO_MB}


def parse_cell(text: str) -> tuple[str, int, int]:
    state, B, T = text.split(":")
    if state not in mtp_bench.STATES:
        raise argparse.ArgumentTypeError(f"state {state!r}: expected one of {', '.join(mtp_bench.STATES)}")
    return state, int(B), int(T)


def workload(state: str, B: int, T: int, calls: int, so: str, reason: str, slots: str = "random") -> None:
    """The cell's calls, cudelta's then vLLM's, each on its own slot set (what ncu profiles); slots:
    the sets' order, "random" or "consecutive" (Cell.slot_sets)."""
    import torch

    impls = {}
    mtp, _, why = mtp_bench.load_cudelta()
    if mtp is None:
        raise SystemExit(f"ncu_mtp: cudelta: {why}")
    impls[report.CUDELTA] = mtp
    op, why = mtp_bench.load_vllm_cuda(so, reason)
    if op is not None:
        impls[report.VLLM_CUDA] = op
    else:
        print(f"ncu_mtp: vLLM's CUDA op not profiled: {why}", file=sys.stderr)
    cell = mtp_bench.Cell(state, B, T, seed=1000 * B + T)
    sets = max(calls, 2)
    _, pool = cell.pool(1 + sets * B * T, random_bytes=False)
    slot_sets = cell.slot_sets(sets, consecutive=slots == "consecutive")
    for fn in impls.values():
        call = cell.mtp_call(fn)
        for i in range(calls):
            call(pool, slot_sets[i])
        torch.cuda.synchronize()


def raw_rows(text: str) -> list[dict]:
    """ncu --csv --page raw: a header row, a units row, then one row per profiled launch."""
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit("ncu_mtp: ncu printed no metrics\n" + text[-2000:])
    rows = list(csv.reader(io.StringIO(text[start:])))
    head, units = rows[0], rows[1]
    missing = [c for c in COLUMNS if c not in head]
    if missing:  # the column prints as "-" below; say which metric this ncu did not collect
        print(f"ncu_mtp: not collected by this ncu: {', '.join(missing)}", file=sys.stderr)
    return [{h: (v, u) for h, v, u in zip(head, row, units)} for row in rows[2:] if len(row) == len(head)]


def number(row: dict, name: str) -> float | None:
    """A launch's value of a metric, in the table's unit; None where ncu did not report it, or
    reported a scaled metric in a unit SCALE does not know (a wrong scale would pass unseen)."""
    value, unit = row.get(name, ("", ""))
    try:
        x = float(value.replace(",", ""))
    except ValueError:
        return None
    if name not in SCALE:
        return x
    if unit not in SCALE[name]:
        warn_once(f"ncu_mtp: {name} in unit {unit!r} is read as n/a; known units: {', '.join(SCALE[name])}")
        return None
    return x * SCALE[name][unit]


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr)


def who(kernel: str) -> str:
    return report.VLLM_CUDA if "gdn_decode_post_conv" in kernel else report.CUDELTA


def short_name(kernel: str) -> str:
    """"void cudelta::<unnamed>::decode_mtp_stream_kernel<true, 128, ...>(...)" -> the kernel's own
    name (an anonymous namespace's brackets are not the template's or the argument list's)."""
    for anonymous in ("(anonymous namespace)", "<unnamed>"):  # as c++filt and as ncu spell it
        kernel = kernel.replace(anonymous, "anon")
    name = kernel.split("(")[0].split("<")[0]
    return name.rsplit("::", 1)[-1].removeprefix("void ").strip()


def medians(launches: list[dict], names, read=number) -> list[str]:
    """One kernel's launches -> the median of each metric named, as the table prints it ("n/a" where
    ncu collected it for none of them); read(row, name) gives a launch's value."""
    cells = []
    for name in names:
        values = [x for x in (read(r, name) for r in launches) if x is not None]
        cells.append(f"{statistics.median(values):,.1f}" if values else "n/a")
    return cells


def top_stalls(launches: list[dict], top: int = 3) -> str:
    """The largest warp stall reasons over one kernel's launches (medians, cycles per issued
    instruction), as "reason value, ..."."""
    stalls = {}
    for col in launches[0]:
        if col.startswith(STALL[0]) and col.endswith(STALL[1]):
            values = [x for x in (number(r, col) for r in launches) if x is not None]
            if values:
                stalls[col[len(STALL[0]):-len(STALL[1])]] = statistics.median(values)
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:top])


def launch_shape(launches: list[dict]) -> str:
    return f'{launches[0].get("Grid Size", ("?", ""))[0]}x{launches[0].get("Block Size", ("?", ""))[0]}'


def summarise(label: str, rows: list[dict]) -> list[str]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        kernel = row.get("Kernel Name", ("?", ""))[0]
        groups.setdefault((who(kernel), short_name(kernel)), []).append(row)
    return [f"| {label} | {impl} | {kernel} {launch_shape(launches)} | " + " | ".join(medians(launches, COLUMNS))
            + f" | {top_stalls(launches)} |" for (impl, kernel), launches in groups.items()]


def cell_label(cell: tuple[str, int, int]) -> str:
    state, B, T = cell
    return f"{state} B={B} T={T}"


def workload_command(cell: tuple[str, int, int], calls: int, so: str, reason: str, slots: str = "random") -> list[str]:
    """This script's --workload run of the cell, at this process's head shape and slot order: the
    process ncu profiles."""
    state, B, T = cell
    return [sys.executable, "-P", str(Path(__file__).resolve()), "--workload", f"{state}:{B}:{T}",
            "--calls", str(calls), "--heads", f"{mtp_bench.H}/{mtp_bench.HV}", "--slots", slots, "--so", so,
            "--so-reason", reason]


def write_table(lines: list[str], out: Path | None) -> int:
    text = "\n".join(lines)
    print(text)
    if out:
        out.write_text(text + "\n")
    return 0


def raw_profile(ncu: str, kernels: str, workload: list[str], metrics=()) -> list[dict]:
    """ncu's raw page, a row a launch of `kernels` in the workload process: SECTIONS and any further
    metrics, caches flushed before each launch."""
    with tempfile.TemporaryDirectory(prefix="ncu-raw-") as tmp:
        log = Path(tmp) / "ncu.csv"
        cmd = [ncu, "--clock-control", "none", *[a for s in SECTIONS for a in ("--section", s)],
               *(["--metrics", ",".join(metrics)] if metrics else []),
               "--kernel-name", kernels, "--csv", "--page", "raw", "--log-file", str(log), *workload]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        text = (log.read_text() if log.exists() else "") + "\n" + proc.stdout
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}\n{text[-2000:]}")
    return raw_rows(text)


def profile(ncu: str, cell: tuple[str, int, int], calls: int, so: str, reason: str, slots: str = "random") -> list[dict]:
    return raw_profile(ncu, KERNELS, workload_command(cell, calls, so, reason, slots))


# --source: each implementation's kernels apart (their launches summed per kernel), the first half
# of the calls left unprofiled so that the inputs are warm in L2 as in mtp_bench.py.
SOURCE_KERNELS = {report.CUDELTA: "regex:decode_", report.VLLM_CUDA: "regex:gdn_decode_post_conv"}


def source_profiles(ncu: str, kernels: str, skip: int, count: int, workload: list[str],
                    page_csv: Path | None = None) -> dict[str, ncu_source.SourceProfile]:
    """Warp-stall samples per instruction of the `count` launches of `kernels` after the first
    `skip` in the workload process, as a benchmark runs it: no cache flush, and application replay
    (each pass reruns the process, so the state slots are as cold as there). `page_csv` keeps ncu's
    whole source page, every instruction's samples, for reading beyond the table's hottest one."""
    with tempfile.TemporaryDirectory(prefix="ncu-src-") as tmp:
        report_file = Path(tmp) / "source"
        cmd = [ncu, "--clock-control", "none", "--cache-control", "none", "--replay-mode", "application",
               "--section", "SourceCounters", "--warp-sampling-interval", "0", "--kernel-name", kernels,
               "--launch-skip", str(skip), "--launch-count", str(count), "-o", str(report_file), *workload]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
        page = subprocess.run([ncu, "--import", f"{report_file}.ncu-rep", "--page", "source", "--csv",
                               "--print-source", "sass"], capture_output=True, text=True, check=True)
    if page_csv is not None:
        page_csv.write_text(page.stdout)
    return ncu_source.parse(page.stdout)


def profile_source(ncu: str, cell: tuple[str, int, int], calls: int, so: str, reason: str,
                   kernels: str, page_csv: Path | None = None, slots: str = "random") -> dict[str, ncu_source.SourceProfile]:
    """The cell's last calls - calls // 2 launches of `kernels` (the first half warm L2's inputs)."""
    return source_profiles(ncu, kernels, calls // 2, calls - calls // 2,
                           workload_command(cell, calls, so, reason, slots), page_csv)


def phase_rows(label: str, impl: str, tokens: int, profiles: dict[str, ncu_source.SourceProfile]) -> list[str]:
    """One warp's path before, in and after the token loop (ncu_source.SourceProfile.phases)."""
    lines = []
    for name, prof in profiles.items():
        cells = [f"{ph.path:,.0f} · {ph.share:.0f}% · " + ", ".join(f"{k} {v:.0f}" for k, v in ph.reasons[:2])
                 for ph in prof.phases(tokens)]
        lines.append(f"| {label} | {impl} | {short_name(name)} | " + " | ".join(cells) + " |")
    return lines


def summarise_source(label: str, impl: str, profiles: dict[str, ncu_source.SourceProfile]) -> list[str]:
    lines = []
    for name, prof in profiles.items():
        share, text = prof.hottest()
        stalls = ", ".join(f"{reason} {pct:.1f}" for reason, pct in prof.reason_shares())
        lines.append(f"| {label} | {impl} | {short_name(name)} | {prof.executed_per_launch() / 1e3:,.1f} | "
                     f"{stalls} | {share:.1f}: `{text}` |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=parse_cell, nargs="+", default=[parse_cell(c) for c in DEFAULT_CELLS],
                        metavar="STATE:B:T")
    parser.add_argument("--calls", type=int, default=3, help="calls of each implementation per cell")
    parser.add_argument("--heads", type=mtp_bench.parse_heads, default=(mtp_bench.H, mtp_bench.HV), metavar="H/HV",
                        help=f"q/k heads / v heads, default {mtp_bench.H}/{mtp_bench.HV} (as mtp_bench.py --heads)")
    parser.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--source", action="store_true",
                        help="where the warps wait instead: warp-stall samples per SASS instruction "
                             "(--calls of each implementation, the second half profiled)")
    parser.add_argument("--pages", type=Path, metavar="DIR",
                        help="with --source: also write ncu's whole source page (CSV) of each cell and "
                             "implementation here")
    parser.add_argument("--slots", choices=mtp_bench.SLOT_ORDERS, default="random",
                        help="each call's slot set drawn at random over the pool (mtp_bench's) or its slots "
                             "side by side")
    parser.add_argument("--workload", type=parse_cell, help=argparse.SUPPRESS)
    parser.add_argument("--so", default="", help=argparse.SUPPRESS)
    parser.add_argument("--so-reason", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    mtp_bench.set_heads(*args.heads)
    if args.workload:
        workload(*args.workload, args.calls, args.so, args.so_reason, args.slots)
        return 0
    unpacked = tempfile.TemporaryDirectory(prefix="ncu-op-")
    so, reason = mtp_bench.unpack_cuda_op(mtp_bench.cuda_op_archive(None), Path(unpacked.name))
    import torch

    if args.source:
        return main_source(args, so, reason, torch)
    head = ("| cell | impl | kernel grid x block | " + " | ".join(COLUMNS.values())
            + " | top stalls (cycles per issued instruction) |")
    lines = [f"ncu --clock-control none, caches flushed before each launch; medians of {args.calls} calls; "
             f"H={mtp_bench.H}, HV={mtp_bench.HV}; {args.slots} slots; {torch.cuda.get_device_name(0)}, "
             f"torch {torch.__version__}", "", head,
             "|" + "---|" * (len(COLUMNS) + 4)]
    for cell in args.cells:
        lines += summarise(cell_label(cell), profile(args.ncu, cell, args.calls, so, reason, args.slots))
        print(lines[-1], file=sys.stderr, flush=True)
    return write_table(lines, args.out)


def main_source(args, so: str, reason: str, torch) -> int:
    lines = [f"ncu --clock-control none --cache-control none --replay-mode application, warp-stall sampling "
             f"every 32 cycles; the last {args.calls - args.calls // 2} of {args.calls} calls of each implementation, "
             f"summed; H={mtp_bench.H}, HV={mtp_bench.HV}; {args.slots} slots; {torch.cuda.get_device_name(0)}, "
             f"torch {torch.__version__}", "",
             "| cell | impl | kernel | warp instructions a launch (thousands) | top stalls (% of samples) | "
             "hottest instruction (% of samples) |", "|---|---|---|---|---|---|"]
    phases = ["", "One warp's path (the working warps': the count most instructions ran) before, in and after "
              "the token loop: instructions · % of all samples · largest stalls (% of the phase's samples)", "",
              "| cell | impl | kernel | before the loop | token loop | after the loop |", "|---|---|---|---|---|---|"]
    if args.pages:
        args.pages.mkdir(parents=True, exist_ok=True)
    for cell in args.cells:
        for impl, kernels in SOURCE_KERNELS.items():
            if impl == report.VLLM_CUDA and not so:
                continue
            order = "" if args.slots == "random" else f"-{args.slots}"
            page = args.pages / f"{cell[0]}-{cell[1]}-{cell[2]}-{impl}{order}.csv" if args.pages else None
            profiles = profile_source(args.ncu, cell, args.calls, so, reason, kernels, page, args.slots)
            lines += summarise_source(cell_label(cell), impl, profiles)
            phases += phase_rows(cell_label(cell), impl, cell[2], profiles)
            print(lines[-1], file=sys.stderr, flush=True)
    return write_table(lines + phases, args.out)


if __name__ == "__main__":
    sys.exit(main())
