from dataclasses import replace

import pytest
from packaging.tags import Tag

from installer.choose import (
    Choice,
    arch_covers,
    choose,
    covering_arch,
    linux_platforms,
    target_platforms,
    target_tags,
)
from installer.manifest import Asset, Manifest
from installer.target import Gpu, TargetEnv

RELEASE_ARCHS = ("sm_80", "sm_90a", "sm_100f", "sm_120f")


def asset(cuda="13.0", platform="manylinux_2_28_x86_64", version="0.1.0", archs=RELEASE_ARCHS,
          ptx=("compute_120",), torch_floor="2.10", python_floor="3.10", driver_floor=None, tag="cp310-abi3"):
    label = "cu" + cuda.replace(".", "")
    return Asset(
        name=f"cudelta-{version}+{label}-{tag}-{platform}.whl", size=1, sha256="0" * 64, cuda=cuda,
        platform=platform, archs=tuple(archs), ptx=tuple(ptx), torch_floor=torch_floor,
        python_floor=python_floor, driver_floor=driver_floor or cuda,
    )


def manifest(*assets, version="0.1.0"):
    return Manifest(version=version, assets=tuple(assets) or (asset(),))


H200 = Gpu(0, "NVIDIA H200", 9, 0)
TARGET = TargetEnv(
    python_version=(3, 11), implementation="cpython", os_name="linux", machine="x86_64",
    glibc=(2, 36), torch_version="2.14.1+cu130", torch_cuda="13.0", torch_cxx11_abi=True,
    driver_cuda=(13, 0), gpus=(H200,),
)


def target(**changes):
    return replace(TARGET, **changes)


# --- arch coverage ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, cc, covered",
    [
        ("sm_80", (8, 0), True), ("sm_80", (8, 6), True), ("sm_80", (8, 9), True),
        ("sm_80", (7, 5), False), ("sm_80", (9, 0), False),
        ("sm_86", (8, 0), False),
        ("sm_90a", (9, 0), True), ("sm_90a", (9, 1), False), ("sm_90a", (10, 0), False),
        ("sm_100f", (10, 0), True), ("sm_100f", (10, 3), True), ("sm_100f", (12, 0), False),
        ("sm_103f", (10, 0), False),
        ("sm_120f", (12, 1), True), ("sm_120f", (11, 0), False),
        ("compute_120", (12, 1), True), ("compute_120", (12, 0), True), ("compute_120", (13, 0), True),
        ("compute_120", (11, 0), False), ("compute_120", (9, 0), False),
        ("compute_90a", (9, 0), True), ("compute_90a", (10, 0), False),
    ],
)
def test_arch_covers(arch, cc, covered):
    assert arch_covers(arch, *cc) is covered


def test_arch_covers_rejects_junk():
    with pytest.raises(ValueError):
        arch_covers("sm_9", 9, 0)
    with pytest.raises(ValueError):
        arch_covers("gfx90a", 9, 0)


def test_covering_arch_prefers_cubin_then_nearest_then_specific():
    archs = RELEASE_ARCHS + ("compute_120",)
    assert covering_arch(archs, 9, 0) == "sm_90a"
    assert covering_arch(archs, 8, 9) == "sm_80"
    assert covering_arch(archs, 10, 3) == "sm_100f"
    assert covering_arch(archs, 12, 1) == "sm_120f"
    assert covering_arch(archs, 13, 0) == "compute_120"
    assert covering_arch(archs, 7, 5) is None
    assert covering_arch(["sm_80", "sm_86"], 8, 9) == "sm_86"
    assert covering_arch(["sm_90", "sm_90a"], 9, 0) == "sm_90a"


# --- tags ------------------------------------------------------------------------------------


def test_linux_platforms_follow_the_targets_glibc():
    platforms = linux_platforms("x86_64", (2, 36))
    assert platforms[0] == "manylinux_2_36_x86_64"
    assert "manylinux_2_28_x86_64" in platforms
    assert platforms.index("manylinux2014_x86_64") == platforms.index("manylinux_2_17_x86_64") + 1
    assert "manylinux1_x86_64" in platforms and platforms[-1] == "linux_x86_64"
    arm = linux_platforms("aarch64", (2, 28))
    assert arm[-3:] == ["manylinux_2_17_aarch64", "manylinux2014_aarch64", "linux_aarch64"]
    assert "manylinux_2_29_x86_64" not in platforms[platforms.index("manylinux_2_28_x86_64"):]
    assert linux_platforms("x86_64", None) == ["linux_x86_64"]  # musl: no manylinux


def test_target_tags():
    tags = target_tags(TARGET)
    assert tags[0] == Tag("cp311", "cp311", "manylinux_2_36_x86_64")
    assert Tag("cp310", "abi3", "manylinux_2_28_x86_64") in tags
    assert Tag("py3", "none", "any") in tags
    free = target_tags(target(python_version=(3, 13), free_threaded=True, abiflags="t"))
    assert Tag("cp313", "cp313t", "manylinux_2_36_x86_64") in free
    assert not [t for t in free if t.abi == "abi3"]
    assert target_platforms(target(os_name="windows")) == ["win_amd64"]


# --- choose: matches -------------------------------------------------------------------------


def test_match_reason_names_everything_that_matched():
    choice = choose(manifest(), TARGET, "0.1.0")
    assert choice.asset is not None and choice.asset.cuda == "13.0"
    assert not choice.pure_python
    assert choice.reason == (
        "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl matches: torch 2.14.1+cu130 "
        "(CUDA 13.0), driver CUDA 13.0, GPU 0 sm_90 via sm_90a cubin, manylinux_2_36_x86_64"
    )
    assert "\n" not in choice.reason


def test_highest_toolkit_minor_not_above_torch_is_preferred():
    m = manifest(asset("13.0"), asset("13.2"))
    assert choose(m, target(torch_version="2.14.1+cu132", torch_cuda="13.2", driver_cuda=(13, 2)),
                  "0.1.0").asset.cuda == "13.2"
    assert choose(m, TARGET, "0.1.0").asset.cuda == "13.0"  # cu130 torch never takes 13.2
    only_new = choose(manifest(asset("13.2")), TARGET, "0.1.0")
    assert only_new.asset is None
    assert only_new.reason == ("no prebuilt wheel for torch 2.14.1+cu130 (CUDA 13.0): "
                               "release 0.1.0 has CUDA 13.2 only")


def test_several_gpus_are_grouped():
    gpus = (H200, Gpu(1, "NVIDIA H200", 9, 0), Gpu(2, "RTX PRO 6000", 12, 0), Gpu(3, "L4", 8, 9))
    choice = choose(manifest(), target(gpus=gpus), "0.1.0")
    assert "GPU 0,1 sm_90 via sm_90a cubin, GPU 2 sm_120 via sm_120f cubin, GPU 3 sm_89 via sm_80 cubin" in choice.reason


def test_ptx_covers_a_newer_gpu_by_jit():
    choice = choose(manifest(), target(gpus=(Gpu(0, "future", 13, 0),)), "0.1.0")
    assert choice.asset is not None
    assert "GPU 0 sm_130 via compute_120 PTX (JIT)" in choice.reason


def test_no_gpu_visible_skips_coverage_and_says_so():
    choice = choose(manifest(), target(gpus=(), driver_cuda=None), "0.1.0")
    assert choice.asset is not None
    assert "driver not seen" in choice.reason
    assert "no GPU visible, the fat binary covers sm_80, sm_90a, sm_100f, sm_120f + compute_120" in choice.reason


def test_local_label_of_the_package_version_is_ignored():
    assert choose(manifest(), TARGET, "0.1.0+cu130").asset is not None


def test_cuda_override_is_used_and_shown():
    t = target(torch_version=None, torch_cuda="13.0", cuda_overridden=True, gpus=())
    choice = choose(manifest(), t, "0.1.0")
    assert choice.asset is not None
    assert "CUDA 13.0 by CUDELTA_CUDA_VERSION (torch not visible)" in choice.reason


def test_torch_unseen_matches_by_driver():
    t = target(torch_version=None, torch_cuda=None, driver_cuda=(13, 1))
    choice = choose(manifest(asset("12.8", driver_floor="12.8"), asset("13.0")), t, "0.1.0")
    assert choice.asset.cuda == "13.0"
    assert "driver CUDA 13.1 (torch not visible)" in choice.reason
    old = choose(manifest(), target(torch_version=None, torch_cuda=None, driver_cuda=(12, 8)), "0.1.0")
    assert old.asset is None
    assert old.reason == "no prebuilt wheel for driver CUDA 12.8 (torch not visible): release 0.1.0 has CUDA 13.0 only"


def test_nothing_seen_at_all_names_the_overrides():
    choice = choose(manifest(), target(torch_version=None, torch_cuda=None, driver_cuda=None, gpus=()), "0.1.0")
    assert choice.asset is None and not choice.pure_python
    assert "CUDELTA_CUDA_VERSION" in choice.reason and "CUDELTA_TARGET_PYTHON" in choice.reason


# --- choose: refusals ------------------------------------------------------------------------


def test_cpu_torch_gets_pure_python():
    choice = choose(manifest(), target(torch_version="2.14.1+cpu", torch_cuda=None), "0.1.0")
    assert choice == Choice(None, "torch 2.14.1+cpu has no CUDA: installing the pure-Python wheel "
                                  "(ops run the PyTorch reference path)", pure_python=True)
    forced = choose(manifest(), target(torch_cuda=None, cuda_overridden=True), "0.1.0")
    assert forced.pure_python and forced.reason.startswith("CUDELTA_CUDA_VERSION=cpu")
    mac = choose(manifest(), target(os_name="darwin", machine="arm64", glibc=None, torch_cuda=None,
                                    driver_cuda=None, gpus=()), "0.1.0")
    assert mac.pure_python and mac.asset is None


def test_older_cuda_major_torch_has_no_match():
    choice = choose(manifest(), target(torch_version="2.14.1+cu128", torch_cuda="12.8"), "0.1.0")
    assert choice.asset is None and not choice.pure_python
    assert choice.reason == ("no prebuilt wheel for torch 2.14.1+cu128 (CUDA 12.8): "
                             "release 0.1.0 has CUDA 13.0 only")


def test_torch_below_floor():
    choice = choose(manifest(), target(torch_version="2.9.1+cu130"), "0.1.0")
    assert choice.asset is None
    assert choice.reason.startswith("torch 2.9.1+cu130 is older than 2.10, the floor of cudelta-0.1.0+cu130")
    assert choose(manifest(), target(torch_version="2.10.0a0+git1234"), "0.1.0").asset is not None


def test_driver_below_floor():
    choice = choose(manifest(), target(driver_cuda=(12, 8)), "0.1.0")
    assert choice.asset is None
    assert "the NVIDIA driver supports CUDA 12.8, older than the 13.0" in choice.reason
    assert "update the driver" in choice.reason


def test_uncovered_gpu_names_the_release_archs():
    choice = choose(manifest(), target(gpus=(H200, Gpu(1, "T4", 7, 5))), "0.1.0")
    assert choice.asset is None
    assert choice.reason == (
        "GPU 1 (compute 7.5) has no cubin or PTX in cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl: "
        "release archs sm_80, sm_90a, sm_100f, sm_120f + compute_120"
    )


def test_old_glibc_does_not_take_manylinux_2_28():
    choice = choose(manifest(), target(glibc=(2, 17)), "0.1.0")
    assert choice.asset is None
    assert choice.reason == "manylinux_2_28_x86_64 needs glibc >= 2.28; this system has glibc 2.17"
    assert choose(manifest(), target(glibc=(2, 28)), "0.1.0").asset is not None


def test_other_machine_has_no_wheel():
    choice = choose(manifest(), target(machine="aarch64"), "0.1.0")
    assert choice.reason == ("no prebuilt wheel for linux aarch64 glibc 2.36: "
                             "release 0.1.0 has manylinux_2_28_x86_64 only")


def test_free_threaded_python_gets_no_abi3():
    choice = choose(manifest(), target(python_version=(3, 13), free_threaded=True, abiflags="t"), "0.1.0")
    assert choice.asset is None
    assert "Python 3.13t is free-threaded and cannot load the abi3 wheel" in choice.reason


def test_python_below_floor():
    choice = choose(manifest(), target(python_version=(3, 9)), "0.1.0")
    assert choice.asset is None
    assert choice.reason.startswith("Python 3.9 is older than 3.10, the floor of cudelta-0.1.0")


def test_pypy_cannot_load_cpython_abi3():
    choice = choose(manifest(), target(implementation="pypy", python_version=(3, 11)), "0.1.0")
    assert choice.asset is None and "does not fit PyPy 3.11" in choice.reason


def test_other_version_is_not_taken():
    choice = choose(manifest(asset(version="0.1.1"), version="0.1.1"), TARGET, "0.1.0")
    assert choice.asset is None
    assert choice.reason == "release 0.1.1 lists no prebuilt wheel of cudelta 0.1.0"


def test_closest_asset_explains():
    # The 13.0 wheel fails only on the GPU; the 12.8 one already on CUDA: the GPU reason wins.
    m = manifest(asset("12.8", driver_floor="12.8"), asset("13.0", archs=("sm_80",), ptx=()))
    choice = choose(m, TARGET, "0.1.0")
    assert choice.reason.startswith("GPU 0 (compute 9.0) has no cubin or PTX in cudelta-0.1.0+cu130")
