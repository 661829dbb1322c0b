"""What the installer knows about the environment it installs into, and the probe that reads it.

`TargetEnv` is plain data: `detect.py` fills it, `choose.py` and the build read it. `PROBE` is the
script run by the *target* interpreter (`python -I -c PROBE`): the target may be any CPython with
nothing but the standard library, so it must stay stdlib-only and compatible with old Pythons,
and it must never import torch (seconds, and it may initialise CUDA). It only reports where
things are; the files it points at are parsed by `detect.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from . import cuda


@dataclass(frozen=True)
class Gpu:
    index: int  # CUDA ordinal, i.e. after CUDA_VISIBLE_DEVICES
    name: str
    major: int
    minor: int

    @property
    def cc(self) -> Tuple[int, int]:
        return (self.major, self.minor)

    @property
    def sm(self) -> str:
        """'sm_90': the plain cubin name of this GPU's compute capability."""
        return str(cuda.CodeArch("sm", self.major, self.minor, ""))


@dataclass(frozen=True)
class TargetEnv:
    python_version: Tuple[int, int]
    implementation: str  # sys.implementation.name: 'cpython', 'pypy', ...
    os_name: str  # 'linux', 'darwin', 'windows'
    machine: str  # 'x86_64', 'aarch64', ...
    executable: str = ""
    abiflags: str = ""
    free_threaded: bool = False
    glibc: Optional[Tuple[int, int]] = None  # None: not glibc (musl, macOS, Windows) or unknown
    # torch is reported, never required: pip builds an sdist before it installs its dependencies.
    torch_version: Optional[str] = None  # '2.14.1+cu130'; None: torch not visible
    torch_cuda: Optional[str] = None  # '13.0'; None: CPU/ROCm torch, or not visible
    torch_cxx11_abi: Optional[bool] = None
    driver_cuda: Optional[Tuple[int, int]] = None  # cuDriverGetVersion 13000 -> (13, 0)
    # CUDELTA_DRIVER_CUDA when set: driver_cuda is then its version (None for `cpu`).
    driver_override: Optional[cuda.DriverOverride] = None
    overridden_driver_seen: Optional[Tuple[int, int]] = None  # what the driver said, under an override
    gpus: Tuple[Gpu, ...] = ()
    nvcc_version: Optional[str] = None  # '13.0'
    host_compiler: Optional[str] = None  # first line of `c++ --version`
    source: str = ""
    notes: Tuple[str, ...] = ()

    @property
    def driver_seen(self) -> Optional[Tuple[int, int]]:
        """The driver this build saw, whatever CUDELTA_DRIVER_CUDA says (the install record keeps it)."""
        return self.overridden_driver_seen if self.driver_override else self.driver_cuda

    @property
    def python_tag(self) -> str:
        return f"{self.python_version[0]}.{self.python_version[1]}" + ("t" if self.free_threaded else "")

    def summary(self) -> str:
        impl = {"cpython": "CPython", "pypy": "PyPy"}.get(self.implementation, self.implementation)
        parts = [f"{impl} {self.python_tag} {self.os_name} {self.machine}"
                 + (f" glibc {self.glibc[0]}.{self.glibc[1]}" if self.glibc else "")]
        if self.torch_version:
            torch_cuda = f"CUDA {self.torch_cuda}" if self.torch_cuda else "no CUDA"
            abi = {True: ", cxx11 ABI", False: ", pre-cxx11 ABI", None: ""}[self.torch_cxx11_abi]
            parts.append(f"torch {self.torch_version} ({torch_cuda}{abi})")
        else:
            parts.append("torch not seen (reported only, not needed to choose)")
        if self.driver_override:
            parts.append("CUDELTA_DRIVER_CUDA=cpu" if self.driver_override.cpu
                         else f"driver CUDA {self.driver_override} by CUDELTA_DRIVER_CUDA")
        else:
            parts.append(f"driver CUDA {cuda.format_version(self.driver_cuda)}" if self.driver_cuda
                         else "no NVIDIA driver")
        if self.gpus:
            parts.append(", ".join(f"GPU {g.index} {g.name} ({g.major}.{g.minor})" for g in self.gpus))
        else:
            parts.append("no GPU")
        parts.append(f"nvcc {self.nvcc_version}" if self.nvcc_version else "no nvcc")
        if self.host_compiler:
            parts.append(self.host_compiler)
        return "; ".join(parts)


# Runs under the target interpreter with -I (no PYTHONPATH, no user site, no script dir): under
# pip's build isolation that is what hides the build env's sys.path overlay and shows the real
# site-packages. find_spec on a top-level name locates the package without running its
# __init__. importlib.metadata costs ~75 ms, so it is asked only when version.py is missing.
PROBE = r'''
import json, os, sys

def _glibc():
    try:
        return os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None

def _machine():
    try:
        return os.uname().machine
    except AttributeError:
        import platform
        return platform.machine()

def _gil_disabled():
    import sysconfig
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))

def _read(path, limit=1 << 20):
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None

def _torch():
    import importlib.util
    try:
        spec = importlib.util.find_spec("torch")
    except Exception as e:
        return {"error": "%s: %s" % (type(e).__name__, e)}
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        return {"error": "torch is not a package (%s)" % spec.origin}
    root = locations[0]
    out = {"dir": root, "version_py": _read(os.path.join(root, "version.py")), "dist_version": None}
    if out["version_py"] is None:
        try:
            from importlib.metadata import version
            out["dist_version"] = version("torch")
        except Exception:
            pass
    return out

def facts(find_torch=True):
    return {
        "probe": 1,
        "python_version": list(sys.version_info[:2]),
        "implementation": sys.implementation.name,
        "abiflags": getattr(sys, "abiflags", ""),
        "gil_disabled": _gil_disabled(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "platform": sys.platform,
        "machine": _machine(),
        "glibc": _glibc(),
        "torch": _torch() if find_torch else None,
        "torch_imported": "torch" in sys.modules,
    }

if __name__ == "__main__":
    sys.stdout.write(json.dumps(facts()))
'''
