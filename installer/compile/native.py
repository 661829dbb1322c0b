"""The native extension: which archs, which flags, how many jobs, and the checks before nvcc runs.

Pure functions build the flag lists; `extension()` is the one place that imports torch (only a
local compile gets there, in a process that can see the target's torch). Arch targets are
installer/core/cuda.py's; the toolchain checks are installer/detect/toolchain.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

from ..core import shipped
from ..core.cuda import ArchTarget
from ..core.errors import InstallerError

# kernels/units/ holds one file per layout and state dtype (every build of those kernels), so ninja
# compiles them in parallel; a unit added there is compiled without being listed here.
SOURCES = ("csrc/ops.cpp", "kernels/dispatch.cu", "kernels/probe.cu",
           *sorted(f"kernels/units/{unit.name}" for unit in (shipped.SOURCE_ROOT / "kernels" / "units").glob("*.cu")))

# The release archs and the torch floor are the release policy's (cudelta/_release_policy.py).
# TORCH_TARGET_VERSION encodes major << 56 | minor << 48: the policy's TORCH_FLOOR, the oldest torch
# whose stable ABI we use (tests/unit/test_release_policy.py holds the two together).
TORCH_TARGET_VERSION = "0x020a000000000000"
PY_LIMITED_API = "0x030a0000"
PY_LIMITED_API_TAG = "cp310"


def parse_archs(items: Sequence[str]) -> List[ArchTarget]:
    """'8.0', '12.0f+PTX', ... -> arch targets; InstallerError naming the bad one."""
    try:
        return [ArchTarget.parse(item) for item in items]
    except ValueError as exc:
        raise InstallerError(str(exc)) from None


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


# The CUDA runtime goes in statically, so the library needs the driver (libcuda, dlopen'ed by the
# runtime) and nothing of the toolkit: one wheel then loads under a CUDA 12 or 13 build of torch
# alike, and the install choice never depends on torch's CUDA flavour. rt, pthread and dl are what
# libcudart_static itself calls into (folded into libc from glibc 2.34, separate before).
STATIC_CUDART = ("cudart_static", "rt", "pthread", "dl")


def link_libraries(libraries: Sequence[str]) -> list[str]:
    """torch's CUDAExtension list with its shared `cudart` swapped for the static runtime."""
    out = [lib for lib in libraries if lib != "cudart"]
    return out + [lib for lib in STATIC_CUDART if lib not in out]


def extension(archs: Sequence[ArchTarget], *, compress: bool, jobs: int, header_dir: Path, release_build: bool):
    from torch.utils.cpp_extension import CUDAExtension

    ext = CUDAExtension(
        name="cudelta._C",
        sources=list(SOURCES),
        include_dirs=[str(header_dir)],
        extra_compile_args={"cxx": cxx_flags(), "nvcc": nvcc_flags(archs, compress=compress, threads=jobs)},
        py_limited_api=True,
    )
    ext.libraries = link_libraries(ext.libraries)
    if release_build:  # Settings.release_build, read once by the caller
        # Release assets link against glibc 2.28 (manylinux_2_28) whatever this host runs; the
        # why and how are in installer/compile/glibc_floor.py. A local build targets this machine only.
        from . import glibc_floor
        from ..core.log import say

        say(glibc_floor.apply(ext, Path(header_dir).parent / "glibc-floor"))
    return ext
