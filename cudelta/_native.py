"""Finding, checking and loading the native library, lazily and with errors a person can act on.

The build record `_build_info.json` beside the library is read BEFORE dlopen: a CPU build of torch,
a torch below the stable-ABI floor, or a driver too old for the library's toolkit is refused with
the command that fixes it, never with `undefined symbol` from deep inside the loader.

First, the install record (cudelta/_install_record.py) is compared with this machine: a wheel
chosen elsewhere and served from pip's or uv's cache is named in one line, with the cure.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import torch

from . import _build_record, _install_record, _release_policy

PACKAGE_DIR = Path(__file__).resolve().parent
VARIANT_ENV = "CUDELTA_KERNEL_VARIANT"
PDL_ENV = "CUDELTA_PDL"
REINSTALL = _build_record.REINSTALL


class NativeLibraryError(RuntimeError):
    """The native library exists but cannot serve this torch / GPU; the message says the fix."""


@dataclass(frozen=True)
class NativeStatus:
    path: Optional[Path]
    build_info: Optional[dict]
    loaded: bool
    reason: str  # why not loaded, or "loaded"
    variant: int = -1  # CUDELTA_KERNEL_VARIANT, read once at load (no environ lookup per call)
    pdl: bool = True  # CUDELTA_PDL, read once at load: programmatic dependent launch on sm_90+ images
    # Kernel variant name -> id, from the library's own table (kernels/launch.h kVariants).
    variants: Mapping[str, int] = field(default_factory=dict)
    # The install record's verdict on this machine (the line said once), or None.
    install_check: Optional[str] = None


_lock = threading.Lock()
_status: Optional[NativeStatus] = None
_noticed: set[str] = set()


def library_path() -> Optional[Path]:
    found = sorted(PACKAGE_DIR.glob("_C*.so"))
    return found[0] if found else None


# What the loader and `python -m cudelta` read of the build record (cudelta/_build_record.py).
LOADER_NEEDS = ("cuda_toolkit", "torch_floor", "archs", "ptx")


def read_build_info(path: Optional[Path] = None) -> Optional[dict]:
    """The build record beside the library, as schema 2; None if missing or not a record."""
    try:
        return _build_record.read(path or PACKAGE_DIR / _build_record.FILENAME, LOADER_NEEDS)
    except (OSError, ValueError):  # BuildRecordError is a ValueError
        return None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def driver_cuda_version() -> Optional[tuple[int, int]]:
    """The CUDA version the NVIDIA driver supports (cuDriverGetVersion 13000 -> (13, 0)), or None.

    Read from libcuda directly: torch would initialise CUDA, and a CPU build of torch has no answer.
    """
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(value)) != 0 or value.value <= 0:
            return None
    except (OSError, AttributeError):
        return None
    return value.value // 1000, (value.value % 1000) // 10


CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


def _libcuda_capabilities() -> tuple[tuple[int, int], ...]:
    """Every visible GPU's compute capability from libcuda (cuInit once; honours CUDA_VISIBLE_DEVICES)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return ()
        out = []
        for ordinal in range(count.value):
            dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
            if (lib.cuDeviceGet(ctypes.byref(dev), ordinal)
                    or lib.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
                    or lib.cuDeviceGetAttribute(ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)):
                return ()
            out.append((major.value, minor.value))
        return tuple(out)
    except (OSError, AttributeError):
        return ()


def gpu_capabilities() -> tuple[tuple[int, int], ...]:
    """The GPUs' compute capabilities, without initialising CUDA behind torch's back.

    Where torch has initialised CUDA (a CUDA op is the usual first load), its cached device
    properties. A CUDA torch that has not is asked to (only `python -m cudelta` and direct calls
    load before a CUDA tensor exists): an initialisation torch knows of keeps its fork guard true.
    A CPU torch never uses CUDA, so libcuda's cuInit here cannot get in its way.
    """
    if torch.cuda.is_initialized() or torch.version.cuda is not None:
        if not torch.cuda.is_available():
            return ()
        return tuple(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    return _libcuda_capabilities()


def this_machine() -> _install_record.Machine:
    """The facts an install is chosen from, as this process sees them."""
    os_name = _install_record.normalise_os(sys.platform)
    try:
        glibc = _install_record.parse_glibc(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):
        glibc = None
    driver = driver_cuda_version()
    return _install_record.Machine(os=os_name, arch=_install_record.normalise_machine(os_name, platform.machine()),
                                   glibc=glibc, driver_cuda=driver, gpus=gpu_capabilities() if driver else ())


def read_install_record() -> Optional[dict]:
    """The installed distribution's install record, when this package is that distribution's
    (not a source tree imported beside an install); None without one, or an unreadable one."""
    from importlib import metadata

    try:
        dist = metadata.distribution("cudelta")
        if Path(str(dist.locate_file("cudelta/__init__.py"))).resolve() != PACKAGE_DIR / "__init__.py":
            return None
        text = dist.read_text(_install_record.FILENAME)
        return _install_record.loads(text) if text else None
    except (metadata.PackageNotFoundError, OSError, ValueError):  # InstallRecordError is a ValueError
        return None


def install_check(record: Optional[dict], machine: _install_record.Machine) -> Optional[str]:
    """The one line saying this machine would have chosen another install, with the cure; or None."""
    finding = _install_record.stale(record, machine) if record else None
    return finding.message(*_build_record.reinstall_commands()) if finding else None


def driver_floor(info: dict) -> tuple[int, int]:
    """The oldest driver that runs the library: the record's floor, else the release policy's rule
    for its toolkit (records written before the field existed)."""
    floor = info.get("driver_floor")
    if not floor:
        return _release_policy.driver_floor(str(info.get("cuda_toolkit", "0.0")))
    major, _, minor = str(floor).partition(".")
    return int(major), int(minor or 0)


def compatibility_problem(info: dict, torch_version: str, torch_cuda: Optional[str],
                          driver: Optional[tuple[int, int]]) -> Optional[str]:
    """Why a library with build record `info` cannot run here, or None.

    The library depends on the driver, not on a CUDA runtime: any CUDA build of torch above the
    stable-ABI floor can load it, whatever its CUDA version, when the driver can run its code.
    """
    if torch_cuda is None:
        return (f"torch {torch_version} is a CPU build; cudelta's CUDA kernels need a CUDA build of torch "
                "(CPU tensors run the PyTorch reference)")
    floor = info.get("torch_floor", "0")
    if _version_tuple(torch_version) < _version_tuple(floor):
        return (f"cudelta was built against the torch stable ABI of {floor}, but torch is {torch_version}; "
                f"upgrade torch (pip install 'torch>={floor}') or rebuild: {_build_record.reinstall('FORCE_BUILD=1')}")
    need = driver_floor(info)
    if driver is not None and driver < need:
        built = info.get("cuda_toolkit", "?")
        return (f"the NVIDIA driver supports CUDA {driver[0]}.{driver[1]}, but this cudelta build (CUDA {built}) "
                f"needs a driver for CUDA >= {need[0]}.{need[1]}; update the driver, or reinstall, which "
                f"picks the build your driver runs: {REINSTALL}")
    return None


def status() -> NativeStatus:
    """Load the library once (thread-safe) and say what happened."""
    global _status
    if _status is not None:  # the lock-free path is what torch.compile traces
        return _status
    with _lock:
        if _status is None:
            _status = _load()
        return _status


def _load() -> NativeStatus:
    record = read_install_record()
    checked = install_check(record, this_machine()) if record else None
    if checked:
        notice_once("install-record", checked)
    path = library_path()
    info = read_build_info()
    if path is None:
        return NativeStatus(None, info, False, "no native library in this install (pure-Python wheel)",
                            install_check=checked)
    if info is None:
        return NativeStatus(path, None, False, f"{path.name} has no readable {_build_record.FILENAME} beside it; "
                            f"reinstall: {REINSTALL}", install_check=checked)
    problem = compatibility_problem(info, str(torch.__version__), torch.version.cuda, driver_cuda_version())
    if problem:
        return NativeStatus(path, info, False, problem, install_check=checked)
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        return NativeStatus(path, info, False, f"loading {path.name} failed: {exc}. Rebuild: {_build_record.reinstall('FORCE_BUILD=1')}",
                            install_check=checked)
    _register_fake()
    table = _variant_table()
    return NativeStatus(path, info, True, "loaded", requested_variant(os.environ, table), requested_pdl(os.environ),
                        table, checked)


def _variant_table() -> dict:
    """{name: id} of the loaded library's kernel variants, in id order (cudelta::variants)."""
    rows = json.loads(torch.ops.cudelta.variants())
    return {row["name"]: int(row["id"]) for row in sorted(rows, key=lambda row: row["id"])}


def variants() -> Mapping[str, int]:
    """Kernel variant name -> id, as the loaded library defines them; empty without a library."""
    return status().variants


def _register_fake() -> None:
    # The ops write their state and `out` in place and return nothing, so under torch.compile /
    # FakeTensor there is nothing to compute (the schema: csrc/ops.cpp).
    @torch.library.register_fake("cudelta::decode")
    def _(*args):
        return None

    @torch.library.register_fake("cudelta::conv_update")
    def _(*args):
        return None


def requested_pdl(environ: Mapping[str, str]) -> bool:
    """CUDELTA_PDL: 1 (default) or 0, to time the kernels without programmatic dependent launch."""
    raw = environ.get(PDL_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV}={raw!r} is not accepted; expected 0 (off) or 1 (on, the default)")
    return raw != "0"


def requested_variant(environ: Mapping[str, str], table: Mapping[str, int]) -> int:
    """CUDELTA_KERNEL_VARIANT: auto (default) or a name of `table` (the library's variants) -> -1 or its id."""
    raw = environ.get(VARIANT_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return -1
    if raw not in table:
        raise ValueError(f"{VARIANT_ENV}={raw!r} is not accepted; expected one of: auto, {', '.join(table)}")
    return table[raw]


def notice_once(key: str, message: str, stacklevel: int = 3) -> None:
    if key not in _noticed:
        _noticed.add(key)
        warnings.warn(f"cudelta: {message}", RuntimeWarning, stacklevel=stacklevel)


def kernels_for(t: torch.Tensor) -> Optional[NativeStatus]:
    """The loaded library where a call on `t` runs the kernels; None where it runs the PyTorch
    reference (CPU tensors, or an install without a library), each said once. A library that exists
    but cannot run here raises NativeLibraryError: an error, not a slow path."""
    if not t.is_cuda:
        notice_once("cpu", "CPU tensors run the PyTorch reference (the kernels need CUDA tensors)", stacklevel=4)
        return None
    st = status()
    if not st.loaded:
        if st.path is not None:
            raise NativeLibraryError(f"cudelta: {st.reason}")
        notice_once("no-native", f"{st.reason}; CUDA tensors use the PyTorch reference (slow)", stacklevel=4)
        return None
    return st
