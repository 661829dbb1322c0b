"""What the causal-conv1d update costs in vLLM's MTP layer step, beside the GDN step it precedes:
the measured ceiling of fusing it (ARCHITECTURE.md, "Not fused yet").

    python benchmarks/fetch_vllm_ops.py --cache /tmp/vllm-wheel   # once, where PyPI is reachable
    # on the GPU machine (carry [".peers/cuda_op", ".peers/vllm_fla"]), cudelta built there:
    python -P benchmarks/conv_share.py --out $OUT/conv.md   # 16/32 heads, bf16 state, B 1..512, T 1 2 4 8
    #   [--heads H/HV] [--states bfloat16 float32] [--batches ...] [--tokens ...] [--procs 3]
    python benchmarks/conv_share.py --render conv.json      # anywhere: a saved run's report again

vLLM 0.33's GDN layer with speculative decoding runs two kernels a layer step: its Triton
`causal_conv1d_update` (width 4, SiLU, the conv state a sliding window advanced by
num_accepted_tokens; vllm/model_executor/layers/mamba/ops/causal_conv1d.py) on the projected
mixed_qkv, then the recurrent step on its output (vLLM's CUDA op, or cudelta.vllm_compat). In one
process, on the same pages and tensors, this times:
- conv: vLLM's conv update alone, as the layer calls it (conv_state_indices the first column of the
  block table, num_accepted_tokens, query_start_loc, max_query_len = T) with `out=` the mixed_qkv
  rows the step reads (vLLM overwrites x in place; a separate output keeps the inputs the same
  every call, at the same traffic);
- the step alone: vLLM's CUDA op and cudelta, exactly as benchmarks/mtp_bench.py times them;
- the pair: the conv and then the step in one call, each side with the same conv;
- cudelta's own conv (cudelta.vllm_compat.causal_conv1d_update, the same call) alone, and cudelta's
  layer pair: its conv, then its step, as two calls and as one
  (cudelta.vllm_compat.conv_then_gdn_decode_post_conv_mtp: the same kernels, the step's state loads
  issued before it waits for the conv).
A cell prints the convs and steps alone, the pairs, the pairs' ratios (vLLM's pair ÷ cudelta's step
after vLLM's conv, and ÷ cudelta's own pair) and the conv's share of vLLM's pair: what a fused conv
could at most save is the conv's time and no more.

Pages: vLLM's padded pages as mtp_bench builds them, the conv state sized as vLLM sizes it for
T - 1 draft tokens ([width - 1 + T - 1, conv_dim] bf16 a page, vLLM's default "SD" layout, handed
to the conv transposed) ahead of the recurrent state. State from DRAM (slot sets cycling over
>= 256 MiB), a CUDA graph of >= 50 calls with a one-element kernel after each (its time
subtracted), medians of --procs processes: mtp_bench's method.

Checked before timing, on a pool of the cell's slots, the null block and spare slots: the conv's
outputs against cudelta.conv_reference with its products rounded to bf16 as vLLM's kernel rounds
them (1/100 relative, one ulp, + 1e-4 of the largest) and every conv state byte equal to the
reference's (the window holds copies of inputs: exact); cudelta's conv, which sums fp32 products,
against the reference's fp32 products to the same tolerance; each pair's outputs and recurrent states
against the reference step on the conv outputs that pair produced (mtp_bench's tolerances), and
every other byte of the pool unchanged. A disagreeing implementation is
still timed, marked ✗.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mtp_bench as mb  # noqa: E402
import mtp_report as report  # noqa: E402

WIDTH = 4  # Qwen3-Next's linear_conv_kernel_dim
CONV = "conv"  # vLLM's
OWN_CONV = "cudelta-conv"
STEPS = (report.VLLM_CUDA, report.CUDELTA)
PAIR = {s: f"conv+{s}" for s in STEPS}  # vLLM's conv, then the step
OWN_PAIR = f"{OWN_CONV}+{report.CUDELTA}"  # cudelta's conv, then its step: the layer on cudelta alone
OWN_ONE_CALL = "cudelta-one-call"  # the same two kernels from one call: the step's state loads overlap the conv
STATES = ["bfloat16"]
# The conv's outputs against the reference with vLLM's bf16 products: one bf16 ulp (fp32 sums in
# another order, SiLU's exp) plus 1e-4 of the largest.
TOL_CONV = (1 / 100, 1e-4)


def conv_dim() -> int:
    return 2 * mb.H * mb.K + mb.HV * mb.V


def conv_bytes(T: int) -> int:
    """A page's conv state for T - 1 draft tokens: [width - 1 + T - 1, conv_dim] bf16."""
    return (WIDTH - 1 + T - 1) * conv_dim() * 2


# ---------------------------------------------------------------- tables (pure: data in, text out)


def pair_ratio(median: dict, state: str, B: int, T: int) -> float | None:
    vllm, ours = median.get((state, B, T, PAIR[report.VLLM_CUDA])), median.get((state, B, T, PAIR[report.CUDELTA]))
    return vllm / ours if vllm and ours else None


def own_pair_ratio(median: dict, state: str, B: int, T: int, own: str = OWN_PAIR) -> float | None:
    """vLLM's pair ÷ cudelta's (its conv, then its step: two calls, or with OWN_ONE_CALL one)."""
    vllm, ours = median.get((state, B, T, PAIR[report.VLLM_CUDA])), median.get((state, B, T, own))
    return vllm / ours if vllm and ours else None


def ceiling(median: dict, state: str, B: int, T: int) -> float | None:
    """vLLM's pair ÷ cudelta's step alone: a step with the conv fused in at no cost, the most fusing can give."""
    vllm, step = median.get((state, B, T, PAIR[report.VLLM_CUDA])), median.get((state, B, T, report.CUDELTA))
    return vllm / step if vllm and step else None


def conv_share(median: dict, state: str, B: int, T: int) -> float | None:
    conv, pair = median.get((state, B, T, CONV)), median.get((state, B, T, PAIR[report.VLLM_CUDA]))
    return conv / pair if conv and pair else None


def cell_text(median: dict, bad: set, state: str, B: int, T: int) -> str:
    def us(impl):
        v = median.get((state, B, T, impl))
        if v is None:
            return "—"
        text = f"{v:.1f}" if v < 100 else f"{v:.0f}"
        return text + (" ✗" if (state, B, T, impl) in bad else "")

    def x(r):
        return "—" if r is None else f"{r:.2f}x"

    share = conv_share(median, state, B, T)
    return (f"{us(CONV)} / {us(OWN_CONV)} · {us(report.VLLM_CUDA)} / {us(report.CUDELTA)} · "
            f"{us(PAIR[report.VLLM_CUDA])} / {us(PAIR[report.CUDELTA])} / {us(OWN_PAIR)} / {us(OWN_ONE_CALL)} · "
            f"{x(pair_ratio(median, state, B, T))} / {x(own_pair_ratio(median, state, B, T))} / "
            f"{x(own_pair_ratio(median, state, B, T, OWN_ONE_CALL))} → "
            f"{x(ceiling(median, state, B, T))} · {'—' if share is None else f'{100 * share:.0f}%'}")


def render(median: dict, bad: set, states: list[str], batches: list[int], tokens: list[int], header: str,
           notes: list[str]) -> str:
    lines = [header, "",
             "Cell: conv µs, vLLM / cudelta · step µs, vLLM CUDA / cudelta · conv + step µs, vLLM's conv + vLLM "
             "CUDA / vLLM's conv + cudelta / cudelta's conv + cudelta / the same in one call · vLLM's pair ÷ "
             "cudelta's step after vLLM's conv / ÷ cudelta's own pair / ÷ in one call → vLLM's pair ÷ cudelta's "
             "step alone (the conv fused in at no cost: the "
             "ceiling) · vLLM's conv's share of vLLM's pair. — not timed; ✗ disagrees with the reference.", ""]
    for state in states:
        lines += [f"**state {state}**", "", "| B | " + " | ".join(f"T={t}" for t in tokens) + " |",
                  "|---|" + "---|" * len(tokens)]
        for B in batches:
            lines.append(f"| {B} | " + " | ".join(cell_text(median, bad, state, B, t) for t in tokens) + " |")
        lines.append("")
        shares = [s for B in batches for t in tokens if (s := conv_share(median, state, B, t)) is not None]
        ratios = [(B, t, r) for B in batches for t in tokens if (r := pair_ratio(median, state, B, t)) is not None]
        if shares:
            lines.append(f"- {state}: the conv is {100 * min(shares):.0f}-{100 * max(shares):.0f}% of vLLM's pair"
                         + (f"; vLLM's pair ÷ cudelta's {min(r for *_, r in ratios):.2f}-"
                            f"{max(r for *_, r in ratios):.2f}x" if ratios else ""))
            small = [(B, t, r) for B, t, r in ratios if B <= report.SMALL_B]
            if small:
                met = [c for c in small if c[2] >= report.TARGET_SPEEDUP_SMALL_B]
                tops = [top for B, t, _ in small if (top := ceiling(median, state, B, t)) is not None]
                reach = sum(top >= report.TARGET_SPEEDUP_SMALL_B for top in tops)
                lines.append(f"- {state}, B <= {report.SMALL_B}: the pair at >= {report.TARGET_SPEEDUP_SMALL_B}x vLLM's "
                             f"in {len(met)} of {len(small)} cells"
                             + (f"; with the conv fused at no cost in {reach} of {len(tops)} (ceilings "
                                f"{min(tops):.2f}-{max(tops):.2f}x)" if tops else ""))
            for name, what in ((OWN_PAIR, "cudelta's own pair (its conv, then its step)"),
                               (OWN_ONE_CALL, "cudelta's own pair in one call")):
                own = [(B, t, r) for B in batches for t in tokens
                       if (r := own_pair_ratio(median, state, B, t, name)) is not None]
                if not own:
                    continue
                own_small = [r for B, _, r in own if B <= report.SMALL_B]
                slower = sum(r < 1 for *_, r in own)
                lines.append(f"- {state}: {what} {min(r for *_, r in own):.2f}-{max(r for *_, r in own):.2f}x vLLM's "
                             f"pair, slower in {slower} of {len(own)} cells"
                             + (f"; at B <= {report.SMALL_B} >= {report.TARGET_SPEEDUP_SMALL_B}x in "
                                f"{sum(r >= report.TARGET_SPEEDUP_SMALL_B for r in own_small)} of {len(own_small)} cells"
                                if own_small else ""))
            lines.append("")
    return "\n".join(lines + notes) + "\n"


# ---------------------------------------------------------------- a worker: one process on the GPU


def load_own(name: str):
    """(cudelta.vllm_compat.<name>, "") or (None, why not)."""
    try:
        from cudelta import vllm_compat

        return getattr(vllm_compat, name), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"cannot import cudelta.vllm_compat.{name} ({mb.short(exc)})"


def load_vllm_conv():
    sys.path.insert(0, str(mb.ROOT / ".peers" / "vllm_fla"))
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    except Exception as exc:  # noqa: BLE001
        return None, f"cannot import vLLM's causal_conv1d_update from .peers/vllm_fla ({mb.short(exc)}); run " \
                     "benchmarks/fetch_vllm_ops.py"
    return causal_conv1d_update, ""


class ConvCell:
    """mtp_bench's cell with the conv in front: raw mixed_qkv rows, the conv weight, conv state views."""

    def __init__(self, state: str, B: int, T: int, seed: int):
        import torch

        mb.CONV_BYTES = conv_bytes(T)  # mtp_bench's pages put this many conv bytes ahead of the state
        self.step = mb.Cell(state, B, T, seed)
        g, dev = self.step.gen, mb.DEVICE
        self.x = torch.randn(B * T, conv_dim(), device=dev, dtype=torch.bfloat16, generator=g)
        self.weight = (0.5 * torch.randn(conv_dim(), WIDTH, device=dev, generator=g)).to(torch.bfloat16)
        self.conv_bytes = mb.CONV_BYTES

    def conv_state(self, pages):
        """[slots, conv_dim, width - 1 + T - 1]: the transposed view of each page's [state_len, dim]."""
        import torch

        rows = self.conv_bytes // (2 * conv_dim())
        return pages[:, :self.conv_bytes].view(torch.bfloat16).view(pages.shape[0], rows, conv_dim()).transpose(1, 2)

    def pool(self, slots: int, random_bytes: bool):
        """mtp_bench's pages with a finite conv state (random bytes would hold NaNs as bf16)."""
        pages, _ = self.step.pool(slots, random_bytes)
        self.conv_state(pages).normal_(0.0, 1.0, generator=self.step.gen)
        return pages

    def recurrent(self, pages):
        c = self.step
        return pages[:, self.conv_bytes:self.conv_bytes + c.block].view(c.dtype).view(pages.shape[0], mb.HV, mb.V, mb.K)

    def conv_call(self, conv):
        c = self.step
        return lambda pages, idx: conv(self.x, self.conv_state(pages), self.weight, None, "silu",
                                       conv_state_indices=idx[:, 0], num_accepted_tokens=c.acc,
                                       query_start_loc=c.cu_seqlens, max_query_len=c.T, out=c.mixed_qkv)

    def one_call(self, pair):
        """cudelta's conv, then its step, from one call (conv_call's conv, mtp_call's step)."""
        c = self.step
        return lambda pages, idx: pair(self.x, self.conv_state(pages), self.weight, None, c.a, c.b, c.A_log,
                                       c.dt_bias, idx, c.cu_seqlens, c.acc, self.recurrent(pages), c.z,
                                       c.norm_weight, c.out, mb.SCALE, mb.NORM_EPS, "silu", activation="silu",
                                       conv_out=c.mixed_qkv)

    def reference_conv(self, pages, idx, bf16_products=True):
        """The reference conv into the step's mixed_qkv, its products rounded to bf16 as vLLM's
        kernel computes them (or fp32, as cudelta's); returns a copy of its outputs."""
        import torch
        from cudelta.conv_reference import causal_conv1d_update_reference

        c = self.step
        causal_conv1d_update_reference(self.x, self.conv_state(pages), self.weight, None, "silu", idx[:, 0],
                                       c.cu_seqlens, c.acc, out=c.mixed_qkv,
                                       round_products_to=torch.bfloat16 if bf16_products else None)
        return c.mixed_qkv.clone()


def check(cc: ConvCell, name: str, call, idx, base, ref_conv_bytes, ref_conv, conv_call) -> dict:
    """call(pages, idx) on a copy of base: its conv outputs and conv states against the reference
    conv's (ref_conv_bytes: the pool's conv state bytes after it; ref_conv). For a pair, its step
    against the reference step run on the outputs of its conv (conv_call) run alone: each stage
    against its own reference, since a conv output one bf16 ulp off moves the step's state by more
    than one; the pair must then reproduce those outputs exactly. The reference step runs before the
    pair's pool is copied, so the pool is held three times at most; at 16/64 B=512 T=8 (8.6 GB a
    copy) the reference's own fp32 copies still do not fit an H100 beside two (results-h100-conv.md).
    """
    import torch

    c = cc.step
    if name != CONV:
        step_pages = base.clone()
        conv_call(step_pages, idx)
        mb.sync()
        conv_used = c.mixed_qkv.clone()
        ref_out = c.reference(cc.recurrent(step_pages), idx, epilogue=True)
        mb.empty_cache()
    pages = base.clone()
    c.mixed_qkv.fill_(float("nan"))
    c.out.fill_(float("nan"))
    call(pages, idx)
    mb.sync()
    details = []
    conv_abs, conv_ratio = mb.excess(c.mixed_qkv, ref_conv, TOL_CONV)
    if conv_ratio > 1:
        details.append(f"conv out max |Δ| {conv_abs:.3g} ({conv_ratio:.3g}x its tolerance)")
    if not torch.equal(pages[:, :cc.conv_bytes], ref_conv_bytes):
        details.append("a conv state byte differs from the reference's")
    out_abs = st_abs = 0.0
    if name in (CONV, OWN_CONV):
        if not torch.equal(pages[:, cc.conv_bytes:], base[:, cc.conv_bytes:]):
            details.append("the conv changed a byte past the conv state")
    else:
        if not torch.equal(c.mixed_qkv, conv_used):
            details.append("the pair's conv outputs differ from its conv's alone")
        out_abs, out_ratio = mb.excess(c.out, ref_out, mb.TOL_OUT)
        st_abs, st_ratio = mb.excess(cc.recurrent(pages), cc.recurrent(step_pages), mb.TOL_STATE[c.state_name])
        if out_ratio > 1:
            details.append(f"out max |Δ| {out_abs:.3g} ({out_ratio:.3g}x its tolerance)")
        if st_ratio > 1:
            details.append(f"state max |Δ| {st_abs:.3g} ({st_ratio:.3g}x its tolerance)")
        end = cc.conv_bytes + c.block
        if not torch.equal(pages[:, end:], base[:, end:]):
            details.append("a padding byte changed")
    return dict(state=c.state_name, B=c.B, T=c.T, impl=name, ok=not details, out_max_abs=max(out_abs, conv_abs),
                state_max_abs=st_abs, detail="; ".join(details))


def cell_calls(cc: ConvCell, conv, steps: dict, own_conv=None, own_one_call=None) -> dict:
    """The calls a cell checks and times, each call(pages, idx): vLLM's conv, each step alone (named
    by its implementation) and each pair; with own_conv (cudelta's), it alone and cudelta's pair;
    with own_one_call too, that pair from one call."""
    c = cc.step
    conv_call = cc.conv_call(conv)
    calls = {CONV: conv_call}
    for n, f in steps.items():
        step = c.mtp_call(f)
        calls[n] = lambda pages, idx, step=step: step(cc.recurrent(pages), idx)
        calls[PAIR[n]] = lambda pages, idx, step=step: (conv_call(pages, idx), step(cc.recurrent(pages), idx))
    if own_conv is not None:
        own_call = calls[OWN_CONV] = cc.conv_call(own_conv)
        if report.CUDELTA in steps:
            step = c.mtp_call(steps[report.CUDELTA])
            calls[OWN_PAIR] = lambda pages, idx: (own_call(pages, idx), step(cc.recurrent(pages), idx))
            if own_one_call is not None:
                calls[OWN_ONE_CALL] = cc.one_call(own_one_call)
    return calls


def conv_of(name: str) -> str:
    """The conv a checked call runs: cudelta's for its conv and its own pairs, else vLLM's."""
    return OWN_CONV if name in (OWN_CONV, OWN_PAIR, OWN_ONE_CALL) else CONV


def check_cell(cc: ConvCell, calls: dict, result: dict) -> set:
    """The conv and each pair against the reference conv then the reference step, on a pool of the
    cell's slots, the null block and spare slots; returns the names to time: those whose check ran
    (a disagreement is timed and marked) and each step whose pair's check ran (its step)."""
    c = cc.step
    base = cc.pool(1 + c.B * c.T + mb.SPARE_SLOTS, random_bytes=True)
    idx = c.slot_sets(1)[0]
    ref_pages = base.clone()
    ref_conv = {CONV: cc.reference_conv(ref_pages, idx)}
    ref_conv_bytes = ref_pages[:, :cc.conv_bytes].clone()  # all a check needs of it: a pool copy fewer
    if OWN_CONV in calls:  # fp32 products: the same window bytes, outputs within an ulp of the above
        ref_pages.copy_(base)
        ref_conv[OWN_CONV] = cc.reference_conv(ref_pages, idx, bf16_products=False)
    del ref_pages
    where = dict(state=c.state_name, B=c.B, T=c.T)
    ran = set()
    for name, call in calls.items():
        if name in STEPS:
            continue
        try:
            r = check(cc, name, call, idx, base, ref_conv_bytes, ref_conv[conv_of(name)], calls[conv_of(name)])
        except Exception as exc:  # noqa: BLE001
            result["skips"].append(dict(where, impl=name, reason=mb.short(exc)))
            traceback.print_exc()
            continue
        result["checks"].append(r)
        ran.add(name)
        print(f"conv_share: {c.state_name} B={c.B} T={c.T} {name}: "
              f"{'agrees' if r['ok'] else 'DISAGREES: ' + r['detail']}", file=sys.stderr)
    return ran | {n for n in STEPS if PAIR[n] in ran}


def run_cell(state: str, B: int, T: int, conv, steps: dict, result: dict, own_conv=None, own_one_call=None) -> None:
    cc = ConvCell(state, B, T, seed=1000 * B + T)
    c = cc.step
    calls = cell_calls(cc, conv, steps, own_conv, own_one_call)
    checked = check_cell(cc, calls, result)
    mb.empty_cache()

    # Times: slot sets over >= 256 MiB of recurrent state, a one-element kernel between calls.
    pages = cc.pool(1 + c.sets * B * T, random_bytes=False)
    sets = c.slot_sets(c.sets)
    clock = mb.SeparatedClock(c.sets)
    line = []
    for name, call in calls.items():
        if name not in checked:
            continue
        try:
            us, mode = clock.time(lambda i, call=call: call(pages, sets[i]))
        except Exception as exc:  # noqa: BLE001
            result["skips"].append(dict(state=state, B=B, T=T, impl=name, reason=mb.short(exc)))
            continue
        result["times"].append(dict(state=state, B=B, T=T, impl=name, us=us, mode=mode))
        line.append(f"{name} {us:.1f}")
    del pages
    mb.empty_cache()
    print(f"conv_share: {state} B={B} T={T}: " + ", ".join(line) + " µs", file=sys.stderr, flush=True)


def run_worker(args) -> int:
    import torch

    mb.DEVICE, mb.DRAM_BYTES = "cuda", args.dram_mib << 20
    if not torch.cuda.is_available():
        print("conv_share: needs an NVIDIA GPU", file=sys.stderr)
        return 2
    conv, why = load_vllm_conv()
    own_conv, why_own = load_own("causal_conv1d_update")
    own_one_call, why_one_call = load_own("conv_then_gdn_decode_post_conv_mtp")
    mtp, _decode, why_cudelta = mb.load_cudelta()
    vllm, why_vllm = mb.load_vllm_cuda(args.cuda_op_so, args.cuda_op_reason)
    result = {"device": f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", "times": [], "skips": [],
              "checks": [], "reasons": {CONV: why, OWN_CONV: why_own, OWN_ONE_CALL: why_one_call, report.CUDELTA: why_cudelta, report.VLLM_CUDA: why_vllm}}
    if conv is None:
        print(f"conv_share: {why}", file=sys.stderr)
        Path(args.worker).write_text(json.dumps(result))
        return 1
    steps = {n: f for n, f in ((report.VLLM_CUDA, vllm), (report.CUDELTA, mtp)) if f is not None}
    for state in args.states:
        for B in args.batches:
            for T in args.tokens:
                try:
                    run_cell(state, B, T, conv, steps, result, own_conv, own_one_call)
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    result["skips"].append(dict(state=state, B=B, T=T, impl=CONV, reason=f"cell failed: {mb.short(exc)}"))
                    if "CUDA error" in str(exc):
                        Path(args.worker).write_text(json.dumps(result))
                        return 3
                Path(args.worker).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------- the parent: processes, medians


def report_text(runs: list[dict], meta: dict, failures: list[str] = ()) -> str:
    """The tables and notes from the processes' results (run_parent's, or a saved .json's: --render)."""
    merged = report.merge_runs(runs)
    median = merged.median
    spreads = [v for k, v in merged.spread.items() if median[k] > 0]
    bad = {k for k, c in merged.checks.items() if not c["ok"]}
    checks = [c for run in runs for c in run["checks"]]  # counted a process at a time
    notes = [f"Checks: {sum(c['ok'] for c in checks)} of {len(checks)} agree with the reference (conv, then step)"
             + (f"; disagreeing: {sorted(bad)}" if bad else "")]
    reasons = {f"{impl}: {why}" for run in runs for impl, why in run.get("reasons", {}).items() if why}
    reasons |= {f"{s['impl']} {s['state']} B={s['B']} T={s['T']}: {s['reason']}" for run in runs for s in run["skips"]}
    notes += [f"Not timed: {r}" for r in sorted(reasons)]
    if spreads:
        notes.append(f"Spread across processes, (max - min) / median: median {100 * statistics.median(spreads):.1f}%, "
                     f"largest {100 * max(spreads):.1f}%.")
    notes += failures
    header = (f"vLLM's MTP layer step, conv then step (H={mb.H}, HV={mb.HV}, K=V=128, conv width {WIDTH} over "
              f"{conv_dim()} channels, SiLU, bf16 mixed_qkv); {runs[0]['device']}; median of {len(runs)} of "
              f"{meta['procs']} processes, {meta['seconds']} s. Pages: vLLM's (conv state [3 + T - 1, "
              f"conv_dim] bf16, then the state), slot sets cycling over >= {meta['dram_mib']} MiB; CUDA graph of >= "
              f"{mb.MIN_CALLS} calls, best of 5 replays; a one-element kernel after each call, its time subtracted. "
              f"{meta.get('peers', 'Peers: vLLM version not recorded in this run.')}")
    return render(median, bad, meta["states"], meta["batches"], meta["tokens"], header, notes)


def render_dump(path: Path) -> str:
    """The report of a saved run (run_parent's .json)."""
    dump = json.loads(path.read_text())
    mb.set_heads(*dump["heads"])
    return report_text(dump["processes"], dump)


def run_parent(args) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="conv_share-") as tmp:
        so, so_reason = mb.unpack_cuda_op(mb.cuda_op_archive(args.cuda_op), Path(tmp))

        def command(out: Path) -> list[str]:
            return [sys.executable] + (["-P"] if sys.flags.safe_path else []) + [
                str(Path(__file__).resolve()), "--worker", str(out), "--cuda-op-so", so, "--cuda-op-reason", so_reason,
                "--heads", f"{mb.H}/{mb.HV}", "--dram-mib", str(args.dram_mib), "--states", *args.states,
                "--batches", *map(str, args.batches), "--tokens", *map(str, args.tokens)]

        runs, failures = mb.run_processes("conv_share", args.procs, command, Path(tmp))
    if not runs:
        return 1
    meta = dict(heads=[mb.H, mb.HV], procs=args.procs, seconds=round(time.monotonic() - started),
                dram_mib=args.dram_mib, states=args.states, batches=args.batches, tokens=args.tokens,
                peers=mb.peer_versions())
    text = report_text(runs, meta, failures)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(dict(meta, processes=runs), indent=1))
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=mb.FULL["batches"])
    parser.add_argument("--tokens", type=int, nargs="+", default=mb.FULL["tokens"], choices=range(1, 9), metavar="T")
    parser.add_argument("--states", nargs="+", choices=mb.STATES, default=STATES)
    parser.add_argument("--heads", type=mb.parse_heads, default=(mb.H, mb.HV), metavar="H/HV")
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--cuda-op", type=Path, help="vLLM's library (.so or .so.xz); default .peers/cuda_op/*.so.xz")
    parser.add_argument("--out", type=Path, help="the tables (markdown) here, the numbers beside it (.json)")
    parser.add_argument("--render", type=Path, metavar="JSON", help="print the report of a saved run and exit")
    parser.add_argument("--dram-mib", type=int, default=mb.DRAM_BYTES >> 20, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cuda-op-so", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cuda-op-reason", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.procs < 1 or any(b < 1 for b in args.batches):
        parser.error(f"--procs and --batches must be >= 1; got {args.procs}, {args.batches}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        print(render_dump(args.render), end="")
        return 0
    mb.set_heads(*args.heads)
    return run_worker(args) if args.worker else run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
