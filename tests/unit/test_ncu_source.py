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


# A grid of 4 working warps (and 4 extra ones that return at once, as cu_seqlens' spare request's
# do) and T = 3: a prefix all 8 warps run, straight code once a warp, a loop body once a token.
PHASED = [("LDC R1, c[0x0][0x28]", 8, 8, 0, 0), ("LDG.E R2, desc[UR4][R2.64]", 30, 4, 0, 30),
          ("IMAD R3, R2, R2, RZ", 2, 4, 0, 0), ("FFMA R1, R2, R3, R1", 40, 12, 0, 0),
          ("SHFL.BFLY PT, R4, R1, 0x1, 0x1f", 10, 12, 0, 0), ("BAR.SYNC.DEFER_BLOCKING 0x0", 0, 4, 0, 0),
          ("STG.E desc[UR4][R6.64], R1", 10, 4, 10, 0), ("EXIT", 0, 4, 0, 0)]


def test_the_phases_split_one_warps_path_at_the_token_loop():
    prof = ncu_source.parse(launch(STREAM, PHASED) + launch(STREAM, PHASED))[STREAM]
    before, loop, after = prof.phases(tokens=3)
    assert (before.name, loop.name, after.name) == ("before the loop", "token loop", "after the loop")
    # The extra warps' prefix counts in the working warps' path (8 / 4), as it does in their samples.
    assert before.path == 2 + 1 + 1 and loop.path == 3 + 3 and after.path == 3
    assert (before.share, loop.share, after.share) == (40.0, 50.0, 10.0)
    assert before.reasons == [("long_sb", 75.0)] and loop.reasons == [] and after.reasons == [("barrier", 100.0)]


def test_an_unrolled_loop_is_found_and_one_token_has_none():
    # The same body taking two tokens an iteration: at T = 6 it runs 3 times a warp, not 6.
    prof = ncu_source.parse(launch(STREAM, PHASED))[STREAM]
    before, loop, after = prof.phases(tokens=6)
    assert before.path == 2 + 1 + 1 and loop.path == 3 + 3 and after.path == 3
    before, loop, after = prof.phases(tokens=1)  # T = 1: no loop, whatever ran more than once
    assert before.path == 2 + 1 + 1 + 3 + 3 + 3 and loop.path == after.path == 0


def test_the_loop_is_the_heaviest_run_not_the_first():
    # A prefix that the grid's extra warps also run (twice the working warps' count) before the loop.
    rows = [("LDC R1, c[0x0][0x28]", 1, 8, 0, 0), ("IMAD R2, R1, R1, RZ", 1, 8, 0, 0),
            ("LDG.E R2, desc[UR4][R2.64]", 1, 4, 0, 1), ("NOP", 0, 0, 0, 0), ("FFMA R1, R2, R3, R1", 1, 16, 0, 0),
            ("NOP", 0, 0, 0, 0), ("FFMA R1, R2, R3, R1", 1, 16, 0, 0), ("STG.E desc[UR4][R6.64], R1", 1, 4, 0, 0),
            ("EXIT", 1, 4, 0, 0)]
    before, loop, after = ncu_source.parse(launch(STREAM, rows))[STREAM].phases(tokens=4)
    assert before.path == 2 + 2 + 1 and loop.path == 4 + 4 and after.path == 1 + 1
