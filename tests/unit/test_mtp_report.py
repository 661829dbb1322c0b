"""benchmarks/mtp_report.py, the pure half of mtp_bench.py: the bytes an MTP step moves and the copy
that moves as many, the medians over processes, and the tables and targets read off them; and
mtp_bench.py's command line (its module imports no torch until a worker runs)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mtp_bench  # noqa: E402
import mtp_report as r  # noqa: E402

MIB = 1 << 20
BF16, FP32 = "bfloat16", "float32"


def test_the_state_is_read_once_and_written_once_per_token():
    state = 32 * 128 * 128 * 2  # one bf16 slot: 1 MiB
    per_token = (2 * 16 * 128 + 3 * 32 * 128) * 2  # q, k; v, z, out
    assert r.step_bytes(1, 1, 2) == 2 * MIB + per_token
    assert r.step_bytes(8, 4, 2) == 8 * state + 32 * state + 32 * per_token
    assert r.step_bytes(8, 4, 4) - r.step_bytes(8, 4, 2) == (8 + 32) * state  # fp32 doubles only the state


def test_the_copy_moves_the_step_s_bytes_capped_at_256_mib_and_scaled_beyond():
    assert r.copy_chunk_bytes(2 * MIB + 64) == MIB + 32  # half: a copy reads and writes its size
    assert r.copy_chunk_bytes(2 * MIB + 70) % 16 == 0
    assert r.copy_chunk_bytes(8 << 30) == 256 * MIB
    assert r.copy_chunk_bytes(4) == 16
    # a capped copy's bandwidth scaled to the step's bytes: 4 GiB moved at the speed of 256 MiB copies
    assert r.copy_equivalent_us(100.0, 256 * MIB, 4 << 30) == pytest.approx(800.0)
    assert r.copy_equivalent_us(10.0, MIB, 2 * MIB) == pytest.approx(10.0)
    assert r.pct_of_copy(10.0, 9.3) == pytest.approx(93.0)


def times(state, B, T, **us):
    return [dict(state=state, B=B, T=T, impl=impl.replace("_", "-"), us=v) for impl, v in us.items()]


def run(cells, skips=(), checks=(), device="NVIDIA H100 80GB HBM3, torch 2.11.0+cu130"):
    return {"device": device, "copy_GBps": 3000.0, "times": [m for c in cells for m in c], "skips": list(skips),
            "checks": list(checks)}


def test_medians_and_spread_across_processes():
    runs = [run([times(BF16, 8, 2, cudelta=10.0)]), run([times(BF16, 8, 2, cudelta=12.0)]),
            run([times(BF16, 8, 2, cudelta=11.0)])]
    m = r.merge_runs(runs)
    k = (BF16, 8, 2, "cudelta")
    assert m.median[k] == 11.0 and m.runs[k] == 3 and m.procs == 3
    assert m.spread[k] == pytest.approx(2 / 11)


def test_a_process_that_timed_a_cell_wins_over_one_that_skipped_it_and_a_failed_check_sticks():
    skip = dict(state=BF16, B=1, T=1, impl="vllm-cuda", reason="cannot load")
    good = dict(state=BF16, B=1, T=1, impl="vllm-cuda", ok=True, out_max_abs=1e-3, state_max_abs=0.0, detail="")
    bad = dict(good, ok=False, out_max_abs=0.5, detail="out max |Δ| 0.5")
    m = r.merge_runs([run([], skips=[skip], checks=[bad]), run([times(BF16, 1, 1, vllm_cuda=7.0)], checks=[good])])
    k = (BF16, 1, 1, "vllm-cuda")
    assert m.median[k] == 7.0 and m.runs[k] == 1 and k not in m.skips
    assert m.checks[k]["ok"] is False and m.checks[k]["out_max_abs"] == 0.5
    with pytest.raises(ValueError, match="no process result"):
        r.merge_runs([])


def grid_run():
    """bf16, B 8 and 512, T 1 and 2: cudelta 1.5x at B=8, slower than vLLM at B=512 T=2."""
    cells = [
        times(BF16, 8, 1, cudelta=6.0, vllm_cuda=9.0, vllm_triton=12.0, cudelta_t1=5.8, copy=5.4),
        times(BF16, 8, 2, cudelta=8.0, vllm_cuda=12.0, vllm_triton=15.0, copy=7.6),
        times(BF16, 512, 1, cudelta=300.0, vllm_cuda=330.0, vllm_triton=400.0, cudelta_t1=270.0, copy=282.0),
        times(BF16, 512, 2, cudelta=500.0, vllm_cuda=475.0, vllm_triton=600.0, copy=470.0),
    ]
    return run(cells)


def test_a_cell_shows_each_implementation_the_ratio_and_the_share_of_copy():
    m = r.merge_runs([grid_run()])
    assert r.cell_text(m, BF16, 8, 1) == "6.0 / 9.0 / 12.0 · 1.50x · 90% / 60%"
    assert r.t1_text(m, BF16, 8) == "5.8 (93%) · epilogue +3.4%"
    table = r.render_table(m, BF16, [8, 512], [1, 2])
    assert table.splitlines()[2:4] == ["| B | T=1 | T=2 | cudelta T=1 decode alone |", "|---|---|---|---|"]
    assert "| 512 | 300 / 330 / 400 · 1.10x · 94% / 85% | 500 / 475 / 600 · 0.95x · 94% / 99% | 270 (104%)" in table


def test_the_targets_name_every_cell_that_misses():
    m = r.merge_runs([grid_run()])
    lines = r.target_lines(m, [BF16], [8, 512], [1, 2])
    assert lines[0] == ("- never slower than vLLM's CUDA op (vLLM ÷ cudelta >= 1): MISSED in 1 of 4 cells: "
                        "bf16 B=512 T=2 0.95x")
    assert lines[1] == "- >= 1.5x vLLM's CUDA op at B <= 8: met in all 2 cells"
    assert lines[2] == "- >= 93% of copy at B·T >= 256: met in all 2 cells"
    assert lines[3] == ("- T=1 + epilogue within 5% of cudelta's T=1 decode alone: MISSED in 1 of 2 cells: "
                        "bf16 B=512 T=1 +11.1%")


def test_a_missed_1_5x_says_where_it_would_need_more_than_the_copy_s_bandwidth():
    # B=1: vLLM's op at 35% of copy, so 1.5x needs 53% (cudelta 50%); B=8: vLLM at 70%, 1.5x needs 105%
    m = r.merge_runs([run([times(BF16, 1, 1, cudelta=5.0, vllm_cuda=7.0, copy=2.5),
                           times(BF16, 8, 1, cudelta=8.0, vllm_cuda=9.0, copy=6.3),
                           times(BF16, 4, 1, cudelta=4.0, vllm_cuda=6.4, copy=3.2)])])
    lines = r.target_lines(m, [BF16], [1, 4, 8], [1])
    assert lines[1].startswith("- >= 1.5x vLLM's CUDA op at B <= 8: MISSED in 2 of 3 cells: bf16 B=1 T=1 1.40x")
    assert lines[2] == ("  - 1.5x vLLM's op means 1.5 times its share of copy: beyond the copy in 1 of the 2 cells "
                        "missed (bf16 B=8 T=1 105%); under it in 1 (bf16 B=1 T=1 54% (cudelta 50%))")
    assert lines[3].startswith("- >= 93% of copy")


def test_no_reach_line_when_the_1_5x_target_is_met_or_the_copy_was_not_timed():
    m = r.merge_runs([run([times(BF16, 1, 1, cudelta=5.0, vllm_cuda=7.0)])])  # no copy: no shares
    lines = r.target_lines(m, [BF16], [1], [1])
    assert lines[1].startswith("- >= 1.5x vLLM's CUDA op at B <= 8: MISSED in 1 of 1 cells")
    assert not any(line.startswith("  - ") for line in lines)


def test_the_report_renders_again_from_mtp_bench_s_json(tmp_path):
    dump = {"args": {"states": [BF16], "batches": [8, 512], "tokens": [1, 2], "heads": [4, 8]},
            "method": "Pool: as in the test.", "processes": [grid_run(), grid_run()]}
    path = tmp_path / "mtp-4-8.json"
    path.write_text(json.dumps(dump))
    text = r.render_dump(json.loads(path.read_text()))
    assert text == r.render_report(r.merge_runs([grid_run()] * 2), [BF16], [8, 512], [1, 2], "Pool: as in the test.",
                                   heads=(4, 8))
    assert text.startswith("MTP decode step (H=4, HV=8,") and "median of 2 processes" in text
    done = subprocess.run([sys.executable, str(Path(r.__file__)), str(path)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == text


def test_a_peer_that_cannot_load_and_cudelta_refusing_the_step_are_skip_lines_not_numbers():
    refused = "NotSupportedOnCUDAError: cudelta: cu_seqlens (tokens per request); idx of shape ({B}, {T})"
    skips = [dict(state=BF16, B=B, T=T, impl=impl, reason=reason.format(B=B, T=T))
             for B in (1, 8) for T in (1, 2)
             for impl, reason in (("cudelta", refused), ("vllm-cuda", "no .peers/cuda_op/*.so.xz"))]
    cells = [times(BF16, B, T, vllm_triton=20.0, copy=5.0) for B in (1, 8) for T in (1, 2)]
    m = r.merge_runs([run(cells, skips=skips)])
    assert r.cell_text(m, BF16, 1, 2) == "— / — / 20.0 · — · — / —"
    text = r.render_report(m, [BF16], [1, 8], [1, 2], "method")
    assert "- cudelta not timed in every cell (4): NotSupportedOnCUDAError: cudelta: cu_seqlens" in text
    assert "- vLLM CUDA not timed in every cell (4): no .peers/cuda_op/*.so.xz" in text
    assert "- never slower than vLLM's CUDA op (vLLM ÷ cudelta >= 1): not measured" in text


def test_an_implementation_that_disagrees_is_marked_and_its_cells_miss_the_targets():
    bad = dict(state=BF16, B=8, T=1, impl="cudelta", ok=False, out_max_abs=0.3, state_max_abs=2.0,
               detail="state max |Δ| 2 (40x its tolerance)")
    ok = dict(bad, T=2, ok=True, out_max_abs=1e-3, state_max_abs=1e-4, detail="")
    m = r.merge_runs([run([grid_run()["times"]], checks=[bad, ok])])
    assert r.cell_text(m, BF16, 8, 1).startswith("6.0 ✗ / 9.0 / 12.0")
    notes = r.check_notes(m)
    assert notes == ["- cudelta: agrees in 1/2 cells; largest |Δ out| 3.00e-01, |Δ state| 2.00e+00; **DISAGREES** "
                     "in bf16 B=8 T=1: state max |Δ| 2 (40x its tolerance)"]
    assert "bf16 B=8 T=1 1.50x (wrong result)" in r.target_lines(m, [BF16], [8], [1, 2])[1]


def test_the_report_holds_one_table_per_state_dtype_and_the_spread():
    fp32 = [[dict(m, state=FP32) for m in grid_run()["times"]]]
    m = r.merge_runs([run([grid_run()["times"]] + fp32), run([grid_run()["times"]] + fp32)])
    text = r.render_report(m, [BF16, FP32], [8, 512], [1, 2], "the method line")
    assert text.index("**state bfloat16**") < text.index("**state float32**") < text.index("Targets")
    assert "copy 3000 GB/s (89% of its nominal 3352 GB/s" in text and "; median of 2 processes" in text
    assert "the method line" in text and "each timed value is the median of 2 of 2 processes." in text


def test_the_copy_is_put_on_the_scale_of_the_device_s_nominal_dram_peak_where_it_is_known():
    m = r.merge_runs([run([grid_run()["times"]])])
    m.device, m.copy_GBps = "NVIDIA H200, torch 2.11.0+cu130", 4224.0
    assert "copy 4224 GB/s (88% of its nominal 4800 GB/s: a cell's % of nominal DRAM peak is its % of copy " \
           "times 0.88); median" in r.render_report(m, [BF16], [8], [1], "method")
    m.device = "NVIDIA RTX 6000 Ada Generation, torch 2.11.0+cu130"
    assert "copy 4224 GB/s; median" in r.render_report(m, [BF16], [8], [1], "method")


def test_the_command_line_presets_and_its_refusals():
    quick = mtp_bench.parse_args(["--quick", "--out", "/tmp/x/mtp.md"])
    assert (quick.batches, quick.tokens, quick.procs) == ([1, 8, 128], [1, 4], 3)
    assert quick.states == ["bfloat16", "float32"] and quick.impls == list(r.IMPLS) and not quick.back_to_back
    full = mtp_bench.parse_args([])
    assert (full.batches, full.tokens) == ([1, 4, 8, 32, 128, 512], [1, 2, 4, 8])
    mine = mtp_bench.parse_args(["--quick", "--batches", "32", "--tokens", "2", "--states", "float32"])
    assert (mine.batches, mine.tokens, mine.states) == ([32], [2], ["float32"])
    assert mtp_bench.parse_args(["--tokens", "8", "9"]).tokens == [8, 9]  # vLLM 0.34's op takes 9
    assert full.heads == (16, 32) and mtp_bench.parse_args(["--heads", "32/32"]).heads == (32, 32)
    for bad in (["--procs", "0"], ["--tokens", "10"], ["--impls", "fla"], ["--heads", "16/24"], ["--heads", "16"]):
        with pytest.raises(SystemExit):
            mtp_bench.parse_args(bad)


def test_a_missing_or_broken_archive_of_vllm_s_library_is_a_reason_not_a_crash(tmp_path):
    so, why = mtp_bench.unpack_cuda_op(None, tmp_path)
    assert so == "" and "run benchmarks/fetch_vllm_ops.py" in why
    broken = tmp_path / "lib.so.xz"
    broken.write_bytes(b"not xz")
    so, why = mtp_bench.unpack_cuda_op(broken, tmp_path)
    assert so == "" and why.startswith(f"cannot decompress {broken}")


@pytest.fixture
def small_heads_on_cpu(monkeypatch):
    """mtp_bench's cells on CPU tensors with H=2, HV=4 (its TP=8 split): the same code, 8x less work."""
    pytest.importorskip("torch")
    monkeypatch.setattr(mtp_bench, "DEVICE", "cpu")
    for name in ("H", "HV", "CONV_BYTES"):  # set_heads rebinds them: monkeypatch restores them after
        monkeypatch.setattr(mtp_bench, name, getattr(mtp_bench, name))
    mtp_bench.set_heads(2, 4)
    assert mtp_bench.CONV_BYTES == 3 * (2 * 2 * 128 + 4 * 128) * 2


def checked_step(B=2, T=2, wrong=None):
    """mtp_bench's check of cudelta's MTP call (the reference on CPU tensors), optionally spoiled
    after the call by wrong(cell, state)."""
    from cudelta import vllm_compat

    cell = mtp_bench.Cell("bfloat16", B, T, seed=3)
    step = cell.mtp_call(vllm_compat.fused_gdn_decode_post_conv_mtp)

    def call(state, idx):
        step(state, idx)
        if wrong is not None:
            wrong(cell, state)

    skips = []
    result = {"checks": []}
    checked = mtp_bench.check_cell(cell, {"cudelta": call}, lambda impl, why: skips.append(why), result)
    return checked, result["checks"], skips


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_the_check_passes_the_step_and_names_a_wrong_output_a_wrong_state_and_a_stray_write():
    checked, (c,), skips = checked_step()
    assert c["ok"] and c["out_max_abs"] == 0 and list(checked) == ["cudelta"] and not skips

    def nudge_out(cell, state):
        cell.out[1, 3, 5] += 0.5

    _, (c,), _ = checked_step(wrong=nudge_out)
    assert not c["ok"] and c["detail"].startswith("out max |Δ| 0.") and c["detail"].endswith("its tolerance)")

    def spoil_state(cell, state):
        state[1] *= 1.1

    _, (c,), _ = checked_step(wrong=spoil_state)
    assert not c["ok"] and c["detail"].startswith("state max |Δ|")

    def write_a_spare_slot(cell, state):
        state[-1] += 1

    _, (c,), _ = checked_step(wrong=write_a_spare_slot)
    assert not c["ok"] and "a slot no call names (null block or spare) changed" in c["detail"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_an_implementation_that_raises_is_a_skip_with_its_reason_and_is_not_timed():
    def refuse(cell, state):
        raise NotImplementedError("cudelta: not yet supported by the CUDA kernels")

    checked, checks, skips = checked_step(wrong=refuse)
    assert checked == {} and checks == [] and skips == ["NotImplementedError: cudelta: not yet supported by the CUDA "
                                                        "kernels"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_the_t1_breakdown_s_five_calls_are_checked_each_against_its_own_reference(monkeypatch):
    import t1_epilogue_cost as t1

    rows = t1.check_all(mtp_bench.Cell("bfloat16", 2, 1, seed=5))
    assert [c["impl"] for c in rows] == ["alone", "alone+epi", "contract", "contract+epi", "compat"]
    assert all(c["ok"] for c in rows), rows
    # the bare step's outputs are not the epilogue's: a call checked against the wrong reference fails
    monkeypatch.setitem(t1.EPILOGUE, "contract", True)
    rows = t1.check_all(mtp_bench.Cell("bfloat16", 2, 1, seed=5))
    assert [c["impl"] for c in rows if not c["ok"]] == ["contract"]


@pytest.mark.usefixtures("small_heads_on_cpu")
def test_consecutive_slot_sets_name_the_same_slots_as_the_random_ones_side_by_side():
    import torch

    cell = mtp_bench.Cell("bfloat16", 3, 2, seed=7)
    drawn, side_by_side = cell.slot_sets(4), cell.slot_sets(4, consecutive=True)
    assert [s.shape for s in side_by_side] == [torch.Size([3, 2])] * 4
    assert all(s.dtype == torch.int32 and s.is_contiguous() for s in side_by_side)
    # the same 24 slots, never the null block 0, each once
    assert sorted(torch.cat([s.flatten() for s in drawn]).tolist()) == list(range(1, 25))
    assert torch.cat([s.flatten() for s in side_by_side]).tolist() == list(range(1, 25))
