"""Decode-step speed of cudelta (auto and each variant) beside vLLM's packed decode kernels,
flash-linear-attention 0.6 and a device copy, in one process, one table per run.

    python benchmarks/fetch_vllm_ops.py            # once, on a machine with PyPI: vLLM's fla ops to .peers/
    python benchmarks/kernel_bench.py [--batches 1 4 8 32 128 256 1024] [--quick] [--variants auto warp ...]
                                      [--states float32 bfloat16] [--out DIR]

Each row is one configuration: op (gdn: Gated DeltaNet, one decay per head; kda: Kimi Delta
Attention, one decay per key channel, what Kimi-Linear runs), model shape (Qwen3-Next: H=16, HV=32;
Kimi-Linear: H=HV=32; K=V=128), state dtype, layout, and gates (raw a/b fused into the kernel, or
precomputed g/beta). Inputs are
what an engine holds: q, k, v sliced out of one packed bf16 projection row, a and b bf16 views,
A_log and dt_bias float32, the state pool updated in place at slots that change every call (the
pool far exceeds L2). Times are per call: a CUDA graph of 50 calls, best of 5 replays; eager is
`triton.testing.do_bench` (median) of the public Python call. Bytes = state read + write + q, k,
v, o; "% copy" compares with a device-to-device copy of the same state bytes. "auto padded" is auto
on the same pool laid out as vLLM allocates it (each slot's state in a page with the conv state and
padding: a slot stride larger than the state).

vLLM's kernels take only their own setting (vk layout, raw gates), so they are timed on those rows
(gdn: the Qwen3-Next packed decode; kda: the packed decode of vllm/models/kimi_k3); before timing,
each is run once on a copy of the pool beside cudelta, and the largest differences of the output
and of the updated state are printed under the table (the two must compute the same step). fla
0.6 keeps [N, HV, K, V] states and takes precomputed gates, so it runs on kv/pre rows (gathering
and scattering the pool around its call is NOT counted: it is timed on a dense batch of states).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # fetch_vllm_ops (also under `python -P`)
from fetch_vllm_ops import FLA_DIR, fetched_version  # noqa: E402

K = V = 128
SHAPES = {"qwen3-next": (16, 32), "kimi-linear": (32, 32)}
CALLS, REPLAYS = 50, 5


def graph_us(fn, sets: int, calls: int = CALLS) -> float:
    """Per-call time from a CUDA graph of `calls` calls (rotating over `sets` inputs), best of REPLAYS."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i % sets)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % sets)
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def eager_us(fn, sets: int) -> float:
    import triton.testing

    counter = [0]

    def call():
        counter[0] += 1
        fn(counter[0] % sets)

    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1000


def load_peers():
    peers = {}
    sys.path.insert(0, str(ROOT / ".peers" / "vllm_fla"))
    try:
        from vllm.third_party.flash_linear_attention.ops import fused_recurrent_gated_delta_rule_packed_decode

        peers["vllm-gdn"] = fused_recurrent_gated_delta_rule_packed_decode
        from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent_kda_packed_decode

        peers["vllm-kda"] = fused_recurrent_kda_packed_decode
    except ImportError as exc:
        print(f"kernel_bench: no vLLM ops ({exc}); run benchmarks/fetch_vllm_ops.py", file=sys.stderr)
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        peers["fla"] = fused_recurrent_gated_delta_rule
    except ImportError as exc:
        print(f"kernel_bench: no flash-linear-attention ({exc})", file=sys.stderr)
    return peers


def max_diff(fn_a, fn_b, pool, idx, out) -> tuple[float, float]:
    """Largest |difference| of the output and of the touched state slots, each fn run once on its own
    copy of the pool (fn(pool, idx) -> output)."""
    pa, pb = pool.clone(), pool.clone()
    oa = fn_a(pa, idx).float().reshape(out.shape)
    ob = fn_b(pb, idx).float().reshape(out.shape)
    ds = (pa[idx.long()].float() - pb[idx.long()].float()).abs().max().item()
    return (oa - ob).abs().max().item(), ds


def bench_row(op, shape, state_dtype, layout, gates, B, variants, peers, eager: bool) -> dict:
    import cudelta
    from cudelta._call import DecodeCall
    from cudelta.ops import run_kernel

    H, HV = SHAPES[shape]
    dev = "cuda"
    esize = torch.finfo(state_dtype).bits // 8
    state_bytes = HV * K * V * esize
    sets = max(2, min(16, math.ceil(512 * 2**20 / (B * state_bytes))))
    P = B * sets + 1  # slot 0 stays vLLM's null block
    gen = torch.Generator(device=dev).manual_seed(B)
    mixed = torch.randn(B, 2 * H * K + HV * V, device=dev, dtype=torch.bfloat16, generator=gen)
    q = mixed[:, : H * K].view(B, H, K)
    k = mixed[:, H * K: 2 * H * K].view(B, H, K)
    v = mixed[:, 2 * H * K:].view(B, HV, V)
    # The gates' channels: one per head (gdn), one per key channel (kda).
    C = K if op == "kda" else 1
    ab = torch.randn(B, HV * (C + 1), device=dev, dtype=torch.bfloat16, generator=gen)
    a, b = ab[:, :HV * C].view(B, HV, C).squeeze(-1), ab[:, HV * C:]
    A_log = torch.randn(HV, device=dev, generator=gen) * 0.5
    dt_bias = torch.randn(HV, C, device=dev, generator=gen).squeeze(-1)
    g = -torch.rand(B, HV, C, device=dev, generator=gen).squeeze(-1)
    beta = torch.rand(B, HV, device=dev, generator=gen)
    shape4 = (P, HV, K, V) if layout == "kv" else (P, HV, V, K)
    pool = (torch.randn(*shape4, device=dev, generator=gen) * 0.1).to(state_dtype)
    perm = torch.randperm(P - 1, device=dev, generator=gen).to(torch.int32) + 1
    idx = [perm[i * B:(i + 1) * B].contiguous() for i in range(sets)]
    out = torch.empty(B, HV, V, device=dev, dtype=torch.bfloat16)
    moved = 2 * B * state_bytes + 2 * (2 * B * H * K + 2 * B * HV * V)
    row = {"op": op, "shape": shape, "state": str(state_dtype).split(".")[-1], "layout": layout, "gates": gates, "B": B}

    src = pool[1: 1 + B * sets].view(sets, -1)
    dst = torch.empty_like(src)
    row["copy"] = graph_us(lambda i: dst[i].copy_(src[i]), sets)

    if gates == "raw":
        gargs = dict(g=None, beta=None, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    else:
        gargs = dict(g=g, beta=beta)

    def native(st, slots, vid):  # the op itself, a variant forced (cudelta.ops.run_kernel)
        run_kernel(DecodeCall(op, q, k, v, state=st, idx=slots, use_qk_l2norm=True, layout=layout,
                              invalid_slot="nonpositive", **gargs), out, vid)

    for name, vid in variants.items():
        fn = lambda i, vid=vid: native(pool, idx[i], vid)
        row[name] = graph_us(fn, sets)
    # The same steps on vLLM's page layout (MambaBase.bind_kv_cache: conv state, this state, padding
    # in each slot's page; tests/gpu/test_strided_pool_gpu.py), auto only: what an engine's own pool costs.
    pages = torch.empty(P, 4096 + state_bytes + 528, device=dev, dtype=torch.int8)
    padded = pages[:, 4096:4096 + state_bytes].view(state_dtype).view(P, *shape4[1:])
    padded.copy_(pool)
    fn = lambda i: native(padded, idx[i], -1)
    row["auto padded"] = graph_us(fn, sets)
    kw = dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias) if gates == "raw" else {}
    gg, bb = (None, None) if gates == "raw" else (g, beta)
    public = cudelta.kda_decode if op == "kda" else cudelta.gdn_decode
    call = lambda st, ix: public(q, k, v, gg, bb, st, ix, use_qk_l2norm=True, layout=layout,
                                 invalid_slot="nonpositive", **kw, out=out)
    if eager:
        row["auto eager"] = eager_us(lambda i: call(pool, idx[i]), sets)
    vllm = peers.get(f"vllm-{op}")
    if vllm is not None and layout == "vk" and gates == "raw":
        o4 = torch.empty(1 if op == "kda" else B, B if op == "kda" else 1, HV, V, device=dev, dtype=torch.bfloat16)
        if op == "kda":  # H == HV: vLLM's KDA decode has no grouped value heads
            a4, b3, bias = a[None], b[None], dt_bias.reshape(-1)
            peer = lambda st, ix: vllm(mixed, a4, b3, A_log, bias, None, st, ix, K ** -0.5, o4)[0]
        else:
            peer = lambda st, ix: vllm(mixed, a, b, A_log, dt_bias, K ** -0.5, st, o4, ix, True)[0]
        row["vllm max|do|"], row["vllm max|dstate|"] = max_diff(call, peer, pool, idx[0], out)
        fn = lambda i: peer(pool, idx[i])
        row["vllm"] = graph_us(fn, sets)
        if eager:
            row["vllm eager"] = eager_us(fn, sets)
    if "fla" in peers and op == "gdn" and layout == "kv" and gates == "pre" and state_dtype == torch.float32 \
            and B <= 256:
        states = [torch.randn(B, HV, K, V, device=dev, generator=gen) * 0.1 for _ in range(min(sets, 4))]
        fla_sets = len(states)
        q4, k4, v4, g4, b4 = q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None]
        fn = lambda i: peers["fla"](q4, k4, v4, g=g4, beta=b4, scale=K ** -0.5, initial_state=states[i],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        row["fla"] = graph_us(fn, fla_sets)
    row["GBps_auto"] = moved / row["auto"] / 1e3
    row["pct_copy_auto"] = 100 * row["copy"] / row["auto"]  # state bandwidth as a share of the copy's
    return row


def render(rows, device, cols) -> str:
    head = ["op", "shape", "state", "layout", "gates", "B", "copy µs", *[f"{c} µs" for c in cols], "auto GB/s",
            "auto % copy", "vLLM / auto"]
    lines = [f"Decode step (K=V=128, bf16 q/k/v/o, pool in place), CUDA graph of {CALLS} calls, best of "
             f"{REPLAYS}; eager: do_bench median; {device}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["op"], r["shape"], r["state"], r["layout"], r["gates"], str(r["B"]), f"{r['copy']:.1f}"]
        cells += [f"{r[c]:.1f}" if c in r else "" for c in cols]
        cells += [f"{r['GBps_auto']:.0f}", f"{r['pct_copy_auto']:.0f}%",
                  f"{r['vllm'] / r['auto']:.2f}x" if "vllm" in r else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 32, 128, 256, 1024])
    parser.add_argument("--quick", action="store_true", help="only the engine setting (vk, raw gates)")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        help="time only these cudelta variants (auto is always timed)")
    parser.add_argument("--states", nargs="+", choices=["float32", "bfloat16"],
                        help="only rows with this state dtype")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench: needs an NVIDIA GPU", file=sys.stderr)
        return 2
    from cudelta import _native

    st = _native.status()
    if not st.loaded:
        print(f"kernel_bench: native library not loaded: {st.reason}", file=sys.stderr)
        return 2
    variants = {"auto": -1}
    for name, vid in _native.variants().items():
        if args.variants and name not in args.variants:
            continue
        try:
            torch.ops.cudelta.select_variant(0, vid, 1 << 30)
            variants[name] = vid
        except RuntimeError:
            pass
    peers = load_peers()
    # (op, shape, state dtype, layout, gates, every variant?) — trimmed so one run stays under ~8 min:
    # every variant on the engine setting, auto alone elsewhere.
    f32, bf16 = torch.float32, torch.bfloat16
    configs = [("gdn", "qwen3-next", f32, "vk", "raw", True), ("gdn", "qwen3-next", bf16, "vk", "raw", True)]
    if not args.quick:
        configs += [("kda", "kimi-linear", f32, "vk", "raw", False), ("kda", "kimi-linear", bf16, "vk", "raw", False),
                    ("gdn", "kimi-linear", f32, "vk", "raw", False), ("gdn", "kimi-linear", bf16, "vk", "raw", False),
                    ("gdn", "qwen3-next", f32, "kv", "pre", True), ("gdn", "qwen3-next", bf16, "kv", "raw", False),
                    ("kda", "kimi-linear", f32, "kv", "pre", False), ("gdn", "qwen3-next", f32, "vk", "pre", False)]
    if args.states:
        configs = [c for c in configs if str(c[2]).split(".")[-1] in args.states]
    rows = []
    for op, shape, sd, layout, gates, all_variants in configs:
        vs = variants if all_variants else {"auto": -1}
        for B in args.batches:
            rows.append(bench_row(op, shape, sd, layout, gates, B, vs, peers, eager=B in (1, 256)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    cols = list(variants) + ["auto padded", "vllm", "fla", "auto eager", "vllm eager"]
    cols = [c for c in cols if any(c in r for r in rows)]
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; vLLM's Triton decode ({fetched_version(FLA_DIR)})"
    table = render(rows, device, cols)
    # bf16 vs fp32 state at the same setting, for the >= 1.8x target
    by = {(r["op"], r["shape"], r["layout"], r["gates"], r["B"], r["state"]): r["auto"] for r in rows}
    ratios = [f"B={k[4]} {k[0]} {k[1]} {k[2]}/{k[3]}: {by[k] / by[k[:5] + ('bfloat16',)]:.2f}x"
              for k in by if k[5] == "float32" and k[:5] + ("bfloat16",) in by and k[4] >= 256]
    if ratios:
        table += "\n\nbf16 state speed-up over fp32 (auto): " + "; ".join(ratios)
    worst: dict[tuple, list[float]] = {}
    for r in rows:
        if "vllm max|do|" in r:
            w = worst.setdefault((r["op"], r["shape"], r["state"]), [0.0, 0.0])
            w[0], w[1] = max(w[0], r["vllm max|do|"]), max(w[1], r["vllm max|dstate|"])
    if worst:
        table += ("\n\ncudelta vs vLLM on the same inputs, largest |output difference| / |state difference| over "
                  "the batches (bf16 output): " + "; ".join(f"{' '.join(k)}: {w[0]:.1e} / {w[1]:.1e}"
                                                          for k, w in worst.items()))
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernel_bench.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
        (args.out / "kernel_bench.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
