"""benchmarks/traffic_bound.py's yardstick: the mover is checked, before it is timed, to move a
request's start slot into each of its checkpoint slots and to touch no other byte of the pool."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mtp_bench  # noqa: E402
import traffic_bound as tb  # noqa: E402


@pytest.fixture
def small_heads_on_cpu(monkeypatch):
    """mtp_bench's cells on CPU tensors with H=2, HV=4, as tests/unit/test_mtp_report.py runs them."""
    pytest.importorskip("torch")
    monkeypatch.setattr(mtp_bench, "DEVICE", "cpu")
    for name in ("H", "HV", "CONV_BYTES"):
        monkeypatch.setattr(mtp_bench, name, getattr(mtp_bench, name))
    mtp_bench.set_heads(2, 4)


def test_the_expected_pool_holds_each_start_slot_in_its_requests_checkpoint_slots():
    import torch

    state = torch.arange(8.0).view(8, 1) * torch.ones(8, 3)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    acc = torch.tensor([2, 3], dtype=torch.int32)
    start = tb.start_slots(idx, acc)
    assert start.tolist() == [2, 6]
    after = tb.expected_fan_out(state, idx, start)
    assert after[:, 0].tolist() == [0, 2, 2, 2, 6, 6, 6, 7]
    assert state[:, 0].tolist() == list(range(8))  # the input pool is not touched


@pytest.mark.usefixtures("small_heads_on_cpu")
def test_the_mover_check_passes_a_right_mover_and_stops_one_that_misses_a_slot_or_writes_outside():
    def right(state, idx, start):
        state.copy_(tb.expected_fan_out(state, idx, start))

    def misses_the_last_token(state, idx, start):
        state.copy_(tb.expected_fan_out(state, idx[:, :-1], start))

    def writes_a_spare_slot(state, idx, start):
        right(state, idx, start)
        state[-1] += 1

    cell = mtp_bench.Cell("bfloat16", 2, 3, seed=4)
    tb.check_mover(cell, right)
    for wrong in (misses_the_last_token, writes_a_spare_slot):
        with pytest.raises(SystemExit, match="bfloat16 B=2 T=3: the mover moved the wrong bytes"):
            tb.check_mover(mtp_bench.Cell("bfloat16", 2, 3, seed=4), wrong)


def test_a_row_reads_each_time_as_a_share_of_the_copy_and_cudelta_as_a_share_of_the_mover():
    row = dict(state="bfloat16", B=128, T=2, us=dict(copy=90.0, mover=100.0, cudelta=125.0))
    assert tb.row_text(row) == "| bfloat16 | 128 | 2 | 90.0 | 100.0 (90%) | 125.0 (72%) | 80% |"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.usefixtures("small_heads_on_cpu")
def test_cudelta_s_step_is_checked_by_mtp_bench_s_check_and_a_wrong_one_stops_the_run():
    from cudelta import vllm_compat

    cell = mtp_bench.Cell("bfloat16", 2, 2, seed=6)
    step = cell.mtp_call(vllm_compat.fused_gdn_decode_post_conv_mtp)
    tb.check_step(cell, step)

    def spoils_a_state(state, idx):
        step(state, idx)
        state[idx[0, 0]] *= 1.1

    with pytest.raises(SystemExit, match="bfloat16 B=2 T=2: cudelta disagrees with the reference: state max"):
        tb.check_step(cell, spoils_a_state)
