"""The local compile: what the command hands setuptools to build, the child that compiles where
pip's isolation hides torch, and the release wheel's label and platform tag.

Only this module (through native.extension) imports torch, and only in a process that can see the
target's torch (`torch_importable_here`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List

from ..choose.plan import compile_archs
from ..core import shipped
from ..core.errors import InstallerError
from ..core.log import say
from ..core.settings import Settings
from ..core.target import TargetEnv
from ..core.wheel_version import retag_version, with_local_label
from ..detect import toolchain
from . import build_record, native, platform_tag

@dataclass(frozen=True)
class Compile:
    """What the command hands setuptools: the extension, the build_ext that writes the record."""

    extension: Any
    build_ext: type
    record: Dict[str, Any]
    announcement: str


def torch_importable_here() -> bool:
    # Under pip's build isolation the target's site-packages are hidden from this process.
    return importlib.util.find_spec("torch") is not None


def compile_blockers(target: TargetEnv, torch_here: bool = False) -> List[str]:
    """What a local compile lacks on this target, as detection saw it; empty: it may start.

    The compile runs in the target's interpreter and needs its torch to be a CUDA build, and
    nvcc: without them it fails after seconds of setup, so the install stops before it starts.
    `torch_here`: this process imports a torch detection did not see (a user-site torch under
    --no-build-isolation: detection's `python -I` skips the user site), which the compile uses.
    """
    lacks = []
    if target.torch_version is None:
        if not torch_here:
            lacks.append("torch is not installed where this build can see it")
    elif target.torch_cuda is None:
        lacks.append(f"torch {target.torch_version} has no CUDA")
    if target.nvcc_version is None:
        lacks.append("nvcc (the CUDA toolkit) was not found")
    return lacks


def prepare(settings: Settings, target: TargetEnv, version: str, work_dir: Path) -> Compile:
    """Check the toolchain and describe the compile; raises InstallerError with the fix."""
    found, _why = toolchain.find_cuda(target.os_name, os.environ)
    if found and found.root and "CUDA_HOME" not in os.environ:
        os.environ["CUDA_HOME"] = found.root  # read when torch.utils.cpp_extension is imported
    import torch.utils.cpp_extension as cpp

    archs, why = compile_archs(settings, target)
    torch_cuda = cpp.torch.version.cuda
    if torch_cuda is None:
        raise InstallerError(f"torch {cpp.torch.__version__} has no CUDA; cannot compile the CUDA extension")
    # Detection found nvcc by the same rule (toolchain.find_cuda), so its version is this build's.
    nvcc_version = target.nvcc_version
    toolchain.check_toolchain(torch_cuda, nvcc_version, toolchain.gcc_major_of(target.host_compiler))
    jobs = settings.max_jobs or native.default_jobs(os.cpu_count() or 1, native.mem_available_bytes())
    os.environ["MAX_JOBS"] = str(jobs)  # read by torch's BuildExtension for ninja -j
    toolkit = nvcc_version or torch_cuda
    record = build_record.build_record(
        version=version, toolkit=toolkit, archs=archs, torch_version=cpp.torch.__version__,
        torch_floor=shipped.load("_release_policy").TORCH_FLOOR, kind="release" if settings.release_build else "local", compressed=True,
        revision=build_record.git_revision())
    header_dir = work_dir / "cudelta-generated"
    build_record.write_header(record, header_dir)
    names = ", ".join(record["archs"] + record["ptx"])
    return Compile(
        extension=native.extension(archs, compress=True, jobs=jobs, header_dir=header_dir,
                                   release_build=settings.release_build),
        build_ext=build_ext_class(cpp.BuildExtension, record),
        record=record,
        announcement=(f"compiling for {names} ({why}) with {jobs} job(s), nvcc {toolkit}, "
                      f"torch {cpp.torch.__version__}; about 10 s per arch on 2 cores"),
    )


def build_ext_class(base: type, record: Dict[str, Any]) -> type:
    class build_ext(base):  # type: ignore[misc, valid-type]
        def run(self) -> None:
            super().run()
            # The loader reads this before dlopen, to refuse a mismatched torch with a clear message.
            build_record.write_file(record, Path(self.build_lib) / "cudelta")

    return build_ext


def label_release_wheel(dist: Path, version: str, libraries: Iterable[Path], cuda_label: str) -> List[Path]:
    """Add the +cuXYZ label, and the manylinux tag the library's glibc needs allow."""
    libraries = list(libraries)
    # The library's own ELF header names the CPU: the release matrix builds each arch natively.
    machine = platform_tag.elf_machine(libraries[0]) if libraries else "x86_64"
    floor = platform_tag.release_platform(machine)
    glibc = platform_tag.required_glibc(libraries)
    platform = platform_tag.manylinux_tag(glibc, machine) if glibc else None
    if platform != floor:
        say(f"the library needs glibc {glibc[0]}.{glibc[1]}: tagged {platform}, not {floor}; "
            "build in a manylinux_2_28 image for the wider tag" if glibc else
            "objdump not found: cannot check the glibc the library needs; keeping " + floor)
        platform = platform or floor
    out = []
    for wheel in dist.glob(f"cudelta-{version}-*.whl"):
        labelled = retag_version(wheel, with_local_label(version, cuda_label), dist, platform=platform)
        wheel.unlink()
        say(f"release wheel: {labelled.name}")
        out.append(labelled)
    return out


def compile_in_target_interpreter(dist_dir: Path, reason: str) -> None:
    """pip's isolation hides torch from us; compile in a child of the same interpreter that sees
    the target's site-packages plus our build requirements."""
    env = unisolated_env()
    with tempfile.TemporaryDirectory(prefix="cudelta-build-") as tmp:
        cmd = [sys.executable, "setup.py", "bdist_wheel", "--compile-here", f"--compile-reason={reason}",
               "--dist-dir", tmp]
        probe = subprocess.run([sys.executable, "-c", "import torch.utils.cpp_extension"], env=env,
                               capture_output=True, text=True)
        if probe.returncode != 0:
            raise InstallerError(
                "cannot compile cudelta: torch is not importable by this build"
                f" ({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'not found'}), "
                "and a local compile needs it. Install torch first (pip install torch), then cudelta "
                "again; or set CUDELTA_TARGET_PYTHON to the interpreter that has torch."
            )
        result = subprocess.run(cmd, env=env, cwd=os.getcwd())
        if result.returncode != 0:
            raise InstallerError(f"the local compile failed (exit {result.returncode}); its output is above")
        for wheel in Path(tmp).glob("*.whl"):
            dist_dir.mkdir(parents=True, exist_ok=True)
            shutil.move(str(wheel), str(dist_dir / wheel.name))


def unisolated_env() -> Dict[str, str]:
    """The environment for a child that must see both the target's site-packages and the
    build requirements pip installed for us (setuptools, wheel, ...)."""
    env = dict(os.environ)
    default = subprocess.run([sys.executable, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"],
                             capture_output=True, text=True, check=True)
    target_paths = set(json.loads(default.stdout))
    extra = [p for p in sys.path
             if p and p not in target_paths and os.path.isdir(p)
             and not os.path.isfile(os.path.join(p, "sitecustomize.py"))]
    env["PYTHONPATH"] = os.pathsep.join(extra)
    return env
