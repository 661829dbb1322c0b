"""The install record: written from the installer's real choice, judged against another machine's facts.

Each case below is a cached wheel meeting a machine: the record as the installer writes it (from
installer/choose/choose.py's Choice), this machine's facts, and the one line the loader says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from installer.choose import install_record
from installer.choose.choose import choose
from installer.choose.manifest import Asset, Manifest
from installer.core import cuda
from installer.core.target import Gpu, TargetEnv

reader = install_record.reader
Machine = reader.Machine
ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("sm_80", "sm_90a", "sm_100f", "sm_120f")
CU129 = "cudelta-0.1.0+cu129-cp310-abi3-manylinux_2_28_x86_64.whl"
CU130 = "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"
CU130_ARM = "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_aarch64.whl"
PIP, UV = "pip install --no-deps cudelta", "uv pip install --no-deps cudelta"  # stand-ins for _build_record's
CURE = f"pip cache remove cudelta && {PIP} (uv: uv cache clean cudelta && {UV})"


def asset(name: str, cuda: str) -> Asset:
    return Asset(name=name, size=1, sha256="0" * 64, cuda=cuda, platform=name.rsplit("-", 1)[1][:-4], archs=ARCHS,
                 ptx=("compute_120",), torch_floor="2.10", python_floor="3.10", driver_floor=cuda.split(".")[0] + ".0")


MANIFEST = Manifest(version="0.1.0", assets=(asset(CU129, "12.9"), asset(CU130, "13.0"), asset(CU130_ARM, "13.0")))
# The Docker build: no driver, no GPU, a CPU torch.
IMAGE_BUILD = TargetEnv(python_version=(3, 11), implementation="cpython", os_name="linux", machine="x86_64",
                        glibc=(2, 36), torch_version="2.13.0+cpu")
H100_HOST = Machine(os="linux", arch="x86_64", glibc=(2, 36), driver_cuda=(13, 0), gpus=((9, 0),))
SOURCE = {"asset": "", "sha256": "0" * 64, "url": "https://example.invalid/x.whl", "manifest": "manifest embedded in the sdist"}


def prebuilt_record(target: TargetEnv) -> dict:
    choice = choose(MANIFEST, target, "0.1.0")
    return install_record.prebuilt(target, choice, {**SOURCE, "asset": choice.asset.name})


def message(record: dict, machine: Machine):
    finding = reader.stale(record, machine)
    return finding and (finding.level, finding.message(PIP, UV))


# --- what the record holds --------------------------------------------------------------------


def test_a_prebuilt_record_keeps_the_facts_the_choice_was_made_from_and_every_other_asset():
    record = prebuilt_record(replace(IMAGE_BUILD, driver_cuda=(12, 8), driver_override=cuda.DriverOverride((12, 8)),
                                     overridden_driver_seen=None))
    assert record["schema"] == 2 and record["kind"] == "prebuilt"
    assert record["machine"] == {"os": "linux", "arch": "x86_64", "glibc": "2.36", "python": "3.11",
                                 "driver_cuda": None, "gpus": [], "torch": "2.13.0+cpu",
                                 "override": "CUDELTA_DRIVER_CUDA=12.8"}
    assert record["chosen"] == {"name": CU129, "platform": "manylinux_2_28_x86_64", "cuda": "12.9",
                                "driver_floor": "12.0", "archs": list(ARCHS), "ptx": ["compute_120"]}
    assert [c["name"] for c in record["candidates"]] == [CU129, CU130]  # the aarch64 one is not for this platform
    assert record["rejected"] == [
        [CU130, "the NVIDIA driver supports CUDA 12.8, older than the 13.0 that " + CU130 + " needs (update the driver)"],
        [CU130_ARM, "built for manylinux_2_28_aarch64, not manylinux_2_36_x86_64"],
    ]
    assert record["asset"] == CU129 and record["reason"].startswith(f"{CU129} matches: driver CUDA 12.8 by CUDELTA_DRIVER_CUDA")
    assert reader.loads(install_record.dumps(record)) == record  # what the wheel carries reads back whole


def test_the_pure_record_says_whether_the_user_or_the_platform_chose_it():
    by_user = install_record.pure(replace(IMAGE_BUILD, driver_override=cuda.DriverOverride(None)), "CUDELTA_DRIVER_CUDA=cpu: ...")
    assert by_user["pure_because"] == "override" and by_user["machine"]["override"] == "CUDELTA_DRIVER_CUDA=cpu"
    by_platform = install_record.pure(replace(IMAGE_BUILD, os_name="darwin", machine="arm64"), "darwin has no CUDA build")
    assert by_platform["pure_because"] == "platform" and by_platform["machine"]["override"] is None


def test_a_local_record_holds_what_was_compiled():
    build = {"cuda_toolkit": "13.0.88", "driver_floor": "13.0", "archs": ["sm_90a"], "ptx": []}
    record = install_record.local(replace(IMAGE_BUILD, driver_cuda=(13, 0), gpus=(Gpu(0, "H100", 9, 0),)),
                                  "FORCE_BUILD=1: compiling locally, no download", build, "linux_x86_64")
    assert record["kind"] == "local" and record["chosen"]["cuda"] == "13.0" and record["chosen"]["archs"] == ["sm_90a"]
    assert record["machine"]["gpus"] == ["9.0"]


@pytest.mark.parametrize("change, error", [
    ({"kind": "conda"}, "install record kind is 'conda'; expected one of prebuilt, pure, local"),
    ({"schema": 3}, "install record schema 3; this cudelta reads schemas 1 and 2"),
    ({"machine": {"os": "linux"}}, "install record machine lacks arch"),
    ({"rejected": [["only a name"]]}, "install record rejected[0] is ['only a name']; expected [asset, reason]"),
])
def test_a_record_that_is_not_one_names_the_key(change, error):
    record = {**prebuilt_record(IMAGE_BUILD), **change}
    with pytest.raises(reader.InstallRecordError) as exc:
        reader.parse(record)
    assert str(exc.value) == error


# --- would this machine choose differently? ------------------------------------------------------


def test_a_pure_wheel_from_a_gpu_less_runner_on_a_cuda_host():
    record = install_record.pure(replace(IMAGE_BUILD, driver_override=cuda.DriverOverride(None)), "CUDELTA_DRIVER_CUDA=cpu: ...")
    assert message(record, H100_HOST) == ("stale", (
        "this install was chosen for another machine: the pure-Python wheel (ops run the slow PyTorch reference) "
        "was chosen on a machine with no NVIDIA driver and no GPU (CUDELTA_DRIVER_CUDA=cpu), and this one has "
        "driver CUDA 13.0 and GPUs of compute 9.0. Clear the cached wheel and reinstall: " + CURE))


def test_a_pure_wheel_chosen_on_this_very_machine_stands():
    # CUDELTA_DRIVER_CUDA=cpu on the GPU host itself is a choice, not a stale cache.
    host = replace(IMAGE_BUILD, driver_cuda=(13, 0), gpus=(Gpu(0, "H100", 9, 0),))
    record = install_record.pure(replace(host, driver_cuda=None, driver_override=cuda.DriverOverride(None), overridden_driver_seen=(13, 0)),
                                 "CUDELTA_DRIVER_CUDA=cpu: ...")
    assert reader.stale(record, H100_HOST) is None


def test_an_asset_whose_driver_floor_this_driver_does_not_reach():
    record = prebuilt_record(replace(IMAGE_BUILD, driver_cuda=(13, 0), gpus=(Gpu(0, "H100", 9, 0),)))
    assert record["chosen"]["name"] == CU130
    old_driver = replace(H100_HOST, driver_cuda=(12, 8))
    assert message(record, old_driver) == ("stale", (
        f"this install was chosen for another machine: {CU130} needs a driver for CUDA >= 13.0 and this driver "
        "supports CUDA 12.8 (chosen on a machine with driver CUDA 13.0 and GPUs of compute 9.0). "
        "Clear the cached wheel and reinstall: " + CURE))


def test_an_asset_that_does_not_cover_this_gpu():
    record = prebuilt_record(IMAGE_BUILD)
    turing = replace(H100_HOST, gpus=((9, 0), (7, 5)))
    assert message(record, turing) == ("stale", (
        f"this install was chosen for another machine: {CU129} has no cubin or PTX for GPU 1 (compute 7.5); it "
        "holds sm_80, sm_90a, sm_100f, sm_120f, compute_120 (chosen on a machine with no NVIDIA driver and no GPU). "
        "Clear the cached wheel and reinstall: " + CURE))


def test_ptx_counts_only_where_this_driver_can_jit_it():
    # A compute 13.0 GPU has no cubin in the cu129 build, only its compute_120 PTX, which a driver
    # older than the 12.9 toolkit cannot JIT (its cubins run from the 12.0 floor up).
    record = prebuilt_record(IMAGE_BUILD)
    assert reader.stale(record, replace(H100_HOST, driver_cuda=(12, 9), gpus=((13, 0),))) is None
    assert message(record, replace(H100_HOST, driver_cuda=(12, 8), gpus=((13, 0),)))[1].startswith(
        f"this install was chosen for another machine: {CU129} has no cubin or PTX for GPU 0 (compute 13.0)")


def test_a_different_os_or_arch():
    record = prebuilt_record(IMAGE_BUILD)
    assert message(record, replace(H100_HOST, arch="aarch64")) == ("stale", (
        "this install was chosen for another machine: it was chosen on linux x86_64 and this is linux aarch64. "
        "Clear the cached wheel and reinstall: " + CURE))
    pure_mac = install_record.pure(replace(IMAGE_BUILD, os_name="darwin", machine="arm64"), "darwin has no CUDA build")
    assert message(pure_mac, H100_HOST)[1].startswith(
        "this install was chosen for another machine: it was chosen on darwin arm64 and this is linux x86_64.")


def test_a_glibc_older_than_the_asset_needs():
    record = prebuilt_record(IMAGE_BUILD)
    assert message(record, replace(H100_HOST, glibc=(2, 17)))[1].startswith(
        "this install was chosen for another machine: manylinux_2_28_x86_64 needs glibc >= 2.28 and this system "
        "has glibc 2.17.")


def test_chosen_without_a_driver_while_this_driver_runs_a_newer_toolkit_is_a_notice():
    record = prebuilt_record(IMAGE_BUILD)  # no driver: the most compatible build, cu129
    assert message(record, H100_HOST) == ("notice", (
        f"{CU129} was chosen on a machine with no NVIDIA driver and no GPU; this machine's driver (CUDA 13.0) runs "
        f"the newer {CU130}; to switch: " + CURE))


@pytest.mark.parametrize("machine", [
    replace(H100_HOST, driver_cuda=None, gpus=()),  # a CPU machine like the one it was built on
    replace(H100_HOST, driver_cuda=(12, 8), gpus=((8, 0),)),  # a 12.x driver: cu129 is what it would choose
])
def test_a_choice_this_machine_would_make_too_says_nothing(machine):
    assert reader.stale(prebuilt_record(IMAGE_BUILD), machine) is None


def test_a_schema_1_record_has_no_facts_to_judge():
    assert reader.stale(reader.parse({"asset": CU130, "sha256": "0" * 64, "url": "u", "manifest": "m"}), H100_HOST) is None


# --- the loader's side ---------------------------------------------------------------------------


def test_the_loader_s_line_uses_the_reinstall_command_of_the_build_record():
    pytest.importorskip("torch")
    from cudelta import _build_record, _native

    record = install_record.pure(replace(IMAGE_BUILD, driver_override=cuda.DriverOverride(None)), "CUDELTA_DRIVER_CUDA=cpu: ...")
    line = _native.install_check(record, H100_HOST)
    pip, uv = _build_record.reinstall_commands()
    assert "\n" not in line and line.endswith(
        f"Clear the cached wheel and reinstall: pip cache remove cudelta && {pip} (uv: uv cache clean cudelta && {uv})")
    assert _native.install_check(record, replace(H100_HOST, driver_cuda=None, gpus=())) is None


def test_the_loader_reads_gpus_from_libcuda_without_torch_s_cuda(tmp_path):
    pytest.importorskip("torch")
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, ROOT / "tests" / "e2e" / "fake_libcuda.c"], check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "CUDELTA_FAKE_DRIVER_VERSION": "12080",
           "CUDELTA_FAKE_GPUS": "9.0,7.5"}
    code = "import json; from cudelta import _native as n; m = n.this_machine(); print(json.dumps([m.driver_cuda, m.gpus]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [[12, 8], [[9, 0], [7, 5]]]


def test_python_m_cudelta_shows_the_facts_the_verdict_and_each_asset_not_chosen():
    pytest.importorskip("torch")
    from cudelta.__main__ import render_choice

    record = prebuilt_record(replace(IMAGE_BUILD, driver_cuda=(12, 8), gpus=(Gpu(0, "A100", 8, 0),)))
    check = "this install was chosen for another machine: ..."
    assert render_choice(record, check) == [
        "  chosen from  linux x86_64 glibc 2.36, Python 3.11, driver CUDA 12.8, GPUs 8.0, torch 2.13.0+cpu",
        f"  verdict      {CU129} matches: driver CUDA 12.8, GPU 0 sm_80 via sm_80 cubin, manylinux_2_36_x86_64",
        f"  not chosen   {CU130}: the NVIDIA driver supports CUDA 12.8, older than the 13.0 that {CU130} needs "
        "(update the driver)",
        f"  not chosen   {CU130_ARM}: built for manylinux_2_28_aarch64, not manylinux_2_36_x86_64",
        f"  this machine {check}",
    ]
    assert render_choice(record, None)[-1] == "  this machine would choose the same"
