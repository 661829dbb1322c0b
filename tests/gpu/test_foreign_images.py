"""Builds that do not carry an image for this GPU, installed side by side on the GPU machine.

CUDELTA_TEST_ALT_BUILDS names a folder of unpacked local builds (made on the build machine with
`FORCE_BUILD=1 TORCH_CUDA_ARCH_LIST=... python setup.py bdist_wheel`):
  sm80/      cubin sm_80 only      -> on Hopper: no usable image, a clear error with the fix
  sm80ptx/   sm_80 + compute_80    -> on Hopper: the driver JITs the PTX; sm90 variants refused
Each case runs in its own interpreter so its cudelta is the one imported.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cudelta import _build_record  # noqa: E402  (the installed package: its hint is the library's)

ALT = os.environ.get("CUDELTA_TEST_ALT_BUILDS")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(not ALT, reason="CUDELTA_TEST_ALT_BUILDS not set"),
]

CASE = """
import torch, cudelta
q = torch.randn(2, 2, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(2, 2, 128, device="cuda", dtype=torch.bfloat16)
g = -torch.rand(2, 2, device="cuda"); b = torch.rand(2, 2, device="cuda")
st = torch.randn(4, 2, 128, 128, device="cuda"); idx = torch.tensor([1, 3], device="cuda")
ref = st.clone(); o_ref = cudelta.gdn_decode_reference(q, q, v, g, b, ref, idx)
o = cudelta.gdn_decode(q, q, v, g, b, st, idx)  # loads the library on first use
torch.cuda.synchronize()
print("probe", list(torch.ops.cudelta.probe(0)))
print("state_err", float((st - ref).abs().max()))
"""


def run_case(build: str, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(Path(ALT) / build), **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", CASE], env=env, capture_output=True, text=True, cwd="/")


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


def test_ptx_is_jit_compiled_and_the_sm90_variants_are_refused_for_that_image():
    proc = run_case("sm80ptx")
    assert proc.returncode == 0, proc.stderr
    probe = eval(proc.stdout.split("probe", 1)[1].splitlines()[0])
    assert probe[1] == 800  # the compute_80 PTX, JIT-compiled for this GPU
    assert float(proc.stdout.split("state_err")[1]) < 1e-3
    forced = run_case("sm80ptx", {"CUDELTA_KERNEL_VARIANT": "sm90"})
    if torch.cuda.get_device_capability(0)[0] >= 9:
        assert forced.returncode != 0
        assert "kernel variant sm90 needs an sm_90+ image" in forced.stderr
        assert "runs the sm_80 image; variants it can run: generic, sm80" in forced.stderr
