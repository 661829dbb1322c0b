"""The release policy (cudelta/_release_policy.py) is whole: every toolkit the matrix builds has a
newest GCC and a driver floor, and every user reads the policy rather than a copy of it."""

from __future__ import annotations

import importlib

import pytest

from installer.compile import build_record, native
from installer.core import cuda, shipped
from installer.core.errors import InstallerError
from installer.detect import toolchain
from release import dry_run, make_release, matrix

POLICY = shipped.load("_release_policy")


@pytest.mark.parametrize("toolkit", sorted({c["cuda"] for c in matrix.cells()}))
def test_every_toolkit_the_matrix_builds_has_a_newest_gcc_and_a_driver_floor(toolkit):
    assert POLICY.newest_gcc(toolkit) >= 11
    assert POLICY.driver_floor(toolkit) == (cuda.parse_version(toolkit)[0], 0)
    assert cuda.parse_version(toolkit) in POLICY.MAX_GCC_FOR_CUDA


def test_the_matrix_builds_the_policy_s_toolkits_and_the_dry_run_one_of_them():
    assert {c["cuda"] for c in matrix.cells()} == set(POLICY.CUDA_VERSIONS)
    assert dry_run.CELL_CUDA == POLICY.CELL_CUDA and POLICY.CELL_CUDA in POLICY.CUDA_VERSIONS


def test_a_toolkit_without_a_gcc_entry_fails_the_matrix_loudly(monkeypatch):
    monkeypatch.setattr(matrix, "CUDA_VERSIONS", (*POLICY.CUDA_VERSIONS, "13.7"))
    with pytest.raises(ValueError, match=r"no newest GCC for CUDA 13\.7: add it to MAX_GCC_FOR_CUDA"):
        matrix.cells()
    assert matrix.main([]) == 2


def test_the_driver_floor_is_the_toolkit_s_major_everywhere_it_is_stated():
    record = build_record.build_record(version="0.1.0", toolkit="12.9.41", archs=native.parse_archs(["9.0a"]),
                                       torch_version="2.14.1", torch_floor=POLICY.TORCH_FLOOR, kind="release",
                                       compressed=True, revision="x")
    assert record["driver_floor"] == "12.0" and record["python_floor"] == POLICY.PYTHON_FLOOR
    info = {"cuda_toolkit": "12.9", "torch_floor": "2.10", "python_floor": "3.10", "archs": ["sm_90a"], "ptx": []}
    asset = make_release.make_asset("cudelta-0.1.0+cu129-cp310-abi3-manylinux_2_28_x86_64.whl", 1, "ab" * 32, info)
    assert asset.driver_floor == "12.0"


def test_the_run_time_guard_applies_the_policy_to_a_record_without_a_floor():
    _native = pytest.importorskip("cudelta._native")
    assert _native.driver_floor({"cuda_toolkit": "13.0.88"}) == POLICY.driver_floor("13.0.88") == (13, 0)
    # The runtime module is the installer's, loaded by path: one file, not a copy.
    assert importlib.import_module("cudelta._release_policy").__file__ == POLICY.__file__


def test_the_newest_gcc_is_enforced_from_the_policy():
    for toolkit in POLICY.CUDA_VERSIONS:
        limit = POLICY.newest_gcc(toolkit)
        toolchain.check_toolchain(toolkit, toolkit, limit)
        with pytest.raises(InstallerError, match=f"nvcc {toolkit} supports GCC <= {limit}"):
            toolchain.check_toolchain(toolkit, toolkit, limit + 1)


def test_torch_target_version_encodes_the_policy_s_torch_floor():
    major, minor = (int(x) for x in POLICY.TORCH_FLOOR.split("."))
    assert int(native.TORCH_TARGET_VERSION, 16) == major << 56 | minor << 48


def test_a_bad_toolkit_is_named():
    with pytest.raises(ValueError, match="'thirteen' is not a CUDA version"):
        POLICY.driver_floor("thirteen")
