"""Where the one-token (T=1) step's extra time goes, cudelta alone: the issue's target compares vLLM's
T=1 call with the epilogue against cudelta's T=1 decode without it, and the two differ in more than
the epilogue. Five calls of the same tokens on the same DRAM-resident pool (mtp_bench's Cell, slot
sets cycling over >= 256 MiB, a one-element kernel after each call, its time subtracted), so that
each step adds one thing:

    alone          gdn_decode, idx [N] in place (mtp_bench's "T=1 decode alone")
    alone+epi      the same with the gated RMSNorm epilogue
    contract       idx [N, 1], cu_seqlens, num_accepted_tokens (vLLM's call), no epilogue
    contract+epi   vLLM's call: the contract and the epilogue
    compat         the same through cudelta.vllm_compat (vLLM's signature)

It prints each call's time and the kernels of the compat call with their GPU times (torch.profiler,
eager; a kernel launched early by programmatic dependent launch counts its wait for the one before
it). Before timing, each call is checked against cudelta's PyTorch reference (mtp_bench's check:
outputs, every slot, every other byte of the pool); a call that disagrees stops the run.

    # on the GPU machine, cudelta built there:
    python -P benchmarks/t1_epilogue_cost.py [--states bfloat16 float32] [--batches 1 4 8 32 128 512]
    python -P benchmarks/t1_epilogue_cost.py --heads 4/8 --states bfloat16 --batches 32   # another head shape
    python -P benchmarks/t1_epilogue_cost.py ... --slots consecutive   # each call's slots side by side

--slots: the timed calls' slot sets drawn at random over the pool (mtp_bench's, the default) or
consecutive (Cell.slot_sets(..., consecutive=True)): the same pool and bytes, the pages of a call's
slots adjacent.

One process, µs per call; for the issue's tables use mtp_bench.py (medians of 3 processes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mtp_bench as bench  # noqa: E402


def calls(cell) -> dict:
    import cudelta
    from cudelta.vllm_compat import fused_gdn_decode_post_conv_mtp

    kw = dict(a=cell.a, b=cell.b, A_log=cell.A_log, dt_bias=cell.dt_bias, scale=bench.SCALE, use_qk_l2norm=True,
              layout="vk", invalid_slot="nonpositive", out=cell.out)
    epi = dict(output_gate=cell.z, norm_weight=cell.norm_weight, norm_eps=bench.NORM_EPS, gate_activation="silu")
    contract = dict(cu_seqlens=cell.cu_seqlens, num_accepted_tokens=cell.acc)
    q, k, v = cell.q, cell.k, cell.v

    def decode(**extra):
        def call(state, idx):
            return cudelta.gdn_decode(q, k, v, None, None, state, idx if "cu_seqlens" in extra else idx[:, 0], **kw,
                                      **extra)
        return call

    return {"alone": decode(), "alone+epi": decode(**epi), "contract": decode(**contract),
            "contract+epi": decode(**contract, **epi), "compat": cell.mtp_call(fused_gdn_decode_post_conv_mtp)}


EPILOGUE = {"alone": False, "alone+epi": True, "contract": False, "contract+epi": True, "compat": True}


def check_all(cell) -> list[dict]:
    """Each call on its own copy of a check pool (the cell's slots, the null block, spare slots)
    against cudelta's PyTorch reference with or without the epilogue: mtp_bench's check (outputs,
    every slot's state, every other byte of the pool unchanged)."""
    base_pages, _ = cell.pool(1 + cell.B + bench.SPARE_SLOTS, random_bytes=True)
    idx = cell.slot_sets(1)[0]
    refs, rows = {}, []
    for name, call in calls(cell).items():
        epilogue = EPILOGUE[name]
        if epilogue not in refs:
            ref_pages = base_pages.clone()
            refs[epilogue] = (cell.reference(cell.state_of(ref_pages), idx, epilogue), ref_pages)
        rows.append(bench.check(cell, name, call, idx, base_pages, *refs[epilogue], idx.reshape(-1).long()))
    return rows


def kernel_times(call, pool, sets, between) -> dict:
    """Median GPU time of each kernel of `call` over 20 eager calls."""
    import torch

    for i in range(3):
        call(pool, sets[i % len(sets)])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(20):
            call(pool, sets[i % len(sets)])
            between.add_(1)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "elementwise" not in e.name:
            name = e.name.replace("void ", "").replace("cudelta::", "").replace("(anonymous namespace)::", "")
            times.setdefault(name.split("(")[0][:90], []).append(e.device_time)
    return {name: round(sorted(t)[len(t) // 2], 1) for name, t in times.items()}


def run(state: str, B: int, slots: str = "random") -> dict:
    import torch

    cell = bench.Cell(state, B, 1, seed=B)
    wrong = [c for c in check_all(cell) if not c["ok"]]
    if wrong:  # a call that does not compute the step is not timed
        raise SystemExit(f"t1_epilogue_cost: {state} B={B}: " + "; ".join(f"{c['impl']}: {c['detail']}" for c in wrong))
    bench.empty_cache()
    _, pool = cell.pool(1 + cell.sets * B, random_bytes=False)
    sets = cell.slot_sets(cell.sets, consecutive=slots == "consecutive")
    clock, timed = bench.SeparatedClock(cell.sets), calls(cell)
    us = {name: round(clock.time(lambda i, call=call: call(pool, sets[i]))[0], 1) for name, call in timed.items()}
    row = dict(state=state, B=B, slots=slots, us=us, kernels=kernel_times(timed["compat"], pool, sets, clock.between))
    del pool, sets
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", nargs="+", default=bench.STATES)
    ap.add_argument("--batches", nargs="+", type=int, default=bench.FULL["batches"])
    ap.add_argument("--heads", type=bench.parse_heads, default=(bench.H, bench.HV), metavar="H/HV",
                    help=f"q/k heads / v heads, default {bench.H}/{bench.HV} (as mtp_bench.py --heads)")
    ap.add_argument("--slots", choices=bench.SLOT_ORDERS, default="random",
                    help="the timed calls' slot sets: drawn at random over the pool, or side by side")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    bench.set_heads(*args.heads)
    rows = []
    names = list(EPILOGUE)
    print(f"H={bench.H}, HV={bench.HV}, {args.slots} slots")
    print("| state | B | " + " | ".join(names) + " | kernels of compat (µs) |")
    print("|---" * (len(names) + 3) + "|")
    for state in args.states:
        for B in args.batches:
            row = run(state, B, args.slots)
            rows.append(row)
            kernels = "; ".join(f"{k} {t}" for k, t in row["kernels"].items())
            print(f"| {state} | {B} | " + " | ".join(str(row["us"][n]) for n in names) + f" | {kernels} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
