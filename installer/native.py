"""The native extension: which archs, which flags, how many jobs, and the checks before nvcc runs.

Pure functions build the flag lists; `extension()` is the one place that imports torch (only a
local compile gets there, in a process that can see the target's torch).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .errors import InstallerError

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("csrc/ops.cpp", "kernels/gdn_decode.cu", "kernels/probe.cu")

# What a release wheel carries: sm_80 covers 8.x, the arch-specific sm_90a Hopper, the family
# cubins sm_100f / sm_120f Blackwell datacenter / consumer, and compute_120 PTX for what comes next.
RELEASE_ARCHS = ("8.0", "9.0a", "10.0f", "12.0f+PTX")
TORCH_FLOOR = "2.10"
# TORCH_TARGET_VERSION encodes major << 56 | minor << 48: the oldest torch whose stable ABI we use.
TORCH_TARGET_VERSION = "0x020a000000000000"
PY_LIMITED_API = "0x030a0000"
PY_LIMITED_API_TAG = "cp310"

# Newest GCC major each CUDA toolkit's nvcc accepts (CUDA installation guides).
MAX_GCC_FOR_CUDA = {(12, 4): 13, (12, 5): 13, (12, 6): 13, (12, 8): 14, (12, 9): 14, (13, 0): 15, (13, 1): 15}


@dataclass(frozen=True)
class ArchTarget:
    """One `-gencode` target: e.g. 9.0a -> cubin sm_90a; 12.0f+PTX -> cubin sm_120f + compute_120 PTX."""

    major: int
    minor: int
    suffix: str  # "", "a" (arch-specific) or "f" (family)
    ptx: bool

    @classmethod
    def parse(cls, text: str) -> "ArchTarget":
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", text.strip(), re.IGNORECASE)
        if not m:
            raise InstallerError(f"{text!r} is not a CUDA arch; expected e.g. 8.0, 9.0a, 10.0f, 12.0f+PTX")
        return cls(int(m.group(1)), int(m.group(2)), m.group(3).lower(), bool(m.group(4)))

    @property
    def cubin(self) -> str:
        return f"sm_{self.major}{self.minor}{self.suffix}"

    @property
    def ptx_name(self) -> Optional[str]:
        return f"compute_{self.major}{self.minor}" if self.ptx else None

    def gencode(self) -> list[str]:
        code = f"{self.major}{self.minor}"
        flags = ["-gencode", f"arch=compute_{code}{self.suffix},code=sm_{code}{self.suffix}"]
        if self.ptx:
            # PTX of the plain arch: the family/arch-specific PTX would only JIT on that family.
            flags += ["-gencode", f"arch=compute_{code},code=compute_{code}"]
        return flags


def parse_archs(items: Sequence[str]) -> list[ArchTarget]:
    return [ArchTarget.parse(item) for item in items]


def archs_for_gpus(capabilities: Sequence[tuple[int, int]]) -> list[str]:
    """The local-build default: one cubin per distinct GPU, arch-specific where it exists (9.0a)."""
    archs = []
    for major, minor in sorted(set(capabilities)):
        suffix = "a" if (major, minor) == (9, 0) else ""
        archs.append(f"{major}.{minor}{suffix}")
    return archs


def nvcc_flags(archs: Sequence[ArchTarget], *, compress: bool, threads: int) -> list[str]:
    flags = ["-O3", "-std=c++17", f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}", "-DUSE_CUDA",
             "--expt-relaxed-constexpr", "-lineinfo", f"--threads={threads}"]
    for arch in archs:
        flags += arch.gencode()
    if compress:
        flags.append("--compress-mode=size")
    return flags


def cxx_flags() -> list[str]:
    # -g0 undoes the -g of Python's own CFLAGS: 0.7 MB of host debug info nobody ships.
    return ["-O3", "-g0", "-std=c++17", f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}", "-DUSE_CUDA",
            "-fvisibility=hidden"]


def default_jobs(cpu_count: int, mem_available_bytes: Optional[int]) -> int:
    # An nvcc job over these kernels peaks near 1.5 GiB; more jobs than that swap or get killed.
    jobs = max(1, cpu_count)
    if mem_available_bytes:
        jobs = min(jobs, max(1, int(mem_available_bytes // (3 << 29))))
    return jobs


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> Optional[int]:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_toolchain(torch_cuda: Optional[str], nvcc_version: Optional[str], gcc_major: Optional[int]) -> None:
    """Catch what would otherwise fail deep inside nvcc, with the fix in the message."""
    if nvcc_version is None:
        raise InstallerError(
            "cannot compile cudelta: nvcc was not found (looked in $CUDA_HOME/bin, $CUDA_PATH/bin and PATH). "
            f"Install the CUDA toolkit {torch_cuda or ''} matching torch and set CUDA_HOME, or install a "
            "prebuilt wheel (unset FORCE_BUILD)."
        )
    if torch_cuda is None:
        return
    t_major = int(torch_cuda.split(".")[0])
    n_major, n_minor = (int(x) for x in nvcc_version.split(".")[:2])
    if t_major != n_major:
        raise InstallerError(
            f"cannot compile cudelta: nvcc is CUDA {nvcc_version} but torch was built for CUDA {torch_cuda}; "
            f"the CUDA majors must match. Point CUDA_HOME at a CUDA {t_major}.x toolkit, or install a torch "
            f"built for CUDA {n_major}.x (e.g. pip install torch --index-url https://download.pytorch.org/whl/cu{n_major}{n_minor})."
        )
    if gcc_major is not None:
        limit = MAX_GCC_FOR_CUDA.get((n_major, n_minor))
        if limit is not None and gcc_major > limit:
            raise InstallerError(
                f"cannot compile cudelta: the host compiler is GCC {gcc_major}, but nvcc {nvcc_version} supports "
                f"GCC <= {limit}. Install g++-{limit} and set CXX=g++-{limit} CUDAHOSTCXX=g++-{limit}."
            )


def gcc_major_of(host_compiler: Optional[str]) -> Optional[int]:
    if not host_compiler:
        return None
    if "clang" in host_compiler.lower():
        return None
    # GCC banners ("c++ (Debian 12.2.0-14) 12.2.0", "g++ (GCC) 13.3.1 ...") end with the version.
    versions = re.findall(r"(\d+)\.\d+\.\d+", host_compiler)
    return int(versions[-1]) if versions else None


def git_revision(root: Path = ROOT) -> str:
    stamp = root / "installer" / "GIT_REVISION"
    if not (root / ".git").exists():  # an sdist: never ask git, it might answer for an enclosing repo
        return stamp.read_text().strip() if stamp.is_file() else "unknown"
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        rev = out.stdout.strip()
        if out.returncode == 0 and rev:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def build_record(*, version: str, toolkit: str, archs: Sequence[ArchTarget], torch_version: str,
                 kind: str, compressed: bool) -> dict:
    return {
        "version": version,
        "variant": "cu" + toolkit.replace(".", ""),
        "cuda_toolkit": toolkit,
        "archs": [a.cubin for a in archs],
        "ptx": [a.ptx_name for a in archs if a.ptx_name],
        "torch_built_with": torch_version,
        "torch_floor": TORCH_FLOOR,
        "python_floor": "3.10",
        # Static runtime: any driver of the toolkit's major runs the cubins (minor-version
        # compatibility); the loader and the release manifest read this floor.
        "driver_floor": f"{toolkit.split('.')[0]}.0",
        "git_revision": git_revision(),
        "build": kind,
        "fatbin_compression": compressed,
    }


def write_build_info(record: dict, header_dir: Path) -> None:
    header_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, sort_keys=True)
    archs = ", ".join(record["archs"] + record["ptx"])
    header = (
        "// Generated by installer/native.py at build time.\n#pragma once\n"
        f'static const char* const kBuildInfoJson = R"cudelta({text})cudelta";\n'
        f'static const char* const kBuildArchs = "{archs}";\n'
    )
    path = header_dir / "build_info.h"
    if not path.is_file() or path.read_text() != header:  # keep ninja's incremental build quiet
        path.write_text(header)


def cuda_home(environ=None) -> Optional[str]:
    """The toolkit root torch's build should use. torch guesses dirname(dirname(which nvcc)),
    which is wrong for a wrapper script like /usr/local/bin/nvcc; prefer a root that has the
    runtime library beside nvcc."""
    environ = os.environ if environ is None else environ
    candidates = [environ.get("CUDA_HOME"), environ.get("CUDA_PATH")]
    import shutil

    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for root in filter(None, candidates):
        base = Path(root)
        if (base / "bin" / "nvcc").exists() and any(
                (base / lib / "libcudart.so").exists() for lib in ("lib64", "lib", "targets/x86_64-linux/lib")):
            return str(base)
    return None


# The CUDA runtime goes in statically, so the library needs the driver (libcuda, dlopen'ed by the
# runtime) and nothing of the toolkit: one wheel then loads under a CUDA 12 or 13 build of torch
# alike, and the install choice never depends on torch's CUDA flavour. rt, pthread and dl are what
# libcudart_static itself calls into (folded into libc from glibc 2.34, separate before).
STATIC_CUDART = ("cudart_static", "rt", "pthread", "dl")


def link_libraries(libraries: Sequence[str]) -> list[str]:
    """torch's CUDAExtension list with its shared `cudart` swapped for the static runtime."""
    out = [lib for lib in libraries if lib != "cudart"]
    return out + [lib for lib in STATIC_CUDART if lib not in out]


def extension(archs: Sequence[ArchTarget], *, compress: bool, jobs: int, header_dir: Path):
    from torch.utils.cpp_extension import CUDAExtension

    ext = CUDAExtension(
        name="cudelta._C",
        sources=list(SOURCES),
        include_dirs=[str(header_dir)],
        extra_compile_args={"cxx": cxx_flags(), "nvcc": nvcc_flags(archs, compress=compress, threads=jobs)},
        py_limited_api=True,
    )
    ext.libraries = link_libraries(ext.libraries)
    from .settings import Settings

    if Settings.from_env().release_build:
        # Release assets link against glibc 2.28 (manylinux_2_28) whatever this host runs; the
        # why and how are in installer/glibc_floor.py. A local build targets this machine only.
        from . import glibc_floor
        from .log import say

        say(glibc_floor.apply(ext, Path(header_dir).parent / "glibc-floor"))
    return ext
