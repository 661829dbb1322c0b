"""The local compile's toolchain: which CUDA toolkit (one rule, for detection and the compile alike),
the host compiler, and the checks that catch a mismatch before nvcc runs.

Parsing is pure; `find_cuda`, `probe_nvcc` and `probe_host_compiler` do the I/O and turn any
failure into None plus why.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Tuple

from ..core import cuda, shipped
from ..core.errors import InstallerError

TOOL_TIMEOUT_S = 10.0
DEFAULT_CUDA_ROOT = "/usr/local/cuda"
_RUNTIME_DIRS = ("lib64", "lib", "targets/x86_64-linux/lib")

# The newest GCC of each toolkit is the release policy's (cudelta/_release_policy.py).
_policy = shipped.load("_release_policy")


@dataclass(frozen=True)
class CudaToolkit:
    nvcc: str  # the nvcc the compile runs
    root: Optional[str]  # what CUDA_HOME must say for torch's build to use that nvcc; None: torch's guess


def run_process(argv: Sequence[str], timeout: float = TOOL_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a tool without input, its output captured as text: the one way installer/ and the release
    tooling run a tool. Raises OSError (not runnable) and subprocess.TimeoutExpired."""
    return subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def run_tool(argv: Sequence[str], timeout: float = TOOL_TIMEOUT_S) -> Tuple[Optional[str], Optional[str]]:
    """(stdout + stderr, None), or (None, why the tool could not answer)."""
    try:
        proc = run_process(argv, timeout)
    except subprocess.TimeoutExpired:
        return None, f"`{' '.join(argv)}` did not answer within {timeout:g} s"
    except OSError as e:
        return None, f"`{argv[0]}` could not be run ({e.strerror or e})"
    if proc.returncode != 0:
        return None, f"`{' '.join(argv)}` exited with {proc.returncode}"
    return proc.stdout + proc.stderr, None


def _is_toolkit_root(root: Path) -> bool:
    # The runtime library beside nvcc tells a toolkit root from a folder holding a wrapper script.
    return (root / "bin" / "nvcc").exists() and any((root / d / "libcudart.so").exists() for d in _RUNTIME_DIRS)


def find_cuda(os_name: str, environ: Mapping[str, str],
              default_root: str = DEFAULT_CUDA_ROOT) -> Tuple[Optional[CudaToolkit], Optional[str]]:
    """The toolkit a local compile uses, and so the one detection reports: the one rule.

    CUDA_HOME, then CUDA_PATH, win outright (torch's build reads them too, so a different nvcc
    would mislead). Otherwise the toolkit of the nvcc on PATH; where that nvcc is a wrapper
    (/usr/local/bin/nvcc) with no runtime beside it, /usr/local/cuda. torch itself would guess
    dirname(dirname(which nvcc)), which is wrong for a wrapper.
    """
    exe = "nvcc.exe" if os_name == "windows" else "nvcc"
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = environ.get(var)
        if home:
            candidate = Path(home) / "bin" / exe
            if candidate.is_file():
                return CudaToolkit(str(candidate), home), None
            return None, f"{var}={home} has no bin/{exe}"
    found = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
    roots = [Path(found).resolve().parent.parent] if found else []
    if os_name == "linux":
        roots.append(Path(default_root))
    for root in roots:
        if _is_toolkit_root(root):
            return CudaToolkit(str(root / "bin" / exe), str(root)), None
    if found:
        return CudaToolkit(found, None), None
    return None, "nvcc not found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)"


def parse_nvcc_version(text: str) -> Optional[str]:
    """`nvcc --version` -> '13.0' from 'Cuda compilation tools, release 13.0, V13.0.88'."""
    release = cuda.nvcc_release(text)
    return cuda.format_version(release) if release else None


def probe_nvcc(os_name: str, environ: Mapping[str, str],
               default_root: str = DEFAULT_CUDA_ROOT) -> Tuple[Optional[str], Optional[str]]:
    toolkit, why = find_cuda(os_name, environ, default_root)
    if toolkit is None:
        return None, why
    out, err = run_tool([toolkit.nvcc, "--version"])
    if out is None:
        return None, err
    version = parse_nvcc_version(out)
    return (version, None) if version else (None, f"{toolkit.nvcc} --version names no release")


def parse_compiler_version(text: str) -> Optional[str]:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line or None


def probe_host_compiler(environ: Mapping[str, str]) -> Tuple[Optional[str], Optional[str]]:
    cxx = environ.get("CXX", "").strip()
    try:
        argv = shlex.split(cxx) if cxx else ["c++"]  # CXX may be 'ccache g++'
    except ValueError:
        return None, f"CXX={cxx!r} cannot be split into a command"
    if not argv:
        return None, "CXX is empty"
    found = shutil.which(argv[0], path=environ.get("PATH", os.defpath))
    if found is None:
        return None, f"host compiler {argv[0]} not found" + (" (from CXX)" if cxx else "")
    out, err = run_tool([found, *argv[1:], "--version"])
    if out is None:
        return None, err
    return parse_compiler_version(out), None


def gcc_major_of(host_compiler: Optional[str]) -> Optional[int]:
    if not host_compiler:
        return None
    if "clang" in host_compiler.lower():
        return None
    # GCC banners ("c++ (Debian 12.2.0-14) 12.2.0", "g++ (GCC) 13.3.1 ...") end with the version.
    versions = re.findall(r"(\d+)\.\d+\.\d+", host_compiler)
    return int(versions[-1]) if versions else None


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
    t_major = cuda.parse_version(torch_cuda, patch_ok=True)[0]
    nvcc = cuda.parse_version(nvcc_version, patch_ok=True)
    if t_major != nvcc[0]:
        raise InstallerError(
            f"cannot compile cudelta: nvcc is CUDA {nvcc_version} but torch was built for CUDA {torch_cuda}; "
            f"the CUDA majors must match. Point CUDA_HOME at a CUDA {t_major}.x toolkit, or install a torch "
            f"built for CUDA {nvcc[0]}.x (e.g. pip install torch --index-url "
            f"https://download.pytorch.org/whl/{cuda.label(nvcc)})."
        )
    if gcc_major is not None:
        limit = _policy.MAX_GCC_FOR_CUDA.get(nvcc)  # a toolkit newer than the policy: no known limit
        if limit is not None and gcc_major > limit:
            raise InstallerError(
                f"cannot compile cudelta: the host compiler is GCC {gcc_major}, but nvcc {nvcc_version} supports "
                f"GCC <= {limit}. Install g++-{limit} and set CXX=g++-{limit} CUDAHOSTCXX=g++-{limit}."
            )
