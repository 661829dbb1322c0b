"""benchmarks/kda_bench.py without a GPU: its dry run (CPU tensors, small head counts) with a stand-in
reference injected as cudelta, spoiled implementations named as disagreeing, and its table and
summary arithmetic from given medians."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kda_bench as kb  # noqa: E402
import mtp_bench  # noqa: E402
import mtp_report as report  # noqa: E402

DRY = ["--device", "cpu", "--heads", "2", "--dram-mib", "1"]


def stand_in(spoil=None):
    """vLLM's op semantics in plain PyTorch (fp32 math, one request at a time), with its signature:
    what the dry run injects until cudelta.vllm_compat.fused_kda_decode_reference lands. spoil(conv_state,
    state, out, slot, window_before) runs after the step."""
    import torch

    def fused_kda_decode(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state,
                         out=None, lower_bound=None, output_gate=None, norm_weight=None, norm_eps=1e-5):
        _, B, H, D = raw_g.shape
        w = weight.permute(0, 2, 1).reshape(3 * H * D, weight.shape[1]).float()  # [dim, width]: conv1d.weight
        for n in range(B):
            s = int(state_indices[n])
            if s <= 0:
                out[0, n] = 0
                continue
            before = conv_state[s].clone()
            cols = torch.cat([before.float(), x[n].float()[:, None]], 1)  # the window, then this token
            y = (cols * w).sum(1) + (0 if bias is None else bias.float())
            conv_state[s] = torch.cat([before[:, 1:], x[n][:, None]], 1)
            q, k, v = torch.nn.functional.silu(y).to(x.dtype).float().view(3, H, D)  # the conv output in bf16
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            g = lower_bound * torch.sigmoid(A_log.exp()[:, None] * (raw_g[0, n].float() + dt_bias.view(H, D)))
            beta = torch.sigmoid(raw_beta[0, n].float())
            S = state[s] * g.exp()[:, None, :]  # [H, V, K], a decay per key channel
            u = beta[:, None] * (v - (S @ k[..., None])[..., 0])
            S = S + u[:, :, None] * k[:, None, :]
            state[s] = S
            o = (S @ q[..., None])[..., 0].to(torch.bfloat16).float()
            o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + norm_eps) * norm_weight.float()
            out[0, n] = (o * torch.sigmoid(output_gate[n].float())).to(out.dtype)
            if spoil is not None:
                spoil(conv_state, state, out, s, before)
        return out

    return fused_kda_decode


@pytest.fixture
def on_cpu(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(mtp_bench, "DEVICE", "cpu")  # work() sets both: restored after
    monkeypatch.setattr(mtp_bench, "DRAM_BYTES", mtp_bench.DRAM_BYTES)


def dry_runs(impls: dict, batches=("1", "3"), procs: int = 2):
    """procs workers' results in this process (the parent's subprocesses, minus the subprocesses)."""
    args = kb.parse_args(DRY + ["--batches", *batches, "--procs", str(procs)])
    reasons = {kb.CUDELTA: "", kb.VLLM_CUDA: "dry run (--device cpu): vLLM's op needs a GPU"}
    full = {kb.CUDELTA: None, kb.VLLM_CUDA: None, **impls}
    return args, [kb.work(args, full, reasons, stand_in()) for _ in range(procs)]


@pytest.mark.usefixtures("on_cpu")
def test_the_dry_run_prints_the_table_checks_and_skips():
    args, runs = dry_runs({kb.CUDELTA: stand_in()})
    text = kb.render(report.merge_runs(runs), args.heads, args.batches, "METHOD")
    lines = text.splitlines()
    assert "| B | cudelta µs | vLLM CUDA µs | vLLM ÷ cudelta | cudelta % of copy | vLLM % of copy |" in lines
    rows = [ln for ln in lines if ln.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        float(cells[1])  # cudelta timed (the stand-in), vLLM not: no ratio
        assert cells[2:4] == ["—", "—"] and cells[4].endswith("%") and cells[5] == "—"
    assert ("- cudelta: agrees in 2/2 cells; largest |Δ out| 0.00e+00, |Δ state| 0.00e+00, "
            "|Δ conv state| 0.00e+00") in lines
    assert "- vLLM CUDA not timed in every cell: dry run (--device cpu): vLLM's op needs a GPU" in lines
    assert "- never slower than vLLM's CUDA op: not measured (no cell has both timed)" in lines
    assert any(ln.startswith("- spread across processes") and "of 2 processes" in ln for ln in lines)
    assert not any("✗" in row for row in rows) and "**H=2**" in text


def spoil_out(conv_state, state, out, s, before):
    out[0, 0] += 0.25 * out.float().abs().max()  # a wrong head: far past the bf16 chain's tolerance


def spoil_spare(conv_state, state, out, s, before):
    state[-1, 0, 0, 0] += 1.0  # the check pool's last slot is a spare: no call names it


def spoil_window(conv_state, state, out, s, before):
    conv_state[s] = before  # the window not advanced


def spoil_conv_ulp(conv_state, state, out, s, before):
    import torch

    conv_state[s, :1, :1].view(torch.int16).add_(1)  # one bf16 ulp off: within any float tolerance, not equal


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("spoil, detail", [(spoil_out, "out max |Δ|"),
                                           (spoil_spare, "a slot no call names (null block or spare) changed"),
                                           (spoil_window, "a written conv state differs"),
                                           (spoil_conv_ulp, "a written conv state differs")])
def test_a_spoiled_implementation_is_timed_but_marked(spoil, detail):
    args, runs = dry_runs({kb.CUDELTA: stand_in(), kb.VLLM_CUDA: stand_in(spoil)}, batches=("2",), procs=1)
    checks = {c["impl"]: c for c in runs[0]["checks"]}
    assert checks[kb.CUDELTA]["ok"], checks[kb.CUDELTA]
    assert not checks[kb.VLLM_CUDA]["ok"] and detail in checks[kb.VLLM_CUDA]["detail"]
    assert {t["impl"] for t in runs[0]["times"]} == {kb.CUDELTA, kb.VLLM_CUDA, kb.COPY}  # still timed
    text = kb.render(report.merge_runs(runs), args.heads, args.batches, "METHOD")
    row = next(ln for ln in text.splitlines() if ln.startswith("| 2 |"))
    assert row.split("|")[3].strip().endswith("✗") and not row.split("|")[2].strip().endswith("✗")
    assert "- vLLM CUDA: agrees in 0/1 cells" in text and "**DISAGREES** at B=2: " in text and detail in text


def runs_from(values: dict, ok: dict | None = None, copy_GBps: float = 4000.0):
    """Processes' results from {(H, B, impl): [µs per process]}."""
    procs = max(len(v) for v in values.values())
    runs = [{"device": "GPU", "copy_GBps": copy_GBps, "times": [], "skips": [], "checks": []} for _ in range(procs)]
    for (H, B, impl), us in values.items():
        for run, u in zip(runs, us):
            run["times"].append(dict(state=kb.head_key(H), B=B, T=1, impl=impl, us=u, mode="graph"))
    for (H, B, impl), good in (ok or {}).items():
        runs[0]["checks"].append(dict(state=kb.head_key(H), B=B, T=1, impl=impl, ok=good, out_max_abs=0.5,
                                      state_max_abs=1e-6, conv_max_abs=0.0, detail="" if good else "out max |Δ| 0.5"))
    return runs


def test_the_summary_reads_ratios_and_percentages_off_the_medians():
    C, V, P = kb.CUDELTA, kb.VLLM_CUDA, kb.COPY
    runs = runs_from({(12, 1, C): [9.0, 10.0, 11.0], (12, 1, V): [15.0, 16.0, 14.0], (12, 1, P): [8.0] * 3,
                      (12, 4, C): [20.0] * 3, (12, 4, V): [18.0] * 3, (12, 4, P): [10.0] * 3,
                      (12, 8, C): [30.0] * 3, (12, 8, V): [33.0] * 3, (12, 8, P): [3.0] * 3,
                      (12, 32, C): [40.0] * 3, (12, 32, P): [20.0] * 3},
                     ok={(12, 8, C): False, (12, 1, C): True}, copy_GBps=400.0)
    m = report.merge_runs(runs)
    assert kb.ratio(m, 12, 1) == pytest.approx(1.5) and kb.ratio(m, 12, 32) is None
    lines = kb.table(m, 12, [1, 4, 8, 32])
    # A request at H=12 moves 1,646,616 bytes; % of copy is B of them ÷ the time, of 400 GB/s (the
    # per-cell copies, 8-20 µs here, are not the yardstick).
    assert kb.request_bytes(12) == 1_646_616
    assert "| 1 | 10.0 | 15.0 | 1.50x | 41% | 27% |" in lines
    assert "| 4 | 20.0 | 18.0 | 0.90x | 82% | 91% |" in lines
    assert "| 8 | 30.0 ✗ | 33.0 | 1.10x | 110% | 100% |" in lines
    assert "| 32 | 40.0 | — | — | 329% | — |" in lines
    # B=4 is slower, B=8 faster but wrong: both miss; B=32 has no vLLM time and does not count.
    assert kb.target_line(m, 12, [1, 4, 8, 32]) == \
        "- never slower than vLLM's CUDA op: met in 1 of 3 cells; missed at B=4 0.90x, B=8 1.10x ✗"
    assert kb.check_lines(m, 12)[0].startswith("- cudelta: agrees in 1/2 cells; largest |Δ out| 5.00e-01")
    assert "largest 20.0% (cudelta B=1)" in kb.spread_line(m, 12)  # (11 - 9) / 10
    all_met = report.merge_runs(runs_from({(48, 1, C): [5.0], (48, 1, V): [5.0]}))
    assert kb.target_line(all_met, 48, [1]) == "- never slower than vLLM's CUDA op: met in 1 of 1 cells"


def test_request_bytes_and_head_counts():
    # H=12: state 2*12*128*128*4, conv window 2*3*4608*2, x 4608*2, raw_g 1536*2, raw_beta 24, z + out 2*1536*2
    assert kb.request_bytes(12) == 1572864 + 55296 + 9216 + 3072 + 24 + 6144
    assert kb.parse_args([]).heads == [12, 48] and kb.parse_args([]).batches == [1, 4, 8, 32, 128, 512]
    with pytest.raises(SystemExit):
        kb.parse_args(["--heads", "2"])  # vLLM's op takes 12, 24, 48, 96 only
    assert kb.parse_args(DRY).heads == [2]  # the dry run takes any
    assert kb.load_vllm_kda("", "why not") == (None, "why not")


def test_a_missing_drop_in_is_a_skip_not_a_crash(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(mtp_bench, "DEVICE", "cuda")
    fn, _, why = kb.load_cudelta()
    assert (fn is None) == bool(why)


def test_the_whole_script_dry_run(tmp_path):
    """The parent, its worker processes and --out, with cudelta's own reference (once it exists)."""
    pytest.importorskip("torch")
    vllm_compat = pytest.importorskip("cudelta.vllm_compat")
    if not hasattr(vllm_compat, "fused_kda_decode_reference"):
        pytest.skip("cudelta.vllm_compat.fused_kda_decode_reference not there yet")
    out = tmp_path / "kda.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kda_bench.py"), *DRY, "--batches", "2",
                           "--procs", "2", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| B | cudelta µs |" in done.stdout and "- cudelta: agrees in 1/1 cells" in done.stdout
    assert out.read_text() == done.stdout and out.with_suffix(".json").exists()


@pytest.mark.usefixtures("on_cpu")
def test_the_stand_in_agrees_with_cudeltas_reference():
    """The dry run's stand-in computes vLLM's step as cudelta's reference does (once that exists)."""
    vllm_compat = pytest.importorskip("cudelta.vllm_compat")
    if not hasattr(vllm_compat, "fused_kda_decode_reference"):
        pytest.skip("cudelta.vllm_compat.fused_kda_decode_reference not there yet")
    result = {"checks": [], "skips": []}
    cell = kb.Cell(2, 3, seed=5)
    kb.check_cell(cell, {kb.CUDELTA: cell.call(stand_in())}, vllm_compat.fused_kda_decode_reference,
                  lambda impl, why: pytest.fail(why), result)
    assert result["checks"][0]["ok"], result["checks"][0]


@pytest.mark.usefixtures("on_cpu")
def test_ds_pages_hand_the_op_each_page_s_dim_by_3_block_and_are_checked_the_same():
    cell = kb.Cell(2, 3, seed=1, conv_layout="DS")
    p = cell.pool(4, random_bytes=True)
    assert p.conv.shape == (4, 3 * 2 * kb.D, 3) and p.conv.stride() == (cell.page // 2, 3, 1)
    assert p.conv.data_ptr() == p.pages.data_ptr()  # the page's first bytes, as SD's
    args = kb.parse_args(DRY + ["--batches", "3", "--procs", "1", "--conv-layout", "DS"])
    reasons = {kb.CUDELTA: "", kb.VLLM_CUDA: "dry run"}
    run = kb.work(args, {kb.CUDELTA: stand_in(), kb.VLLM_CUDA: stand_in(spoil_window)}, reasons, stand_in())
    checks = {c["impl"]: c for c in run["checks"]}
    assert checks[kb.CUDELTA]["ok"] and not checks[kb.VLLM_CUDA]["ok"]  # the window is checked on DS pages too
    assert "conv state [3H*128, 3] (DS)" in kb.method_text(args, 1, 1.0)
    assert kb.worker_command(args, "", "", Path("r.json"))[-2:] == ["--conv-layout", "DS"]
