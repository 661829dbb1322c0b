"""B=1, fp32 state, Kimi-Linear heads, vk layout, raw gates: cudelta beside vLLM, then what ncu says
of cudelta's kernel (benchmarks/results-h100-kernel.md, "B=1, KDA fp32").

    python benchmarks/fetch_vllm_ops.py     # once, on a machine with PyPI: vLLM's ops to .peers/
    python benchmarks/ncu_b1.py [--ncu PATH] [--launches 60]

Prints two tables:
1. kernel_bench.bench_row for the KDA and the GDN row (one process, CUDA graph of 50 calls, best of
   5): cudelta µs, vLLM µs, their ratio;
2. the KDA row again under `ncu --clock-control none` with the SpeedOfLight, LaunchStats,
   Occupancy and WarpStateStats sections, over the first N launches of cudelta's kernel
   (decode_vk_warp_kernel; ncu flushes the caches before each): each figure is the median over
   those launches.

`--workload` is the program ncu runs (the KDA row alone, no vLLM).
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

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kernel_bench  # noqa: E402

KERNEL = "decode_vk_warp_kernel"
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats")
ROWS = (("kda", "KDA fp32 B=1"), ("gdn", "GDN fp32 B=1, Kimi-Linear heads"))


def bench(op: str, peers: dict) -> dict:
    return kernel_bench.bench_row(op, "kimi-linear", torch.float32, "vk", "raw", 1, {"auto": -1}, peers, eager=False)


def timing_table(peers: dict) -> str:
    lines = ["| | cudelta µs | vLLM µs | vLLM / cudelta |", "|---|---|---|---|"]
    for op, label in ROWS:
        row = bench(op, peers)
        vllm = row.get("vllm")
        cells = [f"{row['auto']:.2f}", f"{vllm:.2f}" if vllm else "-", f"{vllm / row['auto']:.2f}x" if vllm else "-"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_details(text: str) -> dict[str, list[tuple[str, str]]]:
    """ncu --csv --page details -> {metric name: [(value, unit) per launch]}, plus the launch's
    'Grid Size' / 'Block Size' columns under '(grid)' / '(block)'."""
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit("ncu_b1: ncu printed no metrics (no launch of " + KERNEL + " profiled?)\n" + text[-2000:])
    metrics: dict[str, list[tuple[str, str]]] = {}
    seen = set()
    for rec in csv.DictReader(io.StringIO(text[start:])):
        if not rec.get("Metric Name"):
            continue
        metrics.setdefault(rec["Metric Name"], []).append((rec["Metric Value"], rec.get("Metric Unit", "")))
        if rec["ID"] not in seen:
            seen.add(rec["ID"])
            metrics.setdefault("(grid)", []).append((rec.get("Grid Size", ""), ""))
            metrics.setdefault("(block)", []).append((rec.get("Block Size", ""), ""))
    return metrics


def median(metrics: dict, name: str) -> tuple[float, str] | None:
    values = metrics.get(name)
    if not values:
        return None
    nums = [float(v.replace(",", "")) for v, _ in values]
    return statistics.median(nums), values[0][1]


def fmt(metrics: dict, name: str, digits: int = 1) -> str:
    m = median(metrics, name)
    return "n/a" if m is None else f"{m[0]:,.{digits}f}"


def microseconds(metrics: dict) -> str:
    m = median(metrics, "Duration")
    if m is None:
        return "n/a"
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(m[1], None)
    return f"{m[0]} {m[1]}" if scale is None else f"{m[0] * scale:.1f} µs"


def ncu_table(metrics: dict, launches: int) -> str:
    launched = len(metrics.get("(grid)", []))
    rows = [
        ("grid × block", f"{metrics['(grid)'][0][0]} × {metrics['(block)'][0][0]}: {fmt(metrics, 'Grid Size', 0)} "
                         f"blocks of {fmt(metrics, 'Block Size', 0)} threads, {fmt(metrics, 'Waves Per SM', 2)} waves"),
        ("registers", f"{fmt(metrics, 'Registers Per Thread', 0)} per thread "
                      f"({fmt(metrics, 'Block Limit Registers', 0)} blocks per SM possible)"),
        ("achieved occupancy", f"{fmt(metrics, 'Achieved Occupancy')}% "
                               f"({fmt(metrics, 'Achieved Active Warps Per SM')} active warps per SM)"),
        ("DRAM throughput", f"{fmt(metrics, 'DRAM Throughput')}%"),
        ("duration (cold caches)", f"{microseconds(metrics)} ({fmt(metrics, 'Elapsed Cycles', 0)} cycles at "
                                   f"{fmt(metrics, 'SM Frequency', 2)} {(median(metrics, 'SM Frequency') or (0, ''))[1]})"),
        ("warp cycles per issued instruction", fmt(metrics, "Warp Cycles Per Issued Instruction")),
    ]
    head = f"| cudelta vk warp kernel, KDA fp32, B=1 (ncu, median of {launched} of {launches} launches) | ncu |"
    return "\n".join([head, "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def profile(ncu: str, launches: int) -> str:
    with tempfile.TemporaryDirectory(prefix="ncu-b1-") as tmp:
        log = Path(tmp) / "ncu.csv"
        cmd = [ncu, "--clock-control", "none", *[a for s in SECTIONS for a in ("--section", s)],
               "--kernel-name", f"regex:{KERNEL}", "--launch-count", str(launches), "--csv", "--page", "details",
               "--log-file", str(log), sys.executable, str(Path(__file__).resolve()), "--workload"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        # the CSV goes to --log-file; stdout too, in case this ncu prints its report there
        text = (log.read_text() if log.exists() else "") + "\n" + proc.stdout
        if proc.returncode != 0:
            raise SystemExit(f"ncu_b1: {' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-2000:]}\n{text[-2000:]}")
    return ncu_table(parse_details(text), launches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="the ncu binary (default: on PATH)")
    parser.add_argument("--launches", type=int, default=60, help="launches of cudelta's kernel ncu profiles")
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ncu_b1: needs an NVIDIA GPU", file=sys.stderr)
        return 2
    from cudelta import _native

    st = _native.status()  # loads the library: torch.ops.cudelta exists only after that
    if not st.loaded:
        print(f"ncu_b1: native library not loaded: {st.reason}", file=sys.stderr)
        return 2
    if args.workload:
        bench("kda", {})
        return 0
    print(f"B=1, fp32 state, vk, raw gates, CUDA graph of {kernel_bench.CALLS} calls, best of "
          f"{kernel_bench.REPLAYS}; {torch.cuda.get_device_name(0)}, torch {torch.__version__}\n")
    print(timing_table(kernel_bench.load_peers()))
    print()
    print(profile(args.ncu, args.launches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
