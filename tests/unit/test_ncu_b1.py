"""benchmarks/ncu_b1.py's reading of ncu's CSV details page: the figures of its table are the
medians over the profiled launches, with ncu's units turned into the table's."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ncu_b1  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(launch: int, section: str, name: str, unit: str, value: str) -> str:
    return (f'"{launch}","7","python","gpu","void decode_vk_warp_kernel<128, float, 8, 1>(GdnDecodeParams)","1","7",'
            f'"(32, 1, 1)","(32, 32, 1)","0","9.0","{section}","{name}","{unit}","{value}"')


def details(launches: list[dict[str, tuple[str, str, str]]]) -> str:
    lines = ["==PROF== Connected to process 7 (/usr/bin/python3.12)", HEADER]
    for i, metrics in enumerate(launches):
        lines += [row(i, sec, name, unit, value) for name, (sec, unit, value) in metrics.items()]
    return "\n".join(lines) + "\n"


def launch(duration_ns: str, dram: str) -> dict[str, tuple[str, str, str]]:
    return {
        "Duration": ("GPU Speed Of Light Throughput", "nsecond", duration_ns),
        "DRAM Throughput": ("GPU Speed Of Light Throughput", "%", dram),
        "Elapsed Cycles": ("GPU Speed Of Light Throughput", "cycle", "10,312"),
        "SM Frequency": ("GPU Speed Of Light Throughput", "Ghz", "1.98"),
        "Grid Size": ("Launch Statistics", "", "1,024"),
        "Block Size": ("Launch Statistics", "", "32"),
        "Registers Per Thread": ("Launch Statistics", "register/thread", "70"),
        "Waves Per SM": ("Launch Statistics", "", "0.28"),
        "Block Limit Registers": ("Occupancy", "block", "28"),
        "Achieved Occupancy": ("Occupancy", "%", "11.6"),
        "Achieved Active Warps Per SM": ("Occupancy", "warp", "7.47"),
        "Warp Cycles Per Issued Instruction": ("Warp State Statistics", "cycle", "7.6"),
    }


def test_the_table_holds_the_median_of_each_figure_over_the_launches():
    text = details([launch("5,100", "12.0"), launch("5,200", "12.5"), launch("9,900", "30.0")])
    table = ncu_b1.ncu_table(ncu_b1.parse_details(text), 60)
    assert "median of 3 of 60 launches" in table
    assert "| duration (cold caches) | 5.2 µs (10,312 cycles at 1.98 Ghz) |" in table  # 5,200 ns, not the 9.9 µs outlier
    assert "| DRAM throughput | 12.5% |" in table
    assert "| grid × block | (32, 32, 1) × (32, 1, 1): 1,024 blocks of 32 threads, 0.28 waves |" in table
    assert "| registers | 70 per thread (28 blocks per SM possible) |" in table
    assert "| achieved occupancy | 11.6% (7.5 active warps per SM) |" in table
    assert "| warp cycles per issued instruction | 7.6 |" in table


def test_a_metric_ncu_did_not_report_reads_n_a_not_a_number():
    metrics = launch("5,100", "12.0")
    del metrics["Warp Cycles Per Issued Instruction"]
    table = ncu_b1.ncu_table(ncu_b1.parse_details(details([metrics])), 60)
    assert "| warp cycles per issued instruction | n/a |" in table


def test_no_profiled_launch_is_an_error_naming_the_kernel():
    with pytest.raises(SystemExit, match="ncu printed no metrics .*decode_vk_warp_kernel"):
        ncu_b1.parse_details("==PROF== Connected to process 7\n==WARNING== No kernels were profiled.\n")
