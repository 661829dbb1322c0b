"""The Docker-cache case: a wheel the sdist built on one machine, served by pip's cache on another.

pip keeps the wheel it built from an sdist and installs it, unbuilt, wherever the same sdist is
asked for again with the same cache: a Docker cache mount, a CI cache, a shared home. Here the
first install runs with no driver visible (an image build; this machine has none), the second
with the stand-in libcuda (tests/e2e/fake_libcuda.c) on LD_LIBRARY_PATH, from the same private
PIP_CACHE_DIR (other runs purge cudelta from the shared one). The installed package must then say,
in one line and with the cure, that its choice was made for another machine.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, TAG, VERSION, clean_env, make_venv, pip_output, run

pytestmark = pytest.mark.e2e


def reinstall_commands() -> tuple[str, str]:
    spec = importlib.util.spec_from_file_location("tree_build_record", ROOT / "cudelta" / "_build_record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reinstall_commands()


PIP, UV = reinstall_commands()
CURE = f"Clear the cached wheel and reinstall: pip cache remove cudelta && {PIP} (uv: uv cache clean cudelta && {UV})"


def venv_with_torch_of(base, path: Path):
    env = make_venv(path)
    env.pip("uninstall", "-q", "-y", "setuptools", check=False)
    (env.site_packages / "_base_torch.pth").write_text(str(base.site_packages) + "\n")
    return env


def machine(tmp_path: Path, fake_driver: Path | None = None, driver: str = "13000", **extra) -> dict:
    """An install's environment: pip's cache shared by both machines, this machine's driver or none."""
    env = clean_env(PIP_CACHE_DIR=str(tmp_path / "pip-cache"), CUDELTA_CACHE_DIR=str(tmp_path / "cudelta-cache"),
                    **extra)
    env.pop("LD_LIBRARY_PATH", None)
    if fake_driver is not None:
        env.update(LD_LIBRARY_PATH=str(fake_driver), CUDELTA_FAKE_DRIVER_VERSION=driver, CUDELTA_FAKE_GPUS="9.0")
    return env


def report(venv, env) -> tuple[str, str]:
    proc = run([venv.python, "-m", "cudelta", "--no-smoke"], env=env, cwd="/")
    return proc.stdout, proc.stderr


def stale_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "this install was chosen for another machine" in line]


def test_a_cached_prebuilt_wheel_on_a_machine_whose_driver_it_does_not_fit(base_cpu, sdist_index, server, release_dir,
                                                                           fake_driver, tmp_path):
    (asset,) = (p.name for p in release_dir.glob(f"cudelta-{VERSION}+cu130-*.whl"))
    find = ("install", "-v", "--find-links", sdist_index, "cudelta")

    image = venv_with_torch_of(base_cpu, tmp_path / "image")
    built = pip_output(image.pip(*find, env=machine(tmp_path, CUDELTA_WHEEL_URL=server.base_url(TAG))))
    assert "no NVIDIA driver visible, so the most compatible build" in built
    assert f"installing prebuilt {asset}" in built

    host = venv_with_torch_of(base_cpu, tmp_path / "host")
    host_env = machine(tmp_path, fake_driver, driver="12080", CUDELTA_WHEEL_URL=server.base_url(TAG))
    cached = pip_output(host.pip(*find, env=host_env))
    assert "cudelta: target:" not in cached, "the second install built the sdist: pip's cache was not used"
    assert len([p for p in server.paths() if p.endswith(".whl") and "/releases/download/" in p]) == 1

    stdout, stderr = report(host, host_env)
    (line,) = stale_lines(stderr)
    assert line.endswith(
        f"cudelta: this install was chosen for another machine: {asset} needs a driver for CUDA >= 13.0 and this "
        f"driver supports CUDA 12.8 (chosen on a machine with no NVIDIA driver and no GPU). {CURE}")
    assert "  chosen from  linux x86_64 glibc " in stdout and ", no NVIDIA driver, no GPU, torch 2.13.0+cpu" in stdout
    assert "  verdict      no NVIDIA driver visible, so the most compatible build" in stdout
    assert f"  this machine this install was chosen for another machine: {asset} needs a driver" in stdout

    # The machine it was chosen on finds nothing to say.
    stdout, stderr = report(image, machine(tmp_path))
    assert stale_lines(stderr) == [] and "  this machine would choose the same" in stdout


def test_a_cached_pure_wheel_from_a_gpu_less_runner_on_a_cuda_host(base_cpu, sdist_without_manifest, fake_driver,
                                                                   tmp_path):
    pypi = tmp_path / "pypi"  # one folder, so both installs ask for the same sdist URL
    pypi.mkdir()
    shutil.copy2(sdist_without_manifest, pypi / sdist_without_manifest.name)
    find = ("install", "-v", "--find-links", pypi, "cudelta")

    runner = venv_with_torch_of(base_cpu, tmp_path / "runner")
    built = pip_output(runner.pip(*find, env=machine(tmp_path, CUDELTA_DRIVER_CUDA="cpu")))
    assert "CUDELTA_DRIVER_CUDA=cpu: installing the pure-Python wheel" in built

    host = venv_with_torch_of(base_cpu, tmp_path / "host")
    host_env = machine(tmp_path, fake_driver)
    cached = pip_output(host.pip(*find, env=host_env))
    assert "cudelta: target:" not in cached, "the second install built the sdist: pip's cache was not used"

    stdout, stderr = report(host, host_env)
    (line,) = stale_lines(stderr)
    assert line.endswith(
        "cudelta: this install was chosen for another machine: the pure-Python wheel (ops run the slow PyTorch "
        "reference) was chosen on a machine with no NVIDIA driver and no GPU (CUDELTA_DRIVER_CUDA=cpu), and this "
        f"one has driver CUDA 13.0 and GPUs of compute 9.0. {CURE}")
    assert "pure-Python wheel (PyTorch reference ops)" in stdout
    assert "  verdict      CUDELTA_DRIVER_CUDA=cpu: installing the pure-Python wheel" in stdout
