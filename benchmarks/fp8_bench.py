"""The GDN decode step whose output is out_proj's static-FP8 input: cudelta's one call (the epilogue with
output_scale) beside the two ways vLLM 0.34's Qwen3.5 layers make that input.

- vLLM MTP + quant, any T (speculative decoding): its CUDA MTP op writes the normed output in bf16,
  then out_proj's FP8 linear quantizes its input with torch.ops._C.static_scaled_fp8_quant (both
  from vLLM's ops library, .peers/cuda_op).
- vLLM T=1 + norm-quant, T=1 only (the Qwen3.5 NVIDIA layer without speculative decoding): its
  Triton packed decode into a bf16 buffer, then its Triton gated RMSNorm with the FP8 output,
  fused_gdn_gated_rms_norm(..., scale=) (.peers/vllm_fla).
- cudelta fp8: cudelta.gdn_decode with vLLM's MTP contract (cu_seqlens, idx [B, T],
  num_accepted_tokens), the epilogue and output_scale; cudelta bf16: the same call without the
  scale, which shows what the FP8 output costs.

    python benchmarks/fetch_vllm_ops.py --cache /tmp/vllm-wheel    # once, where PyPI is reachable
    # on the GPU machine (carry [".peers/cuda_op", ".peers/vllm_fla"]), cudelta built there:
    python -P benchmarks/fp8_bench.py [--states bfloat16 float32] [--batches 1 4 8 32 128 512]
        [--tokens 1 2 4 8] [--heads 16/32] [--json FILE]

Method: mtp_bench's Cell and its time_cell. The pool is vLLM's padded pages, and the state comes
from DRAM (slot sets cycling over >= 256 MiB). Each call is followed by a one-element kernel whose
own time is subtracted, and timed as a CUDA graph, best of 5. One process: medians over processes are
mtp_bench's, not this script's. Inputs are as vLLM's layer holds them: q, k, v and z are views of
the qkvz projection's rows, raw gates a and b, num_accepted_tokens in 1..T, slot 0 the null block.
The FP8 scale is 0.02, which keeps these outputs below 448.

Before timing, each call runs on its own copy of a check pool and is compared with cudelta's
PyTorch reference run on the GPU (static_fp8 of the epilogue's output):
- each FP8 value must be within one e4m3 step of the reference's, because a bf16 ulp before the
  rounding can move it one step;
- every state slot the step writes must be within mtp_bench's tolerance;
- every other byte of the pages must be unchanged.

A call that disagrees stops the run. `--device cpu` is a dry run of the plumbing: the cudelta
calls run the reference, there are no vLLM columns, and the times are wall times.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mtp_bench as bench  # noqa: E402
from fetch_vllm_ops import CUDA_OP_DIR, FLA_DIR, fetched_version  # noqa: E402

FP8_SCALE = 0.02
CUDELTA_BF16, CUDELTA_FP8 = "cudelta bf16", "cudelta fp8"
VLLM_MTP, VLLM_T1 = "vLLM MTP + quant", "vLLM T=1 + norm-quant"
IMPLS = (CUDELTA_BF16, CUDELTA_FP8, VLLM_MTP, VLLM_T1)


def load_vllm_t1():
    """(packed decode, gated norm) from .peers/vllm_fla, or (None, why not)."""
    sys.path.insert(0, str(FLA_DIR))
    try:
        from vllm.models.qwen3_5.nvidia.ops.fused_gdn_gated_norm import fused_gdn_gated_rms_norm
        from vllm.third_party.flash_linear_attention.ops import fused_recurrent_gated_delta_rule_packed_decode
    except Exception as exc:  # noqa: BLE001  (not fetched, a fetch older than the norm module, no GPU)
        return None, bench.short(exc)
    return (fused_recurrent_gated_delta_rule_packed_decode, fused_gdn_gated_rms_norm), ""


def load_vllm_mtp(folder: Path):
    """(MTP op, static_scaled_fp8_quant) from vLLM's ops library, or (None, why not)."""
    so, reason = bench.unpack_cuda_op(bench.cuda_op_archive(None), folder)
    mtp, reason = bench.load_vllm_cuda(so, reason)
    if mtp is None:
        return None, reason
    quant, reason = bench.load_vllm_cuda(so, reason, op="static_scaled_fp8_quant")
    return ((mtp, quant), "") if quant is not None else (None, reason)


def calls(cell, vllm_mtp, vllm_t1, scale, out8) -> dict:
    """name -> call(state, idx [B, T]) -> its output (cell.out in bf16, or out8)."""
    import torch

    import cudelta

    kw = cell.mtp_kwargs()

    def cudelta_call(out, **extra):
        return lambda state, idx: cudelta.gdn_decode(cell.q, cell.k, cell.v, None, None, state, idx, out=out, **kw,
                                                     **extra)

    named = {CUDELTA_BF16: cudelta_call(cell.out), CUDELTA_FP8: cudelta_call(out8, output_scale=scale)}
    L, HV, V = cell.B * cell.T, bench.HV, bench.V
    if vllm_mtp is not None:
        mtp, quant = vllm_mtp
        step = cell.mtp_call(mtp)

        def mtp_then_quant(state, idx):
            step(state, idx)
            quant(out8.view(L, HV * V), cell.out.view(L, HV * V), scale)
            return out8

        named[VLLM_MTP] = mtp_then_quant
    if vllm_t1 is not None and cell.T == 1:
        decode, norm = vllm_t1
        core = torch.empty(cell.B, 1, HV, V, device=bench.DEVICE, dtype=torch.bfloat16)

        def t1_then_norm(state, idx):
            decode(cell.mixed_qkv, cell.a, cell.b, cell.A_log, cell.dt_bias, bench.SCALE, state, core, idx[:, 0],
                   use_qk_l2norm_in_kernel=True)
            norm(x=core.view(L, HV * V), z=cell.z.flatten(1), weight=cell.norm_weight, out=out8.view(L, HV * V),
                 eps=bench.NORM_EPS, num_v_heads=HV, head_v_dim=V, norm_before_gate=True, activation="silu",
                 scale=scale)
            return out8

        named[VLLM_T1] = t1_then_norm
    return named


def fp8_excess(actual, expected) -> tuple[float, float]:
    """(max |difference|, the largest |difference| over its allowance); NaN is infinitely far. The
    allowance is one e4m3 step at the larger of the two values: an eighth of it (e4m3 keeps 3
    mantissa bits, so neighbours lie at most that far apart), or 2^-9 among the subnormals."""
    import torch

    a, e = actual.float(), expected.float()
    d = (a - e).abs()
    if torch.isnan(d).any():
        return float("inf"), float("inf")
    step = torch.clamp(torch.maximum(a.abs(), e.abs()) / 8, min=2.0 ** -9)
    return float(d.max()), float((d / step).max())


def check_all(cell, named: dict, scale) -> list[str]:
    """What disagrees with the reference, one line each (empty: every call computes the step):
    mtp_bench.check, each output judged by its dtype (FP8 within one e4m3 step of the reference's,
    bf16 within mtp_bench's tolerance)."""
    import torch

    base_pages, _ = cell.pool(1 + cell.B * cell.T + bench.SPARE_SLOTS, random_bytes=True)
    idx = cell.slot_sets(1)[0]
    ref_pages = base_pages.clone()
    ref_state = cell.state_of(ref_pages)
    ref_bf16 = cell.reference(ref_state.clone(), idx, True)
    ref8 = cell.reference(ref_state, idx, True, output_scale=scale)

    def judge(got):
        if got.dtype == torch.float8_e4m3fn:
            return fp8_excess(got, ref8)
        return bench.excess(got, ref_bf16, bench.TOL_OUT)

    checks = [bench.check(cell, name, call, idx, base_pages, None, ref_pages, idx.reshape(-1).long(), judge=judge)
              for name, call in named.items()]
    return [f"{c['impl']}: {c['detail']}" for c in checks if not c["ok"]]


def run(state: str, B: int, T: int, vllm_mtp, vllm_t1) -> dict:
    import torch

    cell = bench.Cell(state, B, T, seed=B * 16 + T)
    scale = torch.tensor([FP8_SCALE], device=bench.DEVICE)
    out8 = torch.empty(B * T, bench.HV, bench.V, device=bench.DEVICE, dtype=torch.float8_e4m3fn)
    named = calls(cell, vllm_mtp, vllm_t1, scale, out8)
    wrong = check_all(cell, named, scale)
    if wrong:  # a call that does not compute the step is not timed
        raise SystemExit(f"fp8_bench: {state} B={B} T={T}: " + "; ".join(wrong))
    bench.empty_cache()

    def failed(name, reason):  # a call that cannot be timed stops the run too
        raise SystemExit(f"fp8_bench: {state} B={B} T={T}: {name} could not be timed: {reason}")

    timed = {"times": []}
    bench.time_cell(cell, named, failed, timed, separate=True)
    bench.empty_cache()
    return dict(state=state, B=B, T=T, us={t["impl"]: round(t["us"], 2) for t in timed["times"]})


def row_text(row: dict) -> str:
    """The table's row: each implementation's µs, the faster vLLM flow over cudelta fp8, and what the
    FP8 output costs cudelta over bf16."""
    us = row["us"]
    cells = [f"{us[n]:.1f}" if n in us else "-" for n in IMPLS]
    fp8 = us.get(CUDELTA_FP8)
    peers = [us[n] for n in (VLLM_MTP, VLLM_T1) if n in us]
    ratio = f"{min(peers) / fp8:.2f}x" if fp8 and peers else "-"
    cost = f"{fp8 - us[CUDELTA_BF16]:+.1f}" if fp8 and CUDELTA_BF16 in us else "-"
    return f"| {row['state']} | {row['B']} | {row['T']} | " + " | ".join(cells) + f" | {ratio} | {cost} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", nargs="+", choices=bench.STATES, default=bench.STATES)
    ap.add_argument("--batches", nargs="+", type=int, default=bench.FULL["batches"])
    ap.add_argument("--tokens", nargs="+", type=int, default=bench.FULL["tokens"])
    ap.add_argument("--heads", type=bench.parse_heads, default=(16, 32), metavar="H/HV")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--dram-mib", type=int, default=bench.DRAM_BYTES >> 20, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    bench.set_heads(*args.heads)
    bench.DEVICE, bench.DRAM_BYTES = args.device, args.dram_mib << 20
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp8_bench-") as tmp:
        if args.device == "cpu":
            (vllm_mtp, mtp_why), (vllm_t1, t1_why) = (None, "the CPU dry run"), (None, "the CPU dry run")
        else:
            (vllm_mtp, mtp_why), (vllm_t1, t1_why) = load_vllm_mtp(Path(tmp)), load_vllm_t1()
        print(f"fp8_bench: heads {bench.H}/{bench.HV}, K=V=128, bf16 q/k/v/z, FP8 scale {FP8_SCALE}; "
              f"{VLLM_MTP}: {fetched_version(CUDA_OP_DIR) if vllm_mtp else 'not loaded (' + mtp_why + ')'}; "
              f"{VLLM_T1}: {fetched_version(FLA_DIR) if vllm_t1 else 'not loaded (' + t1_why + ')'}. "
              "µs per call, one process.")
        print("| state | B | T | " + " | ".join(IMPLS) + " | vLLM ÷ cudelta fp8 | fp8 - bf16 |")
        print("|---" * (len(IMPLS) + 5) + "|")
        for state in args.states:
            for B in args.batches:
                for T in args.tokens:
                    rows.append(run(state, B, T, vllm_mtp, vllm_t1))
                    print(row_text(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
