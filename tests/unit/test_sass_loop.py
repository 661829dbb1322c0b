"""benchmarks/sass_loop.py finds a kernel's loops in cuobjdump's SASS and counts what they issue."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sass_loop  # noqa: E402

# Two kernels as cuobjdump -sass prints them (encodings on their own lines, as there). The step's
# token loop (0x0030-0x0090) reduces, stores and branches back; inside it a forward branch; the
# epilogue's loop (0x00b0-0x00c0) stores but does not reduce.
SASS = """
\t\tFunction : _ZN7cudelta4stepEv
\t.headerflags\t@"EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                          /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   MOV R2, RZ ;                           /* 0x000000ff00027202 */
        /*0030*/                   LDS.128 R4, [R0] ;                     /* 0x0000000000047984 */
        /*0040*/                   FFMA R6, R4, R5, RZ ;                  /* 0x0000000504067223 */
        /*0050*/                   SHFL.BFLY PT, R7, R6, 0x1, 0x1f ;      /* 0x0c201f0006077f89 */
        /*0060*/              @!P0 BRA 0x80 ;                             /* 0x0000000000048947 */
        /*0070*/                   STG.E.EF.128 desc[UR4][R8.64], R4 ;    /* 0x0000000408007986 */
        /*0080*/                   IADD3 R2, R2, 0x1, RZ ;                /* 0x0000000102027810 */
        /*0090*/              @!P1 BRA 0x30 ;                             /* 0xffffffe400e49947 */
        /*00a0*/                   F2FP.BF16.F32.PACK_AB R3, RZ, R6 ;     /* 0x000000060003723e */
        /*00b0*/                   STG.E.U16 desc[UR4][R10.64], R3 ;      /* 0x000000030a007986 */
        /*00c0*/               @P2 BRA 0xb0 ;                             /* 0xfffffffc00e42947 */
        /*00d0*/                   EXIT ;                                 /* 0x000000000000794d */
\t\tFunction : _ZN7cudelta4zeroEv
        /*0000*/                   STG.E desc[UR4][R2.64], RZ ;           /* 0x000000ff02007986 */
        /*0010*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_instructions_are_read_per_function_in_address_order():
    by_name = sass_loop.functions(SASS)
    assert sorted(by_name) == ["_ZN7cudelta4stepEv", "_ZN7cudelta4zeroEv"]
    step = by_name["_ZN7cudelta4stepEv"]
    assert [i.address for i in step] == list(range(0, 0xE0, 0x10))
    assert step[5].opcode == "SHFL.BFLY" and step[5].family == "SHFL"
    assert step[6].opcode == "BRA" and step[6].operands == "0x80"  # the predicate is not the opcode


def test_a_backward_branch_makes_a_loop_and_a_forward_one_does_not():
    found = sass_loop.loops(sass_loop.functions(SASS)["_ZN7cudelta4stepEv"])
    assert [(loop.start, loop.end) for loop in found] == [(0xB0, 0xC0), (0x30, 0x90)]
    token = found[1]
    assert len(token.instructions) == 7
    assert token.mix()["FFMA"] == 1 and token.mix()["STG"] == 1 and token.mix()["BRA"] == 2


def test_the_token_loop_is_the_one_that_reduces_and_stores():
    found = sass_loop.loops(sass_loop.functions(SASS)["_ZN7cudelta4stepEv"])
    assert [(loop.start, loop.end) for loop in sass_loop.holding(found, ["SHFL", "STG"])] == [(0x30, 0x90)]
    assert len(sass_loop.holding(found, [])) == 2


def test_the_table_counts_each_column_and_the_rest():
    found = sass_loop.holding(sass_loop.loops(sass_loop.functions(SASS)["_ZN7cudelta4stepEv"]), ["SHFL"])
    row = sass_loop.table("step", found, limit=4).splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "0x30-0x90" and cells[1] == "7"
    counts = dict(zip(sass_loop.COLUMNS, map(int, cells[2:-1])))
    assert counts == {"FFMA": 1, "FMUL": 0, "FADD": 0, "SHFL": 1, "LDS": 1, "STS": 0, "LDG": 0, "STG": 1, "F2FP": 0, "BAR": 0}
    assert cells[-1] == "3"  # two BRA and the IADD3


def test_a_kernel_name_must_match_exactly_one_function(capsys):
    names = sorted(sass_loop.functions(SASS))
    assert sass_loop.pick(names, "4step") == "_ZN7cudelta4stepEv"
    with pytest.raises(SystemExit, match="2 functions match 'cudelta'"):
        sass_loop.pick(names, "cudelta")
    with pytest.raises(SystemExit, match="(?s)no function matches 'decode'.*_ZN7cudelta4stepEv"):
        sass_loop.pick(names, "decode")


def test_the_command_reads_dumped_text(tmp_path, capsys):
    dumped = tmp_path / "step.sass"
    dumped.write_text(SASS)
    assert sass_loop.main(["--sass", str(dumped), "--kernel", "4step"]) == 0
    out = capsys.readouterr().out
    assert "| 0x30-0x90 | 7 |" in out and "0xb0" not in out
