"""benchmarks/ncu_source.py's reading of ncu's source page: each kernel's launches summed
instruction by instruction, stall reasons as shares of all samples, and a wait at a block barrier
named as such (ncu samples it at the instruction after the BAR.SYNC)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ncu_source  # noqa: E402

HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"Instructions Executed","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"')


def launch(kernel: str, rows: list[tuple[str, int, int, int, int]]) -> str:
    """rows: (SASS, samples, executed, barrier samples, long-scoreboard samples)."""
    lines = [f'"Kernel Name","{kernel}",', HEAD]
    for i, (sass, samples, executed, barrier, long_sb) in enumerate(rows):
        lines.append(f'"0x{0x7f00 + 16 * i:x}","{sass}","{samples}","{samples}","{executed:,}","{barrier}",'
                     f'"{long_sb}","{barrier}"')
    return "\n".join(lines) + "\n"


STREAM = "void cudelta::<unnamed>::decode_mtp_stream_kernel<(bool)1, (int)128, __nv_bfloat16, (bool)0>(cudelta::GdnDecodeParams)"
# As sm_90a's streaming kernel has it: the barrier's waits sampled at the BSSY after the PLOP3.
CODE = ["LDG.E R2, desc[UR4][R2.64]", "BAR.SYNC.DEFER_BLOCKING 0x0", "PLOP3.LUT P1, PT, PT, PT, UP0, 0x40, 0x0",
        "BSSY B0, 0x7f80", "FFMA R1, R2, R3, R1"]


def test_launches_of_one_kernel_are_summed_and_a_barrier_wait_is_named():
    page = ("==PROF== Connected to process 7\n"
            + launch(STREAM, [(CODE[0], 2, 1000, 0, 2), (CODE[1], 0, 1000, 0, 0), (CODE[2], 0, 1000, 0, 0),
                              (CODE[3], 5, 1000, 5, 0), (CODE[4], 1, 1000, 0, 0)])
            + launch(STREAM, [(CODE[0], 4, 1000, 0, 4), (CODE[1], 0, 1000, 0, 0), (CODE[2], 0, 1000, 0, 0),
                              (CODE[3], 7, 1000, 7, 0), (CODE[4], 1, 1000, 0, 0)]))
    prof = ncu_source.parse(page)[STREAM]
    assert prof.launches == 2
    assert prof.samples == [6, 0, 0, 12, 2] and prof.total == 20
    assert prof.executed_per_launch() == 5000
    # Only the issued-or-not reasons count, not their "(Not Issued)" copies.
    assert prof.reason_shares() == [("barrier", 60.0), ("long_sb", 30.0)]
    assert prof.hottest() == (60.0, "BSSY B0, 0x7f80 (after BAR.SYNC)")


def test_each_kernel_keeps_its_own_profile():
    other = "gdn_decode_post_conv_mtp_kernel(Params)"
    page = launch(STREAM, [(CODE[0], 3, 10, 0, 3)]) + launch(other, [(CODE[4], 1, 10, 0, 0), (CODE[0], 1, 10, 0, 1)])
    profiles = ncu_source.parse(page)
    assert set(profiles) == {STREAM, other}
    assert profiles[other].hottest() == (50.0, CODE[4])  # no barrier before it: named as is


def test_a_kernel_whose_launches_ran_different_code_is_refused():
    page = launch(STREAM, [(CODE[0], 1, 1, 0, 1)]) + launch(STREAM, [(CODE[0], 1, 1, 0, 1), (CODE[4], 1, 1, 0, 0)])
    with pytest.raises(ValueError, match="different code"):
        ncu_source.parse(page)


def test_a_page_without_samples_gives_nothing():
    assert ncu_source.parse('"Kernel Name","k",\n"Address","Source"\n"0x1","NOP"\n') == {}
    assert ncu_source.parse("==PROF== no kernels were profiled\n") == {}
