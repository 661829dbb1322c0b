"""The build's first decision and the local-build knobs, as pure functions."""

import pytest

from installer.choose.plan import compile_archs, plan_for
from installer.compile import native
from installer.core import cuda, shipped
from installer.core.errors import InstallerError
from installer.core.settings import Settings
from installer.core.target import Gpu, TargetEnv
from installer.detect import toolchain

POLICY = shipped.load("_release_policy")

CUDA_TORCH = TargetEnv((3, 12), "cpython", "linux", "x86_64", glibc=(2, 35), torch_version="2.14.1+cu130",
                       torch_cuda="13.0", gpus=(Gpu(0, "NVIDIA H200", 9, 0),))


def target(**changes):
    from dataclasses import replace

    return replace(CUDA_TORCH, **changes)


def test_cuda_torch_on_linux_looks_for_a_prebuilt_wheel():
    assert plan_for(Settings(), CUDA_TORCH).kind == "fetch"


def test_cpu_torch_still_looks_for_a_prebuilt_wheel():
    # torch is reported, never an input: a CPU torch today may be a CUDA torch after pip resolves.
    assert plan_for(Settings(), target(torch_version="2.13.0+cpu", torch_cuda=None)).kind == "fetch"


@pytest.mark.parametrize("os_name", ["darwin", "windows"])
def test_non_linux_gets_the_pure_python_wheel(os_name):
    assert plan_for(Settings(), target(os_name=os_name)).kind == "pure"


def test_driver_override_cpu_gets_the_pure_python_wheel():
    plan = plan_for(Settings(), target(driver_cuda=None, driver_override=cuda.DriverOverride(None)))
    assert plan.kind == "pure" and "CUDELTA_DRIVER_CUDA=cpu" in plan.reason


def test_force_build_and_release_build_compile():
    assert plan_for(Settings(force_build=True), CUDA_TORCH).kind == "compile"
    assert "RELEASE" in plan_for(Settings.from_env({"CUDELTA_RELEASE_BUILD": "1"}), CUDA_TORCH).reason


def test_invisible_torch_still_tries_a_prebuilt_wheel():
    # uv's build venv: the driver and GPUs decide; the plan must not silently go pure-Python.
    assert plan_for(Settings(), target(torch_version=None, torch_cuda=None)).kind == "fetch"


def test_local_build_archs_default_to_the_gpus_present():
    gpus = (Gpu(0, "A100", 8, 0), Gpu(1, "H100", 9, 0), Gpu(2, "H100", 9, 0), Gpu(3, "RTX 4090", 8, 9))
    archs, why = compile_archs(Settings(), target(gpus=gpus))
    assert list(map(str, archs)) == ["8.0", "8.9", "9.0a"] and "GPUs present" in why


def test_local_build_without_gpu_builds_all_release_archs_and_says_so():
    archs, why = compile_archs(Settings(), target(gpus=()))
    assert list(map(str, archs)) == list(POLICY.RELEASE_ARCHS) and "no GPU visible" in why


def test_arch_override_wins():
    archs = Settings.from_env({"TORCH_CUDA_ARCH_LIST": "7.5"}).cuda_archs
    assert list(map(str, compile_archs(Settings(cuda_archs=archs), CUDA_TORCH)[0])) == ["7.5"]


def test_gencode_flags_for_the_release_archs():
    flags = native.nvcc_flags(native.parse_archs(POLICY.RELEASE_ARCHS), compress=True, threads=2)
    gencodes = [flags[i + 1] for i, f in enumerate(flags) if f == "-gencode"]
    assert gencodes == ["arch=compute_80,code=sm_80", "arch=compute_90a,code=sm_90a",
                        "arch=compute_100f,code=sm_100f", "arch=compute_120f,code=sm_120f",
                        "arch=compute_120,code=compute_120"]
    assert "--compress-mode=size" in flags and "-DTORCH_TARGET_VERSION=0x020a000000000000" in flags


def test_jobs_are_bounded_by_memory():
    assert native.default_jobs(16, 4 << 30) == 2  # 1.5 GiB per nvcc job
    assert native.default_jobs(2, 64 << 30) == 2
    assert native.default_jobs(8, None) == 8
    assert native.default_jobs(8, 100 << 20) == 1


def test_nvcc_torch_cuda_major_mismatch_names_the_fix():
    with pytest.raises(InstallerError, match=r"nvcc is CUDA 12.8 but torch was built for CUDA 13.0.*CUDA_HOME"):
        toolchain.check_toolchain("13.0", "12.8", 12)


def test_missing_nvcc_and_too_new_gcc_are_caught_before_compiling():
    with pytest.raises(InstallerError, match="nvcc was not found"):
        toolchain.check_toolchain("13.0", None, 12)
    with pytest.raises(InstallerError, match="GCC 16.*CXX=g\\+\\+-15"):
        toolchain.check_toolchain("13.0", "13.0", 16)
    toolchain.check_toolchain("13.0", "13.0", 12)  # the supported combination passes


def test_gcc_major_from_version_banner():
    assert toolchain.gcc_major_of("c++ (Debian 12.2.0-14+deb12u1) 12.2.0") == 12
    assert toolchain.gcc_major_of("g++ (GCC) 13.3.1 20240611 (Red Hat 13.3.1-2)") == 13
    assert toolchain.gcc_major_of("clang version 18.1.8") is None
