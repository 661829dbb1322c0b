from dataclasses import replace

import pytest
from packaging.tags import Tag

from installer.choose.choose import (
    Choice,
    choose,
    linux_platforms,
    target_platforms,
    target_tags,
)
from installer.choose.manifest import Asset, Manifest
from installer.core import cuda
from installer.core.cuda import arch_covers, covering_arch
from installer.core.target import Gpu, TargetEnv

RELEASE_ARCHS = ("sm_80", "sm_90a", "sm_100f", "sm_120f")


def asset(cuda="13.0", platform="manylinux_2_28_x86_64", version="0.1.0", archs=RELEASE_ARCHS,
          ptx=("compute_120",), torch_floor="2.10", python_floor="3.10", driver_floor=None, tag="cp310-abi3"):
    label = "cu" + cuda.replace(".", "")
    return Asset(
        name=f"cudelta-{version}+{label}-{tag}-{platform}.whl", size=1, sha256="0" * 64, cuda=cuda,
        platform=platform, archs=tuple(archs), ptx=tuple(ptx), torch_floor=torch_floor,
        python_floor=python_floor, driver_floor=driver_floor or f"{cuda.split('.')[0]}.0",
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
    with pytest.raises(ValueError, match="^not a CUDA arch: 'sm_9'$"):
        arch_covers("sm_9", 9, 0)
    with pytest.raises(ValueError, match="^not a CUDA arch: 'gfx90a'$"):
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
        "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl matches: driver CUDA 13.0, "
        "GPU 0 sm_90 via sm_90a cubin, manylinux_2_36_x86_64"
    )
    assert "\n" not in choice.reason


# The release matrix: one build per toolkit, each running on every driver of its major.
CU129, CU130 = asset("12.9"), asset("13.0")


@pytest.mark.parametrize("torch_version, torch_cuda", [
    (None, None), ("2.14.1+cu130", "13.0"), ("2.11.0+cu128", "12.8"), ("2.13.0+cpu", None), ("2.9.1+cu126", "12.6"),
])
def test_torch_is_not_an_input(torch_version, torch_cuda):
    # pip builds the sdist before it installs torch; whatever torch there is, the driver decides.
    t = target(torch_version=torch_version, torch_cuda=torch_cuda)
    choice = choose(manifest(CU129, CU130), t, "0.1.0")
    assert choice.asset == CU130 and not choice.pure_python


def test_the_newest_toolkit_the_driver_runs_wins():
    m = manifest(CU129, CU130)
    assert choose(m, target(driver_cuda=(13, 1)), "0.1.0").asset == CU130
    assert choose(m, target(driver_cuda=(12, 8)), "0.1.0").asset == CU129
    assert choose(m, target(driver_cuda=(12, 2)), "0.1.0").asset == CU129  # minor-version compatibility


def test_a_newer_toolkit_that_misses_a_gpu_gives_way_to_one_that_covers_every_gpu():
    new = asset("13.0", archs=("sm_100f", "sm_120f"), ptx=())
    choice = choose(manifest(CU129, new), target(gpus=(H200, Gpu(1, "B200", 10, 0))), "0.1.0")
    assert choice.asset == CU129 and "GPU 0 sm_90 via sm_90a cubin, GPU 1 sm_100 via sm_100f cubin" in choice.reason


def test_no_driver_takes_the_most_compatible_build_and_says_so_in_one_line():
    t = target(torch_version=None, torch_cuda=None, driver_cuda=None, gpus=())
    choice = choose(manifest(CU130, CU129), t, "0.1.0")
    assert choice.asset == CU129
    assert choice.reason.startswith("no NVIDIA driver visible, so the most compatible build")
    assert "CUDELTA_DRIVER_CUDA" in choice.reason and "runs on drivers for CUDA >= 12.0" in choice.reason
    assert "\n" not in choice.reason
    # Only one build published: that one.
    assert choose(manifest(CU130), t, "0.1.0").asset == CU130


def test_driver_override_chooses_for_another_machine():
    t = target(driver_cuda=(13, 0), driver_override=cuda.DriverOverride((13, 0)), gpus=())
    choice = choose(manifest(CU129, CU130), t, "0.1.0")
    assert choice.asset == CU130 and "driver CUDA 13.0 by CUDELTA_DRIVER_CUDA" in choice.reason


def test_several_gpus_are_grouped():
    gpus = (H200, Gpu(1, "NVIDIA H200", 9, 0), Gpu(2, "RTX PRO 6000", 12, 0), Gpu(3, "L4", 8, 9))
    choice = choose(manifest(), target(gpus=gpus), "0.1.0")
    assert "GPU 0,1 sm_90 via sm_90a cubin, GPU 2 sm_120 via sm_120f cubin, GPU 3 sm_89 via sm_80 cubin" in choice.reason


def test_ptx_covers_a_newer_gpu_by_jit():
    choice = choose(manifest(), target(gpus=(Gpu(0, "future", 13, 0),)), "0.1.0")
    assert choice.asset is not None
    assert "GPU 0 sm_130 via compute_120 PTX (JIT)" in choice.reason


def test_ptx_needs_a_driver_that_knows_the_toolkit():
    # A 12.4 driver runs 12.9 cubins but cannot JIT 12.9 PTX.
    future = (Gpu(0, "future", 13, 0),)
    choice = choose(manifest(CU129), target(driver_cuda=(12, 4), gpus=future), "0.1.0")
    assert choice.asset is None and "its PTX needs a driver for CUDA >= 12.9" in choice.reason
    assert choose(manifest(CU129), target(driver_cuda=(12, 9), gpus=future), "0.1.0").asset == CU129


def test_no_gpu_visible_skips_coverage_and_says_so():
    choice = choose(manifest(), target(gpus=()), "0.1.0")
    assert choice.asset is not None
    assert "no GPU visible, the fat binary covers sm_80, sm_90a, sm_100f, sm_120f + compute_120" in choice.reason


def test_local_label_of_the_package_version_is_ignored():
    assert choose(manifest(), TARGET, "0.1.0+cu130").asset is not None


# --- choose: refusals ------------------------------------------------------------------------


def test_no_cuda_systems_get_pure_python():
    forced = choose(manifest(), target(driver_cuda=None, driver_override=cuda.DriverOverride(None)), "0.1.0")
    assert forced.pure_python and forced.reason.startswith("CUDELTA_DRIVER_CUDA=cpu")
    mac = choose(manifest(), target(os_name="darwin", machine="arm64", glibc=None, torch_cuda=None,
                                    driver_cuda=None, gpus=()), "0.1.0")
    assert mac.pure_python and mac.asset is None
    win = choose(manifest(), target(os_name="windows", glibc=None), "0.1.0")
    assert win.pure_python and win.reason.startswith("windows has no CUDA build of cudelta")


def test_a_cpu_arch_without_any_cuda_build_gets_pure_python():
    choice = choose(manifest(), target(machine="ppc64le"), "0.1.0")
    assert choice == Choice(None, "release 0.1.0 has no CUDA build for ppc64le: installing the pure-Python wheel "
                                  "(ops run the PyTorch reference path)", pure_python=True)


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


def test_other_machine_with_a_build_but_an_old_glibc_has_no_wheel():
    m = manifest(asset(platform="manylinux_2_28_x86_64"), asset(platform="manylinux_2_34_aarch64"))
    choice = choose(m, target(machine="aarch64", glibc=(2, 31)), "0.1.0")
    assert choice.reason == "manylinux_2_34_aarch64 needs glibc >= 2.34; this system has glibc 2.31"


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
    # The 13.0 wheel fails only on the GPU; the aarch64 one already on the platform: the GPU reason wins.
    m = manifest(asset("12.9", platform="manylinux_2_28_aarch64"), asset("13.0", archs=("sm_80",), ptx=()))
    choice = choose(m, TARGET, "0.1.0")
    assert choice.reason.startswith("GPU 0 (compute 9.0) has no cubin or PTX in cudelta-0.1.0+cu130")


# --- every asset's verdict (CUDELTA_EXPLAIN, the install record, python -m cudelta) -----------


def test_the_choice_keeps_each_asset_not_chosen_with_the_rule_it_failed():
    cu129, cu130, arm = asset("12.9"), asset("13.0"), asset("13.0", platform="manylinux_2_28_aarch64")
    choice = choose(manifest(cu129, cu130, arm), target(driver_cuda=(12, 8)), "0.1.0")
    assert choice.asset == cu129
    assert choice.rejected == [
        (cu130.name, f"the NVIDIA driver supports CUDA 12.8, older than the 13.0 that {cu130.name} needs "
                     "(update the driver)"),
        (arm.name, "built for manylinux_2_28_aarch64, not manylinux_2_36_x86_64"),
    ]
    assert choice.candidates == (cu129, cu130)  # what another x86_64 machine may get


def test_the_explain_table_gives_every_asset_a_verdict():
    cu129, cu130 = asset("12.9"), asset("13.0")
    old_gpu = target(driver_cuda=(13, 0), gpus=(Gpu(0, "Tesla V100", 7, 0),))
    assert choose(manifest(cu129, cu130), target(), "0.1.0").table() == [
        f"fits     {cu129.name}: matches too; {cu130.name} comes first (the newest toolkit this driver runs)",
        f"chosen   {cu130.name}: matches: driver CUDA 13.0, GPU 0 sm_90 via sm_90a cubin, manylinux_2_36_x86_64",
    ]
    assert choose(manifest(cu129, cu130), old_gpu, "0.1.0").table() == [
        f"rejected {a.name}: GPU 0 (compute 7.0) has no cubin or PTX in {a.name}: release archs "
        "sm_80, sm_90a, sm_100f, sm_120f + compute_120" for a in (cu129, cu130)
    ]


def test_without_a_driver_the_table_says_why_the_newer_build_waits():
    cu129, cu130 = asset("12.9"), asset("13.0")
    (row,) = [r for r in choose(manifest(cu129, cu130), target(driver_cuda=None, gpus=()), "0.1.0").table()
              if r.startswith("fits")]
    assert row == (f"fits     {cu130.name}: matches too; with no driver visible {cu129.name} comes first "
                   "(driver floor 12.0, the lowest, then the newest toolkit)")


def test_the_pure_python_choice_looks_at_no_asset():
    assert choose(manifest(), target(os_name="darwin", machine="arm64"), "0.1.0").table() == []
