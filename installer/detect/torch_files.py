"""torch's facts read from its files, never by importing it (seconds, and it may initialise CUDA).

torch is reported only: pip builds an sdist before it installs its dependencies, so the choice of
a prebuilt wheel never needs it; a local compile checks its CUDA against nvcc.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from ..core import cuda
from .interpreter import InterpreterFacts

# libc10 is small (MBs) and carries std::string in hundreds of exported signatures; the
# multi-GB libtorch_cpu is never read.
_LIBC10_READ_LIMIT = 64 << 20
_CXX11_MARKER = b"NSt7__cxx1112basic_string"


@dataclass(frozen=True)
class TorchFacts:
    version: Optional[str] = None
    cuda: Optional[str] = None
    cxx11_abi: Optional[bool] = None
    notes: Tuple[str, ...] = ()


def parse_torch_version_py(text: str) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """torch/version.py -> (__version__, cuda, hip), read with ast: the file is never executed."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return (None, None, None)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if isinstance(value, ast.Constant) and (value.value is None or isinstance(value.value, str)):
            for t in targets:
                if isinstance(t, ast.Name):
                    found[t.id] = value.value
    return (found.get("__version__"), found.get("cuda"), found.get("hip"))


def parse_torch_cmake_abi(text: str) -> Optional[bool]:
    """TorchConfig.cmake's TORCH_CXX_FLAGS carried -D_GLIBCXX_USE_CXX11_ABI=0/1 up to torch 2.6."""
    m = re.search(r"-D_GLIBCXX_USE_CXX11_ABI=([01])", text)
    return None if m is None else m.group(1) == "1"


def parse_libc10_abi(data: bytes) -> Optional[bool]:
    """libc10.so's symbols name std::__cxx11::basic_string only when built with the cxx11 ABI."""
    if not data.startswith(b"\x7fELF"):
        return None
    return _CXX11_MARKER in data


def cuda_from_local_label(version: str) -> Optional[str]:
    """'2.14.1+cu130' -> '13.0' (torch's wheel labels put the toolkit minor in the last digit)."""
    found = cuda.version_of_local(version)
    return cuda.format_version(found) if found else None


def torch_facts_from_files(
    version_py: Optional[str],
    dist_version: Optional[str],
    cmake_text: Optional[str],
    libc10_head: Optional[bytes],
) -> TorchFacts:
    """Combine what torch's files say; each fallback used is written into notes."""
    notes = []
    version, torch_cuda, hip = parse_torch_version_py(version_py) if version_py else (None, None, None)
    if version is None and dist_version:
        version = dist_version
        torch_cuda = cuda_from_local_label(dist_version)
        notes.append(
            f"torch/version.py unreadable; version {dist_version} from package metadata"
            + (f", CUDA {torch_cuda} from its +cu label" if torch_cuda else ", CUDA unknown")
        )
    if hip:
        notes.append(f"torch {version} is a ROCm build (HIP {hip}); no CUDA")
        torch_cuda = None
    abi = parse_torch_cmake_abi(cmake_text) if cmake_text else None
    if abi is None and libc10_head:
        abi = parse_libc10_abi(libc10_head)
    return TorchFacts(version=version, cuda=torch_cuda, cxx11_abi=abi, notes=tuple(notes))


def _read_text(path: Path, limit: int = 1 << 20) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def _read_bytes(path: Path, limit: int) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def read_torch(facts: InterpreterFacts) -> TorchFacts:
    if not facts.torch_dir:
        return TorchFacts()
    root = Path(facts.torch_dir)
    cmake = _read_text(root / "share" / "cmake" / "Torch" / "TorchConfig.cmake")
    libc10 = None
    if facts.os_name == "linux" and (cmake is None or parse_torch_cmake_abi(cmake) is None):
        libc10 = _read_bytes(root / "lib" / "libc10.so", _LIBC10_READ_LIMIT)
    return torch_facts_from_files(facts.torch_version_py, facts.torch_dist_version, cmake, libc10)
