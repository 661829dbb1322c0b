"""Builds that do not carry an image for this GPU, installed side by side on the GPU machine.

CUDELTA_TEST_ALT_BUILDS names a folder of unpacked local builds, which scripts/gpu_tests.sh makes
in the same job (`FORCE_BUILD=1 CUDELTA_CUDA_ARCHS=... pip wheel --no-build-isolation .`):
  sm80/      cubin sm_80 only      -> on Hopper: no usable image, a clear error with the fix
  sm80ptx/   sm_80 + compute_80    -> on Hopper: the driver JITs the PTX
Each case runs in its own interpreter so its cudelta is the one imported. Without the folder the
cases fail, not skip: users meet both paths, so a GPU run that leaves them out is not green.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cudelta import _build_record  # noqa: E402  (the installed package: its hint is the library's)

ALT = os.environ.get("CUDELTA_TEST_ALT_BUILDS")
TESTS = Path(__file__).resolve().parents[1]  # tests/: step_tolerance.py, mtp_cases.py
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

# One step through the build under test, checked as the main suite checks one: each element within
# its own tolerance of the reference, the slots idx does not name (0 and 2) bit-identical.
CASE = """
import sys, torch, cudelta
sys.path.insert(0, {tests!r})
from step_tolerance import assert_each_element_close, step_magnitudes
print("imported", cudelta.__file__)
gen = torch.Generator().manual_seed(0)
q = torch.randn(2, 2, 128, generator=gen).cuda().bfloat16()
v = torch.randn(2, 2, 128, generator=gen).cuda().bfloat16()
g = -torch.rand(2, 2, generator=gen).cuda(); b = torch.rand(2, 2, generator=gen).cuda()
st = (torch.randn(4, 2, 128, 128, generator=gen) * 0.1).cuda(); idx = torch.tensor([1, 3], device="cuda")
before = st.clone(); ref = st.clone(); o_ref = cudelta.gdn_decode_reference(q, q, v, g, b, ref, idx)
o = cudelta.gdn_decode(q, q, v, g, b, st, idx)  # loads the library on first use
torch.cuda.synchronize()
print("probe", list(torch.ops.cudelta.probe(0)))
mags = step_magnitudes(q, q, v, g, b, before, idx)
assert_each_element_close(st, ref, mags.state, "state")
assert_each_element_close(o, o_ref, mags.out, "output")
assert torch.equal(st[[0, 2]], before[[0, 2]]), "a slot not named by idx changed"
print("step matches the reference")
"""


def alt_build(build: str) -> Path:
    if not ALT:
        pytest.fail("CUDELTA_TEST_ALT_BUILDS is not set: these cases need the foreign-arch builds that "
                    "scripts/gpu_tests.sh makes (FORCE_BUILD=1 CUDELTA_CUDA_ARCHS=8.0, 8.0+PTX), unpacked "
                    "under one folder as sm80/ and sm80ptx/")
    folder = Path(ALT) / build
    if not (folder / "cudelta").is_dir():
        pytest.fail(f"CUDELTA_TEST_ALT_BUILDS={ALT} has no unpacked build {build}/cudelta")
    return folder


# KDA's one-token call with an fp32 state and the epilogue in a small grid, built and checked as
# tests/gpu/test_mtp_gpu.py checks every call (tests/mtp_cases.py: vLLM's pages, each element within
# its tolerance of the float64 loop, every other pool byte as it was). A compute_80 image has no
# thread block clusters, so there the launch rule (kernels/mtp_one.cuh, launch_vk_one) takes the
# one-warp grid and the separate norm, a path no sm_90 image runs; the state checks the per-channel
# decay, which the GDN builds of the same kernels would apply per head.
KDA_EPILOGUE_CASE = """
import sys, cudelta
sys.path.insert(0, {tests!r})
import mtp_cases as mc
print("imported", cudelta.__file__)
case = mc.Case(kind="kda", H=2, group=1, tokens="single", state="fp32", epilogue="sigmoid", N=2, seed=531)
mc.run_and_check(case, "cuda")
print("kda epilogue matches the reference")
"""


def run_case(build: str, env_extra=None, case: str = CASE):
    folder = alt_build(build)
    env = {**os.environ, "PYTHONPATH": str(folder), **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-c", case.format(tests=str(TESTS))], env=env, capture_output=True,
                          text=True, cwd="/")
    # the build under test, not the release installed beside it
    assert f"imported {folder / 'cudelta'}" in proc.stdout, proc.stdout + proc.stderr
    return proc


def test_a_gpu_without_an_image_gets_the_built_archs_and_the_fix_command():
    if torch.cuda.get_device_capability(0)[0] == 8:
        pytest.skip("sm_80 cubins run on this GPU")
    proc = run_case("sm80")
    assert proc.returncode != 0
    err = proc.stderr
    major, minor = torch.cuda.get_device_capability(0)
    assert "no kernel image for CUDA device 0" in err and "Built for sm_80" in err
    assert _build_record.reinstall(f"FORCE_BUILD=1 TORCH_CUDA_ARCH_LIST={major}.{minor}") in err
    assert "undefined symbol" not in err


def test_ptx_is_jit_compiled():
    proc = run_case("sm80ptx")
    assert proc.returncode == 0, proc.stderr
    probe = eval(proc.stdout.split("probe", 1)[1].splitlines()[0])
    assert probe[1] == 800  # the compute_80 PTX, JIT-compiled for this GPU
    assert "step matches the reference" in proc.stdout


def test_ptx_runs_the_one_token_epilogue_without_clusters():
    proc = run_case("sm80ptx", case=KDA_EPILOGUE_CASE)
    assert proc.returncode == 0, proc.stderr
    assert "kda epilogue matches the reference" in proc.stdout
