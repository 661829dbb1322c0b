"""The one-token step whose output is out_proj's static-FP8 input, as vLLM 0.34's Qwen3.5 NVIDIA layers
run it without speculative decoding: vLLM's Triton packed decode into a bf16 buffer, then its Triton
gated RMSNorm with the FP8 output (fused_gdn_gated_rms_norm(..., scale=)), against cudelta's one call
(gdn_decode with the epilogue and output_scale) and cudelta's same call writing bf16 (what the FP8
output costs over it).

    python benchmarks/fetch_vllm_ops.py --cache /tmp/vllm-wheel --no-cuda-op   # once, where PyPI is
    # on the GPU machine (carry [".peers/vllm_fla"]), cudelta built there:
    python -P benchmarks/fp8_t1_bench.py [--states bfloat16 float32] [--batches 1 4 8 32 128 512]
        [--heads 16/32] [--json FILE]

Method: mtp_bench's Cell and clock. The pool is vLLM's padded pages, the state comes from DRAM
(slot sets cycling over >= 256 MiB), each call is followed by a one-element kernel whose own time
is subtracted, CUDA graph best of 5. One process: medians over processes are mtp_bench's, not this
script's. Inputs as vLLM's layer holds them: q, k, v and z are views of the qkvz projection's rows,
raw gates a and b, slot 0 the null block. The scale is 0.02, which keeps these outputs below 448.

Before timing, each call runs on its own copy of a check pool and is compared with cudelta's
PyTorch reference run on the GPU: static_fp8 of the epilogue's output. Each FP8 value must be within
one e4m3 step of the reference's, because a bf16 ulp before the rounding can move it one step. Every
written slot's state must be within mtp_bench's tolerance, and every other byte of the pages must be
unchanged. A call that disagrees stops the run. `--device cpu` is a dry run of the plumbing: the
cudelta calls run the reference, there is no vLLM column, and the times are wall times.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mtp_bench as bench  # noqa: E402
from fetch_vllm_ops import FLA_DIR, fetched_version  # noqa: E402

FP8_SCALE = 0.02
E4M3_STEP = 1 / 8  # e4m3's 3 mantissa bits: neighbours at most an eighth of the larger apart
E4M3_SUBNORMAL = 2.0 ** -9  # its step below 2^-6
IMPLS = ("cudelta bf16", "cudelta fp8", "vLLM fp8")


def load_vllm():
    """(packed decode, gated norm) from .peers/vllm_fla, or the reason they cannot be had."""
    sys.path.insert(0, str(FLA_DIR))
    try:
        from vllm.models.qwen3_5.nvidia.ops.fused_gdn_gated_norm import fused_gdn_gated_rms_norm
        from vllm.third_party.flash_linear_attention.ops import fused_recurrent_gated_delta_rule_packed_decode
    except Exception as exc:  # noqa: BLE001  (not fetched, an older fetch without the norm, no GPU)
        return None, f"{type(exc).__name__}: {exc}"
    return (fused_recurrent_gated_delta_rule_packed_decode, fused_gdn_gated_rms_norm), None


def calls(cell, vllm, scale, out8) -> dict:
    """name -> call(state, idx [B, 1]) -> its output, the three writing one token a request."""
    import torch

    import cudelta

    kw = dict(a=cell.a, b=cell.b, A_log=cell.A_log, dt_bias=cell.dt_bias, scale=bench.SCALE, use_qk_l2norm=True,
              layout="vk", invalid_slot="nonpositive", output_gate=cell.z, norm_weight=cell.norm_weight,
              norm_eps=bench.NORM_EPS, gate_activation="silu")

    def cudelta_call(out, **extra):
        return lambda state, idx: cudelta.gdn_decode(cell.q, cell.k, cell.v, None, None, state, idx[:, 0], out=out,
                                                     **kw, **extra)

    named = {"cudelta bf16": cudelta_call(cell.out), "cudelta fp8": cudelta_call(out8, output_scale=scale)}
    if vllm is not None:
        decode, norm = vllm
        B, HV, V = cell.B, bench.HV, bench.V
        core = torch.empty(B, 1, HV, V, device=bench.DEVICE, dtype=torch.bfloat16)

        def vllm_call(state, idx):
            decode(cell.mixed_qkv, cell.a, cell.b, cell.A_log, cell.dt_bias, bench.SCALE, state, core, idx[:, 0],
                   use_qk_l2norm_in_kernel=True)
            norm(x=core.view(B, HV * V), z=cell.z.flatten(1), weight=cell.norm_weight, out=out8.view(B, HV * V),
                 eps=bench.NORM_EPS, num_v_heads=HV, head_v_dim=V, norm_before_gate=True, activation="silu",
                 scale=scale)
            return out8

        named["vLLM fp8"] = vllm_call
    return named


def fp8_excess(actual, expected) -> float:
    """The largest |difference| over its allowance (one e4m3 step of the larger value); NaN is inf."""
    import torch

    a, e = actual.float(), expected.float()
    d = (a - e).abs()
    if torch.isnan(d).any():
        return float("inf")
    return float((d / (E4M3_STEP * torch.maximum(a.abs(), e.abs()) + E4M3_SUBNORMAL)).max())


def check_all(cell, named: dict, scale) -> list[str]:
    """What disagrees with the reference, one line each (empty: every call computes the step)."""
    import torch

    from cudelta.reference import gdn_decode_reference

    base_pages, base_state = cell.pool(1 + cell.B + bench.SPARE_SLOTS, random_bytes=True)
    idx = cell.slot_sets(1)[0]
    ref_pages = base_pages.clone()
    ref_state = ref_pages[:, bench.CONV_BYTES:bench.CONV_BYTES + cell.block].view(cell.dtype).view(base_state.shape)
    kw = dict(a=cell.a, b=cell.b, A_log=cell.A_log, dt_bias=cell.dt_bias, scale=bench.SCALE, use_qk_l2norm=True,
              layout="vk", invalid_slot="nonpositive", output_gate=cell.z, norm_weight=cell.norm_weight,
              norm_eps=bench.NORM_EPS, gate_activation="silu")
    ref_bf16 = gdn_decode_reference(cell.q, cell.k, cell.v, None, None, ref_state.clone(), idx[:, 0], **kw)
    ref8 = gdn_decode_reference(cell.q, cell.k, cell.v, None, None, ref_state, idx[:, 0], output_scale=scale, **kw)
    wrong = []
    for name, call in named.items():
        pages = base_pages.clone()
        state = pages[:, bench.CONV_BYTES:bench.CONV_BYTES + cell.block].view(cell.dtype).view(base_state.shape)
        got = call(state, idx)
        bench.sync()
        if got.dtype == torch.float8_e4m3fn:
            ratio = fp8_excess(got, ref8)
        else:
            ratio = bench.excess(got, ref_bf16, bench.TOL_OUT)[1]
        _, st_ratio, problem = bench.compare_pools(cell, pages, state, ref_pages, ref_state, base_pages,
                                                   idx[:, 0].long())
        if ratio > 1 or st_ratio > 1 or problem:
            wrong.append(f"{name}: out {ratio:.3g}x its allowance, state {st_ratio:.3g}x{'; ' + problem if problem else ''}")
        del pages, state
    return wrong


def run(state: str, B: int, vllm) -> dict:
    import torch

    cell = bench.Cell(state, B, 1, seed=B)
    scale = torch.tensor([FP8_SCALE], device=bench.DEVICE)
    out8 = torch.empty(B, bench.HV, bench.V, device=bench.DEVICE, dtype=torch.float8_e4m3fn)
    named = calls(cell, vllm, scale, out8)
    wrong = check_all(cell, named, scale)
    if wrong:  # a call that does not compute the step is not timed
        raise SystemExit(f"fp8_t1_bench: {state} B={B}: " + "; ".join(wrong))
    bench.empty_cache()
    _, pool = cell.pool(1 + cell.sets * B, random_bytes=False)
    sets = cell.slot_sets(cell.sets)
    n_calls = max(bench.MIN_CALLS, cell.sets)
    between = torch.zeros(1, device=bench.DEVICE)
    gap, _ = bench.time_call(lambda i: between.add_(1), cell.sets, n_calls)
    us = {}
    for name, call in named.items():
        def step(i, call=call):
            call(pool, sets[i])
            between.add_(1)

        us[name] = round(bench.time_call(step, cell.sets, n_calls)[0] - gap, 2)
    del pool, sets
    bench.empty_cache()
    return dict(state=state, B=B, us=us)


def row_text(row: dict) -> str:
    us = row["us"]
    cells = [f"{us[n]:.1f}" if n in us else "-" for n in IMPLS]
    fp8, peer = us.get("cudelta fp8"), us.get("vLLM fp8")
    ratio = f"{peer / fp8:.2f}x" if fp8 and peer else "-"
    extra = f"{us['cudelta fp8'] - us['cudelta bf16']:+.1f}" if fp8 and "cudelta bf16" in us else "-"
    return f"| {row['state']} | {row['B']} | " + " | ".join(cells) + f" | {ratio} | {extra} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", nargs="+", default=bench.STATES)
    ap.add_argument("--batches", nargs="+", type=int, default=bench.FULL["batches"])
    ap.add_argument("--heads", default="16/32", help="H/HV (vLLM's MTP op and this take HV / H in 1, 2, 3, 4, 8)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--dram-mib", type=int, default=bench.DRAM_BYTES >> 20, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    h, hv = (int(x) for x in args.heads.split("/"))
    bench.set_heads(h, hv)
    bench.DEVICE, bench.DRAM_BYTES = args.device, args.dram_mib << 20
    vllm, why = load_vllm() if args.device == "cuda" else (None, "the CPU dry run has no vLLM")
    print(f"fp8_t1_bench: heads {h}/{hv}, K=V=128, T=1, bf16 q/k/v/z, scale {FP8_SCALE}; vLLM "
          f"{fetched_version(FLA_DIR) if vllm else 'not loaded: ' + why}. µs per call, one process.")
    print("| state | B | " + " | ".join(IMPLS) + " | vLLM ÷ cudelta fp8 | fp8 - bf16 |")
    print("|---" * (len(IMPLS) + 4) + "|")
    rows = []
    for state in args.states:
        for B in args.batches:
            rows.append(run(state, B, vllm))
            print(row_text(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
