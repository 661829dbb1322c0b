"""The last line of an install that cannot succeed names every way out that applies, and only those."""

from dataclasses import replace

import pytest

from installer.compile.local_build import compile_blockers
from installer.core.settings import Settings
from installer.core.target import Gpu, TargetEnv
from installer.dead_end import NoPrebuilt, final_line

LAPTOP = TargetEnv((3, 11), "cpython", "linux", "x86_64", glibc=(2, 35), torch_version="2.13.0+cpu",
                   nvcc_version=None)
GPU_HOST = replace(LAPTOP, torch_version="2.14.1+cu130", torch_cuda="13.0", nvcc_version="13.0",
                   driver_cuda=(13, 0), gpus=(Gpu(0, "NVIDIA H100", 9, 0),))
CAUSE = ("download failed: could not download https://github.com/cudelta/cudelta/releases/download/v0.1.0/"
         "cudelta-0.1.0%2Bcu130-cp310-abi3-manylinux_2_28_x86_64.whl: connection refused (5 attempts)")
UNREACHABLE = NoPrebuilt(CAUSE, "network")


def line(settings=Settings(), target=LAPTOP, missed=UNREACHABLE, compile_failure=None) -> str:
    return final_line(settings, target, missed, compile_blockers(target), compile_failure)


def test_what_a_compile_lacks_is_read_from_detection():
    assert compile_blockers(GPU_HOST) == []
    assert compile_blockers(LAPTOP) == ["torch 2.13.0+cpu has no CUDA", "nvcc (the CUDA toolkit) was not found"]
    no_torch = replace(GPU_HOST, torch_version=None, torch_cuda=None)
    assert compile_blockers(no_torch) == ["torch is not installed where this build can see it"]
    # A torch this process imports (user site, --no-build-isolation) is the one the compile uses.
    assert compile_blockers(no_torch, torch_here=True) == []


def test_offline_with_a_cpu_torch_names_the_pure_wheel_a_mirror_a_compile_and_the_network_cause():
    text = line()
    assert text.startswith("cannot install cudelta: the prebuilt wheel could not be downloaded, and this machine "
                           "cannot compile (torch 2.13.0+cpu has no CUDA; nvcc (the CUDA toolkit) was not found)")
    ways = text.split("Ways out: ", 1)[1]
    assert ways.index("CUDELTA_DRIVER_CUDA=cpu") < ways.index("CUDELTA_WHEEL_URL=") < ways.index("FORCE_BUILD=1 with")
    assert "FORCE_BUILD=1 with a CUDA build of torch (not 2.13.0+cpu) and nvcc (the CUDA toolkit" in ways
    assert ways.endswith(f"or fix what stopped the download ({CAUSE}).")
    assert "\n" not in text


def test_a_missing_torch_is_named_as_one_to_install_first():
    text = line(target=replace(LAPTOP, torch_version=None, nvcc_version="13.0"))
    assert "this machine cannot compile (torch is not installed where this build can see it)" in text
    assert "FORCE_BUILD=1 with a CUDA build of torch installed first and nvcc 13.0 compiles here" in text


def test_no_build_with_no_match_offers_to_allow_the_compile_where_it_could_run():
    missed = NoPrebuilt("no asset matches: the NVIDIA driver supports CUDA 12.8, older than 13.0", "no-match")
    text = line(Settings(no_build=True), GPU_HOST, missed)
    assert "no prebuilt wheel (no asset matches: the NVIDIA driver supports CUDA 12.8" in text
    assert "CUDELTA_NO_BUILD=1 forbids compiling." in text
    assert "unset CUDELTA_NO_BUILD to compile here" in text
    # Nothing was downloaded wrongly: a mirror of the same release would not match either.
    assert "CUDELTA_WHEEL_URL" not in text and "fix what stopped the download" not in text


def test_no_build_where_no_compile_could_run_says_what_it_lacks_and_offers_the_pure_wheel():
    text = line(Settings(no_build=True))
    assert "CUDELTA_NO_BUILD=1 forbids compiling (torch 2.13.0+cpu has no CUDA;" in text
    assert "unset CUDELTA_NO_BUILD" not in text
    assert "CUDELTA_DRIVER_CUDA=cpu" in text and "CUDELTA_WHEEL_URL=" in text


def test_offline_with_no_folder_to_read_asks_for_a_file_url_or_the_network():
    missed = NoPrebuilt("release manifest unavailable: CUDELTA_OFFLINE=1: not downloading https://github.com/x", "network")
    text = line(Settings(offline=True), missed=missed)
    assert text.startswith("cannot install cudelta: CUDELTA_OFFLINE=1 forbids downloading the prebuilt wheel")
    assert "CUDELTA_WHEEL_URL=file://<a folder holding this release's manifest.json and wheels>" in text
    assert text.endswith("or unset CUDELTA_OFFLINE to download.")


def test_offline_with_a_folder_that_failed_says_why():
    missed = NoPrebuilt("release manifest unavailable: could not read /srv/m/manifest.json: No such file", "network")
    text = line(Settings(offline=True, wheel_url="file:///srv/m"), missed=missed)
    assert text.endswith("or fix what stopped the download (release manifest unavailable: could not read "
                         "/srv/m/manifest.json: No such file).")


def test_force_build_where_no_compile_could_run_offers_the_prebuilt_wheel():
    text = line(Settings(force_build=True), missed=NoPrebuilt("FORCE_BUILD=1", "not-tried"))
    assert text.startswith("cannot install cudelta: FORCE_BUILD=1 skips the prebuilt wheel, and this machine cannot "
                           "compile (torch 2.13.0+cpu has no CUDA;")
    assert "unset FORCE_BUILD to install the verified prebuilt wheel (where GitHub is out of reach, from a mirror: " \
           "CUDELTA_WHEEL_URL=" in text
    assert "install a CUDA build of torch (not 2.13.0+cpu) and nvcc" in text


@pytest.mark.parametrize("missed, expected", [
    (UNREACHABLE, f"or fix what stopped the download ({CAUSE})."),
    (NoPrebuilt("FORCE_BUILD=1", "not-tried"), "unset FORCE_BUILD to install the verified prebuilt wheel"),
])
def test_a_compile_that_failed_leads_with_its_own_error_then_the_other_ways_out(missed, expected):
    failure = "the local compile failed (exit 1); its output is above"
    text = line(target=GPU_HOST, missed=missed, compile_failure=failure)
    assert text.startswith(failure + ". Other ways out: CUDELTA_DRIVER_CUDA=cpu installs the pure-Python wheel")
    assert expected in text
    assert "compiles here" not in text  # it just tried


def test_a_cause_with_line_breaks_still_ends_in_one_line():
    text = line(missed=NoPrebuilt("download failed: HTTP 502\n<html>\n  bad gateway</html>", "network"))
    assert "\n" not in text and "HTTP 502 <html> bad gateway</html>" in text
