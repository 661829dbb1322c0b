"""Python environments for the slow tests: real venvs, real pip, cached base environments.

Base environments (one with torch 2.14.1+cu130 and the build requirements, one with the
torch 2.13.0 CPU build) are made once and kept under CUDELTA_TEST_CACHE (default
<repo>/.ci-cache); both the release build test and the end-to-end installs use them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.1.0"
TAG = f"v{VERSION}"
CACHE = Path(os.environ.get("CUDELTA_TEST_CACHE", ROOT / ".ci-cache"))
BUILD_REQS = ["setuptools>=77", "wheel>=0.43", "packaging>=24", "requests>=2.31", "urllib3>=2",
              "filelock>=3.12", "platformdirs>=3", "truststore>=0.10", "ninja"]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"

# Variables of ours or pip's that must not leak from the developer's shell into a case.
_SCRUB = ("FORCE_BUILD", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "GITHUB_TOKEN", "PIP_NO_BUILD_ISOLATION",
          "VIRTUAL_ENV", "PYTHONPATH")


def find_uv() -> str | None:
    """uv next to the test interpreter (scripts/test.sh installs it there), else on PATH."""
    return shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDELTA_") and k not in _SCRUB}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def run(cmd, *, env=None, cwd=None, check=True, timeout=900) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], env=env or clean_env(), cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@dataclass
class Venv:
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        return self.path / "lib" / f"python{PY}" / "site-packages"

    def pip(self, *args, env=None, check=True, timeout=900) -> subprocess.CompletedProcess:
        return run([self.python, "-m", "pip", *args], env=env, check=check, timeout=timeout)

    def py(self, code: str, env=None, check=True) -> subprocess.CompletedProcess:
        return run([self.python, "-c", code], env=env, check=check, cwd="/")

    def has(self, dist: str) -> bool:
        return self.pip("show", dist, check=False).returncode == 0


def make_venv(path: Path) -> Venv:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return Venv(path)


def base_venv(name: str, packages: list[str]) -> Venv:
    """A reusable environment, rebuilt only when its package list changes."""
    path = CACHE / "venvs" / name
    stamp = path / ".packages"
    wanted = "\n".join(packages)
    if stamp.is_file() and stamp.read_text() == wanted and (path / "bin" / "python").exists():
        return Venv(path)
    # A changed list installs into the existing venv rather than recreating it: other test runs
    # may be using it, and torch need not be unpacked again.
    env = Venv(path) if (path / "bin" / "python").exists() else make_venv(path)
    env.pip("install", "-q", *packages, timeout=1800)
    stamp.write_text(wanted)
    return env



# ziglang: the glibc 2.28 stubs every release link uses (installer/compile/glibc_floor.py).
CU_PACKAGES = ["torch==2.14.1", *BUILD_REQS, "build", "ziglang==0.17.1"]
CPU_PACKAGES = ["torch==2.13.0"]


def base_cu() -> Venv:
    return base_venv(f"cu-py{PY}", CU_PACKAGES)


def base_cpu() -> Venv:
    return base_venv(f"cpu-py{PY}", CPU_PACKAGES)
