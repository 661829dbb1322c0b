"""Decode-step bandwidth of every cudelta variant, beside a device copy and peers, in one run.

Shape: Qwen3-Next / Kimi-Linear style GDN decode (H=16, HV=32, K=V=128), bf16 inputs, fp32 state
pool updated in place; the `kda` column is the same step with a per-channel decay (auto variant). Each call touches a different set of slots (the pool is far larger than
L2), as in serving; calls are timed as CUDA-graph replays (what engines do) and eagerly.

    python benchmarks/kernel_bench.py [--batches 1 8 32 256 1024] [--out DIR]

Prints a Markdown table; with --out also writes kernel_bench.json and kernel_bench.md there.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

H, HV, K, V = 16, 32, 128, 128
STATE_BYTES = HV * K * V * 4  # per request, fp32


def graph_time_us(fn, calls: int, replays: int = 20) -> float:
    """Mean time of one call, from a CUDA graph holding `calls` calls, replayed `replays` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def eager_time_us(fn, calls: int, rounds: int = 5) -> float:
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        for i in range(calls):
            fn(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (rounds * calls)


def sets_for(batch: int) -> int:
    # Enough distinct slot sets that consecutive calls never find their state in L2 (50-60 MB).
    return max(2, min(16, math.ceil(512 * 2**20 / (batch * STATE_BYTES))))


def bench_batch(batch: int, variants: dict, with_fla: bool) -> dict:
    dev = "cuda"
    sets = sets_for(batch)
    P = batch * sets
    gen = torch.Generator(device=dev).manual_seed(batch)
    q = torch.randn(batch, H, K, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, H, K, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, HV, V, device=dev, dtype=torch.bfloat16, generator=gen)
    g = -torch.rand(batch, HV, device=dev, generator=gen)
    beta = torch.rand(batch, HV, device=dev, generator=gen)
    pool = torch.randn(P, HV, K, V, device=dev, generator=gen) * 0.1
    perm = torch.randperm(P, device=dev, generator=gen).to(torch.int32)
    idx = [perm[i * batch:(i + 1) * batch].contiguous() for i in range(sets)]
    moved = 2 * batch * STATE_BYTES  # one read and one write of each state
    row = {"batch": batch, "state_MB_per_call": moved / 2 / 1e6}

    src = pool.view(sets, -1)
    dst = torch.empty_like(src)
    copy_us = graph_time_us(lambda i: dst[i].copy_(src[i]), sets)
    row["copy"] = {"us": copy_us, "GBps": moved / copy_us / 1e3}
    # The same bytes read and written back in place: the access pattern of the decode step.
    inplace_us = graph_time_us(lambda i: src[i].mul_(1.0), sets)
    row["inplace"] = {"us": inplace_us, "GBps": moved / inplace_us / 1e3}

    scale = K ** -0.5
    for name, vid in variants.items():
        fn = lambda i, vid=vid: torch.ops.cudelta.gdn_decode(q, k, v, g, beta, pool, idx[i], scale, True, vid)
        us = graph_time_us(fn, sets)
        row[name] = {"us": us, "GBps": moved / us / 1e3, "eager_us": eager_time_us(fn, sets)}

    # KDA: the same step with a per-channel decay, auto variant.
    gk = -torch.rand(batch, HV, K, device=dev, generator=gen)
    fn = lambda i: torch.ops.cudelta.kda_decode(q, k, v, gk, beta, pool, idx[i], scale, True, -1)
    us = graph_time_us(fn, sets)
    row["kda"] = {"us": us, "GBps": moved / us / 1e3, "eager_us": eager_time_us(fn, sets)}

    if with_fla:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        states = [pool[ix.long()] for ix in idx]  # FLA reads an initial state and writes a new one
        q4, k4, v4 = q[:, None], k[:, None], v[:, None]
        g4, b4 = g[:, None], beta[:, None]
        fn = lambda i: fused_recurrent_gated_delta_rule(q4, k4, v4, g=g4, beta=b4, scale=scale,
                                                        initial_state=states[i], output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
        us = graph_time_us(fn, sets)
        row["fla"] = {"us": us, "GBps": moved / us / 1e3, "eager_us": eager_time_us(fn, sets)}
    return row


def check_variants_agree(variants: dict) -> None:
    """Refuse to time kernels that disagree: the same step through each variant must match."""
    batch, P = 33, 80
    gen = torch.Generator(device="cuda").manual_seed(7)
    args = [torch.randn(batch, H, K, device="cuda", generator=gen).bfloat16(),
            torch.randn(batch, H, K, device="cuda", generator=gen).bfloat16(),
            torch.randn(batch, HV, V, device="cuda", generator=gen).bfloat16(),
            -torch.rand(batch, HV, device="cuda", generator=gen), torch.rand(batch, HV, device="cuda", generator=gen)]
    pool = torch.randn(P, HV, K, V, device="cuda", generator=gen)
    idx = torch.randperm(P, device="cuda", generator=gen)[:batch].to(torch.int32)
    results = []
    for vid in variants.values():
        st = pool.clone()
        out = torch.ops.cudelta.gdn_decode(*args, st, idx, K ** -0.5, True, vid)
        results.append((out.float(), st))
    for out, st in results[1:]:
        assert (st - results[0][1]).abs().max() <= 1e-5 * results[0][1].abs().max(), "variants disagree (state)"
        assert (out - results[0][0]).abs().max() <= 2e-2 * results[0][0].abs().max(), "variants disagree (out)"


def render(rows: list[dict], names: list[str], device: str) -> str:
    head = ["B", "state MB", "copy GB/s", "in-place GB/s"]
    for n in names:
        head += [f"{n} µs", f"{n} GB/s", f"{n} % best copy"]
    head += ["best vs fla"] if "fla" in names else []
    lines = [f"GDN decode, H={H} HV={HV} K=V={K}, bf16 in, fp32 state pool in place, CUDA-graph replay; {device}",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["batch"]), f"{r['state_MB_per_call']:.0f}", f"{r['copy']['GBps']:.0f}",
                 f"{r['inplace']['GBps']:.0f}"]
        for n in names:
            best_copy = max(r["copy"]["GBps"], r["inplace"]["GBps"])
            cells += [f"{r[n]['us']:.1f}", f"{r[n]['GBps']:.0f}", f"{100 * r[n]['GBps'] / best_copy:.0f}%"]
        if "fla" in names:
            best = min(r[n]["us"] for n in names if n not in ("fla", "kda"))
            cells.append(f"{r['fla']['us'] / best:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Eager (one Python call each, no graph), µs per call:", ""]
    lines += ["| B | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for r in rows:
        lines.append(f"| {r['batch']} | " + " | ".join(f"{r[n]['eager_us']:.1f}" for n in names) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 256, 1024])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention even if installed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench: needs an NVIDIA GPU", file=sys.stderr)
        return 2
    from cudelta import _native

    st = _native.status()
    if not st.loaded:
        print(f"kernel_bench: native library not loaded: {st.reason}", file=sys.stderr)
        return 2
    variants = {}
    for name, vid in _native.VARIANTS.items():
        try:
            torch.ops.cudelta.select_variant(0, vid, 1 << 30)
            variants[name] = vid
        except RuntimeError:
            pass
    check_variants_agree(variants)
    with_fla = not args.no_fla
    if with_fla:
        try:
            import fla  # noqa: F401  (flash-linear-attention, the peer)
        except ImportError:
            with_fla = False
    rows = [bench_batch(b, variants, with_fla) for b in args.batches]
    names = list(variants) + ["kda"] + (["fla"] if with_fla else [])
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    table = render(rows, names, device)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernel_bench.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
        (args.out / "kernel_bench.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
