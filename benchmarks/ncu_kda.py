"""Why cudelta's KDA drop-in loses in the band of 384-3,072 (request, head) pairs: the launch
statistics and occupancy ncu reports for both sides' kernels, at the cells given.

    python benchmarks/fetch_vllm_ops.py --cache /tmp/vllm-wheel    # here; carry .peers/cuda_op
    python -P benchmarks/ncu_kda.py [--heads 12] [--batches 22 23 32 48] [--out FILE]   # GPU machine

One workload process builds each cell as kda_bench.py does (vLLM's pages, the bounded gate, the
epilogue) and makes one call of cudelta.vllm_compat.fused_kda_decode and one of vLLM's op on it,
under `ncu --clock-control none` (ncu flushes the caches before each launch, so the state comes
from DRAM). What the table takes from ncu: grid and block, registers a thread, shared memory a
block, the blocks an SM can hold and what limits them, waves per SM, achieved occupancy, duration
and DRAM throughput. The numbers ncu prints are the evidence; nothing here is timed for a table.
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


def workload(heads: list[int], batches: list[int]) -> None:
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
            cell.call(vllm_compat.fused_kda_decode)(pool, sets[0])
            cell.call(op)(pool, sets[1 % cell.sets])
            torch.cuda.synchronize()
            del pool


UNITS = {"register/thread": "", "block": "", "byte/block": " B", "%": "%", "ns": " ns", "": ""}


def table(text: str, cells: list[tuple[int, int]]) -> str:
    """ncu's --csv --page details output -> one row a launch, in launch order: three a cell
    (cudelta's conv, cudelta's step, vLLM's op), labelled with `cells` in the workload's order."""
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
    heads = ["cell", "kernel", "grid", "block", *METRICS.values()]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for i, launch_id in enumerate(ids):
        H, B = cells[i // 3] if i // 3 < len(cells) else ("?", "?")
        row = launches[launch_id]
        out.append("| " + " | ".join([f"H={H} B={B}", *(str(row.get(h, "")) for h in heads[1:])]) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[12])
    ap.add_argument("--batches", type=int, nargs="+", default=[22, 23, 32, 48])
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.workload:
        workload(args.heads, args.batches)
        return 0
    cmd = [args.ncu, "--clock-control", "none", "-k", KERNELS, "--csv", "--page", "details",
           *(x for s in SECTIONS for x in ("--section", s)),
           sys.executable, "-P", str(Path(__file__).resolve()), "--workload",
           "--heads", *map(str, args.heads), "--batches", *map(str, args.batches)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    cells = [(H, B) for H in args.heads for B in args.batches]
    text = table(run.stdout, cells)
    print(text)
    if args.out:
        args.out.write_text(text + "\n\n" + run.stdout)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
