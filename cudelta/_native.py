"""Finding, checking and loading the native library, lazily and with errors a person can act on.

The build record `_build_info.json` beside the library is read BEFORE dlopen: a library built for
another CUDA major, or a torch below the stable-ABI floor, is refused with the command that fixes
it, never with `undefined symbol` from deep inside the loader.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

PACKAGE_DIR = Path(__file__).resolve().parent
VARIANTS = {"generic": 0, "sm80": 1, "sm90": 2, "sm90tma": 3}
VARIANT_ENV = "CUDELTA_KERNEL_VARIANT"
REINSTALL = "pip install --no-cache-dir --force-reinstall cudelta"


class NativeLibraryError(RuntimeError):
    """The native library exists but cannot serve this torch / GPU; the message says the fix."""


@dataclass(frozen=True)
class NativeStatus:
    path: Optional[Path]
    build_info: Optional[dict]
    loaded: bool
    reason: str  # why not loaded, or "loaded"
    variant: int = -1  # CUDELTA_KERNEL_VARIANT, read once at load (no environ lookup per call)


_lock = threading.Lock()
_status: Optional[NativeStatus] = None
_noticed: set[str] = set()


def library_path() -> Optional[Path]:
    found = sorted(PACKAGE_DIR.glob("_C*.so"))
    return found[0] if found else None


def read_build_info(path: Optional[Path] = None) -> Optional[dict]:
    path = path or PACKAGE_DIR / "_build_info.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def compatibility_problem(info: dict, torch_version: str, torch_cuda: Optional[str]) -> Optional[str]:
    """Why a library with build record `info` cannot run under this torch, or None."""
    archs = ", ".join(info.get("archs", []) + info.get("ptx", []))
    if torch_cuda is None:
        return (f"torch {torch_version} is a CPU build; cudelta's CUDA library (CUDA {info.get('cuda_toolkit')}) "
                "needs a CUDA build of torch")
    floor = info.get("torch_floor", "0")
    if _version_tuple(torch_version) < _version_tuple(floor):
        return (f"cudelta was built against the torch stable ABI of {floor}, but torch is {torch_version}; "
                f"upgrade torch (pip install 'torch>={floor}') or rebuild: FORCE_BUILD=1 {REINSTALL}")
    built = str(info.get("cuda_toolkit", ""))
    if built and built.split(".")[0] != torch_cuda.split(".")[0]:
        return (f"cudelta was built for CUDA {built} ({archs}) but torch {torch_version} uses CUDA {torch_cuda}; "
                f"the CUDA majors must match. Reinstall to get the matching build: {REINSTALL}")
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
    path = library_path()
    info = read_build_info()
    if path is None:
        return NativeStatus(None, info, False, "no native library in this install (pure-Python wheel)")
    if info is None:
        return NativeStatus(path, None, False, f"{path.name} has no _build_info.json beside it; reinstall: {REINSTALL}")
    problem = compatibility_problem(info, str(torch.__version__), torch.version.cuda)
    if problem:
        return NativeStatus(path, info, False, problem)
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        return NativeStatus(path, info, False, f"loading {path.name} failed: {exc}. Rebuild: FORCE_BUILD=1 {REINSTALL}")
    _register_fake()
    return NativeStatus(path, info, True, "loaded", requested_variant())


def _register_fake() -> None:
    # Shapes only, so the op traces under torch.compile / FakeTensor without running the kernel.
    for op in ("cudelta::gdn_decode", "cudelta::kda_decode"):
        @torch.library.register_fake(op)
        def _(q, k, v, g, beta, state, idx, scale, use_qk_l2norm, variant):
            return v.new_empty(v.shape[0], v.shape[1], v.shape[2])


def requested_variant(environ=os.environ) -> int:
    """CUDELTA_KERNEL_VARIANT: auto (default) | generic | sm80 | sm90 | sm90tma -> -1 | 0 | 1 | 2 | 3."""
    raw = environ.get(VARIANT_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return -1
    if raw not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={raw!r} is not accepted; expected one of: auto, {', '.join(VARIANTS)}")
    return VARIANTS[raw]


def notice_once(key: str, message: str) -> None:
    if key not in _noticed:
        _noticed.add(key)
        warnings.warn(f"cudelta: {message}", RuntimeWarning, stacklevel=3)
