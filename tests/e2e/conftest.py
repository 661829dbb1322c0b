"""Fixtures for the end-to-end installs: real pip, real venvs, a local GitHub-like release server.

Base environments come from tests/envs.py (made once, cached). Each test installs into a FRESH venv that sees a base's torch through a .pth
file: to pip and to the installer that is an installed torch (pip says "Requirement already
satisfied"), at the cost of seconds instead of a 5.5 GB copy per case.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/envs.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # release_server.py

import envs  # noqa: E402
from envs import (  # noqa: E402,F401  (re-exported for the tests)
    BUILD_REQS, ROOT, TAG, VERSION, Venv, clean_env, find_uv, make_venv, run,
)


@pytest.fixture(scope="session", autouse=True)
def no_cached_cudelta_wheels(tmp_path_factory):
    """pip keeps the wheel it built from an sdist under the sdist's URL and serves it, unbuilt, to a
    later install that finds the same URL through --find-links. Temporary paths repeat across runs
    on one machine (pytest numbers its base folders anew once they are removed), so a wheel left by
    an earlier run would stand in for the very build under test. No run starts with one.

    pip: each session gets a cache of its own whose HTTP part is the user's (torch and the build
    requirements still download once per machine) and whose built-wheel part starts empty. Purging
    the shared cache instead deleted, under a second test run on the same machine, the wheel its
    pip had just built and was about to install. uv: its cudelta entries are cleaned."""
    shared = Path(run([sys.executable, "-m", "pip", "cache", "dir"]).stdout.strip())
    private = tmp_path_factory.mktemp("pip-cache")
    for part in ("http-v2", "http"):
        (shared / part).mkdir(parents=True, exist_ok=True)
        (private / part).symlink_to(shared / part, target_is_directory=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("PIP_CACHE_DIR", str(private))
    uv = find_uv()
    if uv:
        run([uv, "cache", "clean", "cudelta"], check=False)
    yield private
    patch.undo()


@pytest.fixture(scope="session")
def base_cu() -> Venv:
    return envs.base_cu()


@pytest.fixture(scope="session")
def base_cpu() -> Venv:
    return envs.base_cpu()


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
def sdist_without_manifest(base_cu, source_copy, tmp_path_factory) -> Path:
    """An sdist built from a plain checkout: it must trust the downloaded manifest and say so."""
    out = tmp_path_factory.mktemp("sdist-plain")
    run([base_cu.python, "-m", "build", "--sdist", "--no-isolation", "--outdir", out, source_copy])
    (path,) = out.glob(f"cudelta-{VERSION}.tar.gz")
    return path


@pytest.fixture
def sdist_index(sdist, tmp_path) -> Path:
    """A folder holding only the sdist, as PyPI holds only the sdist: `pip install cudelta
    --find-links <it>` finds cudelta by name there and everything else on the index. A folder per
    test: pip caches the wheel it built from an sdist under the sdist's URL, and a cache hit
    would skip the very build under test."""
    out = tmp_path / "pypi"
    out.mkdir()
    shutil.copy2(sdist, out / sdist.name)
    return out


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory) -> Path:
    """A folder with a libcuda.so.1 that answers detection like a driver (tests/e2e/fake_libcuda.c);
    put it on LD_LIBRARY_PATH to make the build see a driver and GPUs on this GPU-less machine."""
    out = tmp_path_factory.mktemp("fake-driver")
    run(["gcc", "-shared", "-fPIC", "-O1", "-o", out / "libcuda.so.1", Path(__file__).parent / "fake_libcuda.c"])
    return out


@pytest.fixture(scope="session")
def dry_run(base_cu, tmp_path_factory):
    """(release folder, printed summary, check results) of `release/dry_run.py`: the release as the
    matrix and its fan-in make it (the release build, every wheel check, manifest.json, SHA256SUMS,
    the PEP 503 index, then the sdist carrying the manifest). One run per session serves every
    end-to-end test."""
    out = tmp_path_factory.mktemp("dry-run") / "release"
    # A developer iterating on the install side may reuse a release wheel built earlier (the
    # compile is the slow part); CI never sets it, so every CI run compiles the release.
    reuse = os.environ.get("CUDELTA_TEST_REUSE_RELEASE_WHEEL")
    proc = run([sys.executable, "-m", "release.dry_run", "--out", out, "--python", base_cu.python,
                *(["--reuse-wheel", reuse] if reuse else [])],
               env=clean_env(), cwd=ROOT, timeout=2400, check=False)
    assert proc.returncode == 0, f"release.dry_run exited {proc.returncode}\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    checks = json.loads((out.parent / "release-checks.json").read_text())
    return out, proc.stdout, checks


@pytest.fixture(scope="session")
def release_dir(dry_run) -> Path:
    """Release assets as published: wheel, manifest.json, SHA256SUMS, PEP 503 index, sdist."""
    return dry_run[0]


@pytest.fixture(scope="session")
def release_wheel(release_dir) -> Path:
    (path,) = release_dir.glob(f"cudelta-{VERSION}+cu*-*.whl")
    return path


@pytest.fixture(scope="session")
def sdist(release_dir) -> Path:
    """The sdist as the release fan-in builds it: after the wheels, carrying their manifest."""
    (path,) = release_dir.glob(f"cudelta-{VERSION}.tar.gz")
    return path


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




@dataclass
class InstalledLibrary:
    """What an install put into a venv, as the package itself reports it, plus the library's cubins."""

    record: dict | None  # the build record, read by cudelta._native.read_build_info
    library: Path | None  # cudelta._native.library_path()
    in_pip_record: bool  # pip's RECORD of the installed cudelta lists the library
    loaded: bool  # cudelta._native.status(): the package's loader, torch.ops.load_library included
    reason: str
    variants: list[str]
    cubins: list[str]  # arch of each cubin cuobjdump --list-elf lists, e.g. ["sm_90a", "sm_90a"]
    ptx: list[str]

    def local_build_problems(self, env: Venv, archs: list[str]) -> list[str]:
        """Why this is not a library compiled here for exactly `archs` (no PTX), installed by pip
        into `env` and loaded by cudelta's loader; [] when it is."""
        problems = []
        record = self.record or {}
        if (record.get("build"), record.get("archs"), record.get("ptx")) != ("local", archs, []):
            problems.append(f"build record {record}: not a local build of {archs}")
        lib = self.library
        if lib is None or lib.name != "_C.abi3.so" or lib.read_bytes()[:4] != b"\x7fELF":
            problems.append(f"library {lib}: not an ELF _C.abi3.so")
        elif not lib.is_relative_to(env.site_packages) or not self.in_pip_record:
            problems.append(f"library {lib}: not installed by pip into {env.site_packages}")
        if sorted(set(self.cubins)) != sorted(archs) or self.ptx:
            problems.append(f"cuobjdump lists cubins {self.cubins} and PTX {self.ptx}, not {archs} only")
        if not self.loaded or "warp" not in self.variants:
            problems.append(f"not loaded by cudelta's loader: {self.reason} (variants {self.variants})")
        return problems


_INSTALLED_LIBRARY_PROBE = """
import json, importlib.metadata as m
from cudelta import _native
lib = _native.library_path()
files = [str(f) for f in (m.distribution('cudelta').files or ())]
s = _native.status()
print(json.dumps({'record': _native.read_build_info(), 'library': str(lib) if lib else None,
                  'in_pip_record': lib is not None and f'cudelta/{lib.name}' in files,
                  'loaded': s.loaded, 'reason': s.reason, 'variants': list(s.variants)}))
"""


def _cuobjdump_archs(library: Path, kind: str) -> list[str]:
    from release.wheel_parsers import find_cuobjdump, parse_cuobjdump_list

    tool = find_cuobjdump()  # nvidia-cuda-cuobjdump in the runner venv (scripts/test.sh)
    assert tool, "cuobjdump not found: pip install nvidia-cuda-cuobjdump into the test venv"
    proc = run([tool, f"--list-{kind}", library], check=False)
    assert proc.returncode == 0, f"cuobjdump --list-{kind} {library}: {proc.stdout}{proc.stderr}"
    return [arch for _, arch in parse_cuobjdump_list(proc.stdout, kind)]


@pytest.fixture
def installed_library():
    """installed_library(env) -> InstalledLibrary: the build record and loader status as the
    installed package reports them (in the venv's own interpreter, outside the source tree), and
    the cubins and PTX in the library's fat binary. What proves a local compile happened and
    installed: nvcc is reached through CUDA_HOME, out of sight of compiler_spy's PATH."""

    def inspect(env: Venv) -> InstalledLibrary:
        facts = json.loads(env.py(_INSTALLED_LIBRARY_PROBE).stdout.strip().splitlines()[-1])
        library = Path(facts.pop("library")) if facts["library"] else None
        cubins = _cuobjdump_archs(library, "elf") if library else []
        ptx = _cuobjdump_archs(library, "ptx") if library else []
        return InstalledLibrary(library=library, cubins=cubins, ptx=ptx, **facts)

    return inspect
