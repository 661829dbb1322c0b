"""How near the copy the step's own traffic can come: the yardstick behind "% of copy".

mtp_bench.py rates each step against a device copy of the same bytes (`copy_`: each byte read once,
written once, contiguous). The multi-token step moves its bytes in another pattern: a request's
state is read once from its start slot and written T times, to T checkpoint slots scattered over
vLLM's padded pool. This script times a kernel that does only that (`fan_out`, Triton: no math, no
inputs, no outputs; one program 8192 elements of a request's state, loaded once and stored to
each checkpoint slot) beside the copy and cudelta's step on the same cells, so that a shortfall
from the copy can be read as the pattern's or the kernels'.

Same cells and method as mtp_bench.py (its Cell: vLLM's padded pages, slot sets cycling over
>= 256 MiB, a CUDA graph of the calls, best of 5 replays, a one-element kernel after each call,
its time subtracted). Before timing, cudelta's step is checked against the PyTorch reference
(mtp_bench's check) and the mover against `expected_fan_out` (every byte of the check pool); a call
that disagrees stops the run. The mover is credited with the step's bytes (mtp_report.step_bytes,
q/k/v/z/out included, which it does not move), so that its % of copy is, if anything, high.

    # on the GPU machine, cudelta built there:
    python -P benchmarks/traffic_bound.py [--states bfloat16 float32] [--batches 32 128 512] [--tokens 1 2 4 8]
        [--heads 16/32] [--json rows.json]

One process; µs per call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mtp_bench as bench  # noqa: E402
import mtp_report as report  # noqa: E402

# Elements a mover program moves (16 KiB of bf16, 32 KiB of fp32) and its warps (--block, --warps).
MOVER_BLOCK = 8192
MOVER_WARPS = 8


def expected_fan_out(state, idx, start):
    """The pool after the mover: slot idx[n, t] holds what slot start[n] held before the call, for
    every request n and token t (a start slot that is also a checkpoint slot is read first)."""
    out = state.clone()
    out[idx.reshape(-1).long()] = state[start.long()].repeat_interleave(idx.shape[1], dim=0)
    return out


def start_slots(idx, acc):
    """The slot each request's step starts from: idx[n, acc[n] - 1]."""
    return idx.gather(1, (acc.long() - 1).unsqueeze(1)).squeeze(1).contiguous()


def mover(cell, block: int = MOVER_BLOCK, warps: int = MOVER_WARPS):
    """fan_out(state, idx, start): the Triton kernel, one launch of `block`-element programs."""
    import triton
    import triton.language as tl

    @triton.jit
    def fan_out_kernel(state, idx, start, slot_stride, T: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(0)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        src = tl.load(start + n).to(tl.int64)
        x = tl.load(state + src * slot_stride + offs)
        for t in tl.static_range(T):
            dst = tl.load(idx + n * T + t).to(tl.int64)
            tl.store(state + dst * slot_stride + offs, x)

    per_slot = cell.block // cell.itemsize
    assert per_slot % block == 0, (per_slot, block)

    def fan_out(state, idx, start):
        grid = (idx.shape[0], per_slot // block)
        fan_out_kernel[grid](state, idx, start, state.stride(0), T=idx.shape[1], BLOCK=block, num_warps=warps)

    return fan_out


def check_mover(cell, fan_out) -> None:
    """The mover on a check pool (the cell's slots, the null block, spare slots) against
    expected_fan_out: every byte of every page, conv states and padding included."""
    import torch

    pages, state = cell.pool(1 + cell.B * cell.T + bench.SPARE_SLOTS, random_bytes=True)
    idx = cell.slot_sets(1)[0]
    start = start_slots(idx, cell.acc)
    expected = pages.clone()
    view = cell.state_of(expected)
    view.copy_(expected_fan_out(view, idx, start))
    fan_out(state, idx, start)
    bench.sync()
    if not torch.equal(pages, expected):
        raise SystemExit(f"traffic_bound: {cell.state_name} B={cell.B} T={cell.T}: the mover moved the wrong bytes")


def check_step(cell, step) -> None:
    """cudelta's step against the reference: mtp_bench's check of a cell (outputs, every slot, every
    other byte of the pool); one that raises or disagrees stops the run."""
    def refuse(impl, reason):
        raise SystemExit(f"traffic_bound: {cell.state_name} B={cell.B} T={cell.T}: {impl} raised: {reason}")

    result = {"checks": []}
    bench.check_cell(cell, {report.CUDELTA: step}, refuse, result)
    (c,) = result["checks"]
    if not c["ok"]:
        raise SystemExit(f"traffic_bound: {cell.state_name} B={cell.B} T={cell.T}: cudelta disagrees with the "
                         f"reference: {c['detail']}")


def run(state: str, B: int, T: int, block: int = MOVER_BLOCK, warps: int = MOVER_WARPS) -> dict:
    from cudelta.vllm_compat import fused_gdn_decode_post_conv_mtp

    cell = bench.Cell(state, B, T, seed=1000 * B + T)
    step = cell.mtp_call(fused_gdn_decode_post_conv_mtp)
    check_step(cell, step)
    fan_out = mover(cell, block, warps)
    check_mover(cell, fan_out)
    bench.empty_cache()

    _, pool = cell.pool(1 + cell.sets * B * T, random_bytes=False)
    sets = cell.slot_sets(cell.sets)
    starts = [start_slots(s, cell.acc) for s in sets]
    clock = bench.SeparatedClock(cell.sets)

    def timed(fn):
        return round(clock.time(fn)[0], 1)

    us = {"cudelta": timed(lambda i: step(pool, sets[i])), "mover": timed(lambda i: fan_out(pool, sets[i], starts[i]))}
    del pool, sets, starts
    bench.empty_cache()
    us["copy"] = round(bench.copy_us(cell.moved), 1)
    return dict(state=state, B=B, T=T, us=us)


def row_text(row: dict) -> str:
    """One table row: the times and each as % of the copy; cudelta also as % of the mover."""
    us = row["us"]
    copy, mover_us, cd = us["copy"], us["mover"], us["cudelta"]
    return (f"| {row['state']} | {row['B']} | {row['T']} | {copy} | {mover_us} ({report.pct_of_copy(mover_us, copy):.0f}%) "
            f"| {cd} ({report.pct_of_copy(cd, copy):.0f}%) | {100 * mover_us / cd:.0f}% |")


HEADER = ("| state | B | T | copy µs | mover µs (% of copy) | cudelta µs (% of copy) | cudelta, % of the mover's speed |\n"
          "|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", nargs="+", default=bench.STATES)
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 128, 512])
    ap.add_argument("--tokens", nargs="+", type=int, default=bench.FULL["tokens"])
    ap.add_argument("--heads", default="16/32")
    ap.add_argument("--block", type=int, default=MOVER_BLOCK, help="elements a mover program moves")
    ap.add_argument("--warps", type=int, default=MOVER_WARPS, help="warps a mover program")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    bench.set_heads(*bench.parse_heads(args.heads))
    print(HEADER)
    rows = []
    for state in args.states:
        for B in args.batches:
            for T in args.tokens:
                row = run(state, B, T, args.block, args.warps)
                rows.append(row)
                print(row_text(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
