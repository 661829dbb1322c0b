"""Where cudelta's Kimi K3 KDA layer step (cudelta.vllm_compat.fused_kda_decode) spends its time: its
two kernels apart and together, beside vLLM's fused op, on kda_bench.py's cells and method (vLLM's
pages, slot sets cycling over >= 256 MiB, a CUDA graph with a one-element kernel after each call,
its time subtracted). A diagnostic: kda_bench.py checks the whole step against the reference; the
parts here run the same kernels on the same tensors and are not checked again.

    python -P benchmarks/kda_parts.py [--heads 12 48] [--batches 1 8 32 128 512]   # GPU machine

Columns (µs): the whole drop-in; vLLM's op; cudelta's conv alone (fp32 weight [3, 4, H*128] as vLLM
keeps it: the kernel's scalar path, a channel a thread) and with the weight in bf16 [dim, 4] (its
vector path, four channels a thread: what the conv would cost were it not for the fp32 taps); the
step alone with the epilogue (the conv's outputs already there) and without it (one token, the
warp kernels).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kda_bench as kb  # noqa: E402
import mtp_bench as mb  # noqa: E402

COLUMNS = ["drop-in", "vLLM op", "conv fp32 w", "conv bf16 w", "step+norm", "step"]


def parts(cell: kb.Cell, vllm_op):
    import torch
    from cudelta import conv, vllm_compat
    from cudelta.ops import _decode

    H, D = cell.H, kb.D
    conv_out = torch.empty(cell.x.shape, dtype=cell.x.dtype, device=cell.x.device)
    w_bf16 = cell.weight.permute(0, 2, 1).reshape(3 * H * D, kb.WIDTH).to(torch.bfloat16).contiguous()

    def step(p, idx, epilogue):
        _decode(vllm_compat.kda_step_call(H, conv_out, cell.raw_g, cell.raw_beta, cell.A_log, cell.dt_bias, idx,
                                          p.state, cell.out, kb.LOWER_BOUND, cell.z if epilogue else None,
                                          cell.norm_weight if epilogue else None, kb.NORM_EPS))

    calls = {
        "drop-in": cell.call(vllm_compat.fused_kda_decode),
        "conv fp32 w": lambda p, idx: conv.run_checked(cell.x, p.conv, cell.weight, None, "silu", idx, None, None, 0,
                                                       conv_out),
        "conv bf16 w": lambda p, idx: conv.run_checked(cell.x, p.conv, w_bf16, None, "silu", idx, None, None, 0,
                                                       conv_out),
        "step+norm": lambda p, idx: step(p, idx, True),
        "step": lambda p, idx: step(p, idx, False),
    }
    if vllm_op is not None:
        calls["vLLM op"] = cell.call(vllm_op)
    return calls


def main(argv=None) -> int:
    import tempfile

    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[12, 48])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        so, why = mb.unpack_cuda_op(mb.cuda_op_archive(None), Path(tmp))
        op, why = kb.load_vllm_kda(so, why)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; vLLM's op: {why or 'loaded'}\n")
    for H in args.heads:
        print(f"**H={H}** (µs; one process, best of 5 graph replays)\n")
        print("| B | " + " | ".join(COLUMNS) + " |")
        print("|---|" + "---|" * len(COLUMNS))
        for B in args.batches:
            cell = kb.Cell(H, B, seed=1000 * H + B)
            pool = cell.pool(1 + cell.sets * B, random_bytes=False)
            sets = cell.slot_sets(cell.sets)
            clock = mb.SeparatedClock(cell.sets)
            row = {name: clock.time(lambda i, call=call: call(pool, sets[i]))[0]
                   for name, call in parts(cell, op).items()}
            print(f"| {B} | " + " | ".join(f"{row[c]:.1f}" if c in row else "—" for c in COLUMNS) + " |", flush=True)
            del pool
            torch.cuda.empty_cache()
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
