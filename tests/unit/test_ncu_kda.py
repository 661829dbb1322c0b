"""benchmarks/ncu_kda.py without a GPU or ncu: its table from ncu's CSV as ncu prints it (the header
and the kernel signatures of an H200 run), one row a launch, labelled by cell."""

import csv
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ncu_kda  # noqa: E402
import ncu_mtp  # noqa: E402

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
          "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]
CONV = "void cudelta::<unnamed>::conv_update_f32_taps_kernel<4, 2>(cudelta::ConvUpdateParams)"
STEP = "void cudelta::<unnamed>::decode_vk_one_kernel<128, float, 8, 1, 1, 2>(cudelta::GdnDecodeParams)"
VLLM = "void <unnamed>::kda_decode_fusion_many_heads_kernel<1, 1, 12, 12>(const __nv_bfloat16 *, int)"


def ncu_csv(launches):
    """launches: [(signature, grid, block, {metric: (unit, value)})] -> ncu's CSV, with the '==PROF=='
    lines ncu prints before it."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 866\n")
    w = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(HEADER)
    for i, (sig, grid, block, metrics) in enumerate(launches):
        for name, (unit, value) in metrics.items():
            w.writerow([str(i), "866", "python3.12", "127.0.0.1", sig, "1", "7", block, grid, "0", "9.0",
                        "Launch Statistics", name, unit, value])
    return out.getvalue()


def test_kernel_names_lose_their_namespace_template_and_arguments():
    # ncu_kda names launches with ncu_mtp's short_name; these are the signatures its table meets.
    assert ncu_mtp.short_name(CONV) == "conv_update_f32_taps_kernel"
    assert ncu_mtp.short_name(STEP) == "decode_vk_one_kernel"
    assert ncu_mtp.short_name(VLLM) == "kda_decode_fusion_many_heads_kernel"


def test_one_row_a_launch_in_launch_order_three_a_cell():
    step = {"Registers Per Thread": ("register/thread", "128"), "Block Limit Registers": ("block", "2"),
            "Waves Per SM": ("", "1.05"), "Duration": ("ns", "14,496"), "Frame Rate": ("hz", "9")}
    vllm = {"Registers Per Thread": ("register/thread", "56"), "Static Shared Memory Per Block": ("byte/block", "36,356"),
            "Block Limit Registers": ("block", "4"), "Achieved Occupancy": ("%", "25.46")}
    text = ncu_csv([(CONV, "(18, 23, 1)", "(64, 1, 1)", {"Waves Per SM": ("", "0.20")}),
                    (STEP, "(276, 1, 1)", "(256, 1, 1)", step), (VLLM, "(23, 12, 1)", "(256, 1, 1)", vllm),
                    (CONV, "(18, 32, 1)", "(64, 1, 1)", {"Waves Per SM": ("", "0.27")}),
                    (STEP, "(384, 1, 1)", "(256, 1, 1)", step), (VLLM, "(32, 12, 1)", "(256, 1, 1)", vllm)])
    rows = ncu_kda.table(text, [(12, 23), (12, 32)]).splitlines()[2:]
    assert len(rows) == 6
    cols = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    heads = ["cell", "kernel", "grid", "block", *ncu_kda.METRICS.values()]
    by = [dict(zip(heads, c)) for c in cols]
    assert [b["cell"] for b in by] == ["H=12 B=23"] * 3 + ["H=12 B=32"] * 3
    assert [b["kernel"] for b in by] == ["conv_update_f32_taps_kernel", "decode_vk_one_kernel",
                                         "kda_decode_fusion_many_heads_kernel"] * 2
    assert by[1]["regs"] == "128" and by[1]["blocks/SM by regs"] == "2" and by[1]["waves/SM"] == "1.05"
    assert by[1]["duration"] == "14,496 ns" and by[1]["grid"] == "(276, 1, 1)"
    assert by[2]["static smem"] == "36,356 B" and by[2]["achieved occ. %"] == "25.46%"
    assert by[0]["regs"] == ""  # a metric ncu did not print for that launch stays empty


def test_the_launch_table_refuses_a_launch_count_that_would_shift_the_labels():
    launch = (CONV, "(18, 23, 1)", "(64, 1, 1)", {"Waves Per SM": ("", "0.20")})
    with pytest.raises(SystemExit, match="profiled 4 launches, expected 3"):
        ncu_kda.table(ncu_csv([launch] * 4), [(12, 23)])


def test_no_metrics_names_what_ncu_printed():
    with pytest.raises(SystemExit, match="ncu printed no metrics"):
        ncu_kda.table("==ERROR== the application returned an error code (1)\n", [(12, 23)])


def raw_csv(launches):
    """launches: [(signature, grid, {raw metric: value})] -> ncu's --page raw CSV: a header row, a
    units row, a row a launch."""
    names = sorted({m for _, _, metrics in launches for m in metrics})
    units = {"gpu__time_duration.sum": "usecond", "dram__bytes_read.sum": "Mbyte", "dram__bytes_write.sum": "Gbyte"}
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(["ID", "Kernel Name", "Grid Size", "Block Size", *names])
    w.writerow(["", "", "", "", *(units.get(n, "") for n in names)])
    for i, (sig, grid, metrics) in enumerate(launches):
        w.writerow([str(i), sig, grid, "(256, 1, 1)", *(metrics.get(n, "") for n in names)])
    return "==PROF== Disconnected\n" + out.getvalue()


def test_stalls_a_row_a_kernel_a_cell_medians_over_its_calls_bytes_in_mb():
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    def step(us, read):
        return {"gpu__time_duration.sum": us, "dram__bytes_read.sum": read, "dram__bytes_write.sum": "0.1",
                stall.format("long_scoreboard"): "9.5", stall.format("barrier"): "2.0",
                stall.format("wait"): "1.0", stall.format("selected"): "0.5"}
    calls = [(CONV, "(18, 128, 1)", {"gpu__time_duration.sum": "4.0"}), (STEP, "(1536, 1, 1)", step("50.0", "100")),
             (VLLM, "(128, 12, 1)", {"gpu__time_duration.sum": "58.0"})]
    calls2 = [calls[0], (STEP, "(1536, 1, 1)", step("54.0", "102")), calls[2]]
    other = [(CONV, "(18, 32, 1)", {"gpu__time_duration.sum": "3.0"}), (STEP, "(1536, 1, 1)", step("52.0", "90")),
             (VLLM, "(32, 48, 1)", {"gpu__time_duration.sum": "57.0"})]
    rows = ncu_mtp.raw_rows(raw_csv(calls + calls2 + other + other))
    lines = ncu_kda.stall_table(rows, [(12, 128), (48, 32)], calls=2)
    body = [[c.strip() for c in r.strip("|").split("|")] for r in lines[2:]]
    assert [(b[0], b[1].split()[0], b[2]) for b in body] == [
        ("H=12 B=128", "conv_update_f32_taps_kernel", "2"), ("H=12 B=128", "decode_vk_one_kernel", "2"),
        ("H=12 B=128", "kda_decode_fusion_many_heads_kernel", "2"), ("H=48 B=32", "conv_update_f32_taps_kernel", "2"),
        ("H=48 B=32", "decode_vk_one_kernel", "2"), ("H=48 B=32", "kda_decode_fusion_many_heads_kernel", "2")]
    heads = ["cell", "kernel", "launches", *ncu_kda.STALL_COLUMNS.values(), "stalls"]
    step_row = dict(zip(heads, body[1]))
    assert step_row["µs"] == "52.0"  # the median of the cell's two calls, not the other cell's
    assert step_row["DRAM read MB"] == "101.0" and step_row["DRAM write MB"] == "100.0"  # 0.1 Gbyte
    assert step_row["stalls"] == "long_scoreboard 9.5, barrier 2.0, wait 1.0"
    assert dict(zip(heads, body[0]))["DRAM read MB"] == "n/a"  # not collected for that launch


def test_stalls_refuse_a_launch_count_that_would_shift_the_labels():
    launch = (CONV, "(18, 128, 1)", {"gpu__time_duration.sum": "4.0"})
    rows = ncu_mtp.raw_rows(raw_csv([launch] * 5))
    with pytest.raises(SystemExit, match="profiled 5 launches, expected 6"):
        ncu_kda.stall_table(rows, [(12, 128)], calls=2)


def test_bytes_in_a_unit_not_known_read_as_n_a_and_say_so(capsys):
    # A scale guessed as 1 would put bytes or Tbytes in the MB column unseen.
    rows = ncu_mtp.raw_rows(raw_csv([(STEP, "(1536, 1, 1)", {"dram__bytes_read.sum": "3"})]))
    rows[0]["dram__bytes_read.sum"] = ("3", "Tbyte")
    assert ncu_mtp.number(rows[0], "dram__bytes_read.sum") is None
    assert "dram__bytes_read.sum in unit 'Tbyte' is read as n/a" in capsys.readouterr().err
    assert ncu_mtp.medians(rows, ["dram__bytes_read.sum"]) == ["n/a"]
    rows[0]["dram__bytes_read.sum"] = ("3", "Kbyte")
    assert ncu_mtp.number(rows[0], "dram__bytes_read.sum") == pytest.approx(3e-3)
