"""Fixtures for the end-to-end installs: real pip, real venvs, a local GitHub-like release server.

Base environments (one with torch 2.14.1+cu130 and the build requirements, one with the
torch 2.13.0 CPU build) are made once and kept under CUDELTA_TEST_CACHE (default
<repo>/.ci-cache). Each test installs into a FRESH venv that sees a base's torch through a .pth
file: to pip and to the installer that is an installed torch (pip says "Requirement already
satisfied"), at the cost of seconds instead of a 5.5 GB copy per case.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.1.0"
TAG = f"v{VERSION}"
CACHE = Path(os.environ.get("CUDELTA_TEST_CACHE", ROOT / ".ci-cache"))
BUILD_REQS = ["setuptools>=77", "wheel>=0.43", "packaging>=24", "requests>=2.31", "urllib3>=2",
              "filelock>=3.12", "platformdirs>=3", "ninja"]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"

# Variables of ours or pip's that must not leak from the developer's shell into a case.
_SCRUB = ("FORCE_BUILD", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "GITHUB_TOKEN", "PIP_NO_BUILD_ISOLATION",
          "VIRTUAL_ENV", "PYTHONPATH")


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
    env = make_venv(path)
    env.pip("install", "-q", *packages, timeout=1800)
    stamp.write_text(wanted)
    return env


@pytest.fixture(scope="session")
def base_cu() -> Venv:
    return base_venv(f"cu-py{PY}", ["torch==2.14.1", *BUILD_REQS, "build"])


@pytest.fixture(scope="session")
def base_cpu() -> Venv:
    return base_venv(f"cpu-py{PY}", ["torch==2.13.0"])


@pytest.fixture
def fresh_venv(tmp_path):
    """fresh_venv(base) -> a new venv whose only extra is the base's torch, seen through a .pth."""

    def make(base: Venv | None = None) -> Venv:
        env = make_venv(tmp_path / "venv")
        if base is not None:
            # ensurepip's old setuptools would shadow the base's, which torch requires (>= 77).
            env.pip("uninstall", "-q", "-y", "setuptools", check=False)
            (env.site_packages / "_base_torch.pth").write_text(str(base.site_packages) + "\n")
        return env

    return make


@pytest.fixture(scope="session")
def source_copy(tmp_path_factory) -> Path:
    """The working tree as it would be checked out (build outputs excluded)."""
    dst = tmp_path_factory.mktemp("src") / "cudelta"
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".ci-cache", ".whl",
                                    ".device", ".pytest_cache")
    shutil.copytree(ROOT, dst, ignore=ignore)
    rev = run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"], check=False).stdout.strip()
    (dst / "installer" / "GIT_REVISION").write_text((rev or "unknown") + "\n")
    return dst


@pytest.fixture(scope="session")
def sdist(base_cu, source_copy, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    run([base_cu.python, "-m", "build", "--sdist", "--no-isolation", "--outdir", out, source_copy])
    (path,) = out.glob(f"cudelta-{VERSION}.tar.gz")
    return path


@pytest.fixture(scope="session")
def release_wheel(base_cu, source_copy, tmp_path_factory) -> Path:
    """The release asset, made by the project's own release build (what the matrix runs)."""
    out = tmp_path_factory.mktemp("release-wheel")
    run([base_cu.python, "setup.py", "-q", "bdist_wheel", "--dist-dir", out], cwd=source_copy,
        env=clean_env(CUDELTA_RELEASE_BUILD="1"), timeout=1800)
    (path,) = out.glob("*.whl")
    return path


@pytest.fixture(scope="session")
def release_dir(release_wheel, base_cu, tmp_path_factory) -> Path:
    """Release assets as published: wheel, manifest.json, SHA256SUMS, PEP 503 index."""
    out = tmp_path_factory.mktemp("release")
    run([base_cu.python, ROOT / "scripts" / "make_release.py", "--version", VERSION, "--out", out, release_wheel])
    return out


@pytest.fixture(scope="session")
def build_wheelhouse(base_cu, tmp_path_factory) -> Path:
    """The build requirements as wheels, for the no-network case."""
    out = tmp_path_factory.mktemp("wheelhouse")
    base_cu.pip("download", "-q", "-d", out, *BUILD_REQS)
    return out


@pytest.fixture
def server(release_dir):
    from release_server import ReleaseServer

    with ReleaseServer(release_dir.parent) as srv:
        srv.add_release(TAG, release_dir)
        yield srv


@dataclass
class CompilerSpy:
    bindir: Path
    log: Path

    def path_env(self, env: dict) -> dict:
        return {**env, "PATH": f"{self.bindir}:{env['PATH']}"}

    def compiles(self) -> list[str]:
        """Invocations that compiled or linked something (not `--version` probes)."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [line for line in lines if " -c " in f" {line} " or " -o " in f" {line} "]


@pytest.fixture
def compiler_spy(tmp_path) -> CompilerSpy:
    """A PATH prefix whose nvcc / c++ / gcc / g++ log their arguments, then exec the real tool."""
    bindir = tmp_path / "spy-bin"
    bindir.mkdir()
    log = tmp_path / "compiler-calls"
    for tool in ("nvcc", "c++", "gcc", "g++", "cc"):
        real = shutil.which(tool)
        if real is None:
            continue
        script = bindir / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\nexec {real} "$@"\n')
        script.chmod(0o755)
    return CompilerSpy(bindir, log)


def pip_output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


sys.path.insert(0, str(Path(__file__).resolve().parent))  # release_server.py beside this file
