"""The NVIDIA driver's CUDA version and the GPUs it sees: libcuda through ctypes, else nvidia-smi.

libcuda honours CUDA_VISIBLE_DEVICES; nothing here raises for an unusual machine.
"""

from __future__ import annotations

import ctypes
import shutil
from dataclasses import dataclass
from typing import Optional, Tuple

from ..core import cuda
from ..core.target import Gpu
from .toolchain import run_tool

NVIDIA_SMI_TIMEOUT_S = 5.0

CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CUDA_ERROR_NO_DEVICE = 100


@dataclass(frozen=True)
class DriverFacts:
    driver_cuda: Optional[Tuple[int, int]] = None
    gpus: Tuple[Gpu, ...] = ()
    notes: Tuple[str, ...] = ()
    # libcuda loaded but could not enumerate: worth asking nvidia-smi. Not set when there is
    # no driver, or when the driver answered "no device" (CUDA_VISIBLE_DEVICES may hide them).
    failed: bool = False


def parse_driver_version(value: int) -> Optional[Tuple[int, int]]:
    """cuDriverGetVersion: 1000 * major + 10 * minor, e.g. 13000 -> (13, 0), 12080 -> (12, 8)."""
    return cuda.driver_version(value)


def parse_nvidia_smi(text: str) -> Tuple[Gpu, ...]:
    """`nvidia-smi --query-gpu=index,name,compute_cap --format=csv,noheader` -> GPUs.

    Names may contain commas, so index is the first field and compute_cap the last.
    """
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3:
            continue
        try:
            major, minor = cuda.parse_capability(fields[-1])
        except ValueError:
            continue
        if not fields[0].isdigit():
            continue
        gpus.append(Gpu(int(fields[0]), ", ".join(fields[1:-1]), major, minor))
    return tuple(gpus)


def _cuda_error_name(lib, code: int) -> str:
    name = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return f"{code} {name.value.decode()}"
    except (AttributeError, OSError):
        pass
    return str(code)


def probe_driver(os_name: str) -> DriverFacts:
    """Driver CUDA version and GPUs from libcuda itself (honours CUDA_VISIBLE_DEVICES)."""
    libname = {"linux": "libcuda.so.1", "windows": "nvcuda.dll"}.get(os_name)
    if libname is None:
        return DriverFacts(notes=(f"no NVIDIA driver on {os_name}",))
    try:
        lib = ctypes.CDLL(libname)
    except OSError:
        return DriverFacts(notes=(f"no NVIDIA driver found ({libname})",))
    try:
        version = ctypes.c_int(0)
        rc = lib.cuDriverGetVersion(ctypes.byref(version))
        driver = parse_driver_version(version.value) if rc == 0 else None
        rc = lib.cuInit(0)
        if rc == CUDA_ERROR_NO_DEVICE:
            return DriverFacts(driver, (), ("the NVIDIA driver reports no visible GPU "
                                            "(CUDA_VISIBLE_DEVICES may hide them)",))
        if rc != 0:
            return DriverFacts(driver, (), (f"cuInit failed: CUDA error {_cuda_error_name(lib, rc)}",), failed=True)
        count = ctypes.c_int(0)
        rc = lib.cuDeviceGetCount(ctypes.byref(count))
        if rc != 0:
            return DriverFacts(driver, (), (f"cuDeviceGetCount failed: CUDA error {_cuda_error_name(lib, rc)}",), failed=True)
        gpus = []
        for ordinal in range(count.value):
            dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
            name = ctypes.create_string_buffer(256)
            rc = (lib.cuDeviceGet(ctypes.byref(dev), ordinal)
                  or lib.cuDeviceGetName(name, len(name), dev)
                  or lib.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
                  or lib.cuDeviceGetAttribute(ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
            if rc != 0:
                return DriverFacts(driver, (), (f"querying GPU {ordinal} failed: CUDA error {_cuda_error_name(lib, rc)}",), failed=True)
            gpus.append(Gpu(ordinal, name.value.decode("utf-8", "replace"), major.value, minor.value))
        return DriverFacts(driver, tuple(gpus))
    except (AttributeError, OSError) as e:  # a libcuda without these symbols is not a driver we know
        return DriverFacts(None, (), (f"{libname} is unusable ({e})",), failed=True)


def probe_nvidia_smi(path_env: Optional[str]) -> Tuple[Tuple[Gpu, ...], Optional[str]]:
    exe = shutil.which("nvidia-smi", path=path_env)
    if exe is None:
        return (), "nvidia-smi not found either"
    out, err = run_tool([exe, "--query-gpu=index,name,compute_cap", "--format=csv,noheader"],
                         NVIDIA_SMI_TIMEOUT_S)
    if out is None:
        return (), err
    gpus = parse_nvidia_smi(out)
    return gpus, ("GPUs listed by nvidia-smi (it ignores CUDA_VISIBLE_DEVICES)" if gpus
                  else "nvidia-smi lists no GPU")
