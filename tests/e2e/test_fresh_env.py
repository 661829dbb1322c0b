"""`pip install cudelta` the way most people meet it: a fresh environment where torch is not
installed yet, because pip (and uv) build every sdist before installing any dependency.

Each case starts from an empty venv, finds cudelta by name in a folder that holds only the sdist
(PyPI holds only the sdist) and everything else on the package index, with the release served by
the local GitHub-like server, and no override. torch arrives as cudelta's dependency; it is pinned
to the CPU build lying on this machine's disk so a case costs seconds, not a 5 GB download — the
choice never looks at torch anyway. The driver is either absent (an image build; this machine has
none) or a stand-in libcuda (tests/e2e/fake_libcuda.c) reporting CUDA 13.0 and one sm_90 GPU.

In every case the verified prebuilt asset is installed, nothing is compiled, and the wheel is
downloaded exactly once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import TAG, VERSION, clean_env, find_uv, pip_output, run

pytestmark = pytest.mark.e2e

TORCH_PIN = "torch==2.13.0+cpu"  # /opt/wheels (PIP_FIND_LINKS) on this machine; torch>=2.10 admits it


def asset_name(release_dir: Path) -> str:
    (wheel,) = release_dir.glob(f"cudelta-{VERSION}+cu130-*.whl")
    return wheel.name


def environment(server, tmp_path, fake_driver=None) -> dict:
    env = clean_env(CUDELTA_WHEEL_URL=server.base_url(TAG), CUDELTA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("LD_LIBRARY_PATH", None)
    if fake_driver is not None:
        env.update(LD_LIBRARY_PATH=str(fake_driver), CUDELTA_FAKE_DRIVER_VERSION="13000", CUDELTA_FAKE_GPUS="9.0")
    return env


def constraints(tmp_path: Path) -> Path:
    path = tmp_path / "constraints.txt"
    path.write_text(TORCH_PIN + "\n")
    return path


def check_installed(venv, out: str, server, release_dir, compiler_spy) -> None:
    asset = asset_name(release_dir)
    assert "cudelta: target:" in out, "the sdist was not built: pip installed a wheel from its cache"
    assert "torch is not visible to this build" in out  # torch really was not there yet
    assert f"installing prebuilt {asset} (sha256 verified against the manifest embedded in the sdist)" in out
    assert compiler_spy.compiles() == []
    downloads = [p for p in server.paths() if p.endswith(".whl") and "/releases/download/" in p]
    assert downloads == [f"/cudelta/cudelta/releases/download/{TAG}/{asset}"]
    code = ("import json, importlib.metadata as m\n"
            "d = m.distribution('cudelta')\n"
            "print(json.dumps({'source': json.loads(d.read_text('cudelta_source.json')), 'torch': m.version('torch')}))\n")
    record = json.loads(venv.py(code).stdout)
    assert record["source"]["asset"] == asset
    assert record["torch"] == "2.13.0+cpu"  # came in as cudelta's dependency, after the build


def timed(label: str, fn):
    started = time.perf_counter()
    result = fn()
    print(f"{label}: {time.perf_counter() - started:.1f} s")
    return result


@pytest.mark.parametrize("driver", ["driver", "no-driver"])
def test_pip_install_cudelta_brings_torch_as_a_dependency(driver, fresh_venv, sdist_index, server, release_dir,
                                                          fake_driver, compiler_spy, tmp_path):
    venv = fresh_venv()
    env = compiler_spy.path_env(environment(server, tmp_path, fake_driver if driver == "driver" else None))
    proc = timed(f"pip install cudelta ({driver})", lambda: venv.pip(
        "install", "-v", "--find-links", sdist_index, "-c", constraints(tmp_path), "cudelta", env=env))
    out = pip_output(proc)
    check_installed(venv, out, server, release_dir, compiler_spy)
    if driver == "driver":
        assert "matches: driver CUDA 13.0, GPU 0 sm_90 via sm_90a cubin" in out
    else:
        assert "no NVIDIA driver visible, so the most compatible build" in out


def test_a_requirements_file_with_torch_and_cudelta(fresh_venv, sdist_index, server, release_dir, fake_driver,
                                                     compiler_spy, tmp_path):
    venv = fresh_venv()
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("torch\ncudelta\n")
    env = compiler_spy.path_env(environment(server, tmp_path, fake_driver))
    proc = timed("pip install -r requirements.txt", lambda: venv.pip(
        "install", "-v", "--find-links", sdist_index, "-c", constraints(tmp_path), "-r", requirements, env=env))
    check_installed(venv, pip_output(proc), server, release_dir, compiler_spy)


def uv_find_links() -> list[str]:
    # pip reads PIP_FIND_LINKS (where this machine keeps its torch files); uv must be told.
    return [arg for path in os.environ.get("PIP_FIND_LINKS", "").split() for arg in ("--find-links", path)]


def uv() -> str:
    found = find_uv()
    if found is None:
        pytest.fail("uv is not installed next to the test interpreter (scripts/test.sh installs it)")
    return found


@pytest.mark.parametrize("driver", ["driver", "no-driver"])
def test_uv_pip_install_cudelta_with_build_isolation(driver, fresh_venv, sdist_index, server, release_dir,
                                                     fake_driver, compiler_spy, tmp_path):
    # uv builds in a venv of its own where nothing of the target is visible; no override needed.
    venv = fresh_venv()
    env = compiler_spy.path_env(environment(server, tmp_path, fake_driver if driver == "driver" else None))
    proc = timed(f"uv pip install cudelta ({driver})", lambda: run(
        [uv(), "pip", "install", "--python", venv.python, "-v", "--find-links", sdist_index,
         *uv_find_links(), "-c", constraints(tmp_path), "cudelta"], env=env, check=False))
    out = pip_output(proc)
    assert proc.returncode == 0, out
    check_installed(venv, out, server, release_dir, compiler_spy)
