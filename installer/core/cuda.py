"""CUDA toolkit versions and their labels, and arch targets: parsed, formatted and compared here only.

    version   (13, 0)   <-> '13.0'          a toolkit or a driver's CUDA version
    label     'cu130'   <-> (13, 0)         the wheel's local version label, the index folder
    target    '9.0a', '12.0f+PTX'           what a build compiles for (TORCH_CUDA_ARCH_LIST syntax)
    code arch 'sm_90a', 'compute_120'       what a fatbin holds: a cubin or PTX

A leaf: it imports nothing from installer/ but the by-path loader of the rules it shares with the
run time (installer/core/shipped.py), so every module there and every script can use it.
A string that is not what it should be raises ValueError; each caller words it for its own user.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from . import shipped

CudaVersion = Tuple[int, int]

# The coverage rule ships in the wheel: the run time judges a cached install by the same rule
# (cudelta/_install_record.py), so it lives there and is used here.
_shared = shipped.load("_install_record")

_VERSION_RE = re.compile(r"(\d+)\.(\d+)")
_TOOLKIT_RE = re.compile(r"(\d+)\.(\d+)(?:\.\d+)*")  # nvcc's full version may carry a patch level
# torch's and cudelta's labels put the minor in the last digit: cu130 is 13.0, cu129 is 12.9.
_LABEL_RE = re.compile(r"cu(\d+)(\d)")
_TARGET_RE = re.compile(r"(\d+)\.(\d+)([af]?)(\+PTX)?", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# Versions and labels


def parse_version(text: str, *, patch_ok: bool = False) -> CudaVersion:
    """'13.0' -> (13, 0); with patch_ok also '13.0.88' (what a toolkit may report)."""
    m = (_TOOLKIT_RE if patch_ok else _VERSION_RE).fullmatch(str(text).strip())
    if not m:
        raise ValueError(f"{text!r} is not a CUDA version like '13.0'")
    return int(m.group(1)), int(m.group(2))


def format_version(version: CudaVersion) -> str:
    return f"{version[0]}.{version[1]}"


@dataclass(frozen=True)
class DriverOverride:
    """CUDELTA_DRIVER_CUDA, parsed once (installer/core/settings.py): the driver CUDA version to choose a
    wheel for, or None for `cpu` (the pure-Python wheel)."""

    version: Optional[CudaVersion]

    @property
    def cpu(self) -> bool:
        return self.version is None

    def __str__(self) -> str:
        return "cpu" if self.version is None else format_version(self.version)


def label(version: CudaVersion) -> str:
    """(13, 0) -> 'cu130'."""
    return f"cu{version[0]}{version[1]}"


def parse_label(text: str) -> CudaVersion:
    """'cu130' -> (13, 0)."""
    m = _LABEL_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a CUDA label like 'cu130'")
    return int(m.group(1)), int(m.group(2))


def label_of(toolkit: str) -> str:
    """'13.0' or '13.0.88' -> 'cu130': the label of a build with that toolkit."""
    return label(parse_version(toolkit, patch_ok=True))


def version_of_local(version: str) -> Optional[CudaVersion]:
    """'2.14.1+cu130' -> (13, 0): the CUDA of a version's local label; None without one."""
    local = version.strip().partition("+")[2]
    try:
        return parse_label(local) if local else None
    except ValueError:
        return None


def parse_user_version(text: str) -> CudaVersion:
    """What a person types for a CUDA version: '13.0', '130', 'cu130' (and 'cu13.0')."""
    value = text.strip().lower()
    m = re.fullmatch(r"(?:cu)?(\d+)\.(\d+)", value) or re.fullmatch(r"(?:cu)?(\d{2})(\d)", value)
    if not m:
        raise ValueError(f"{text!r} is not a CUDA version")
    return int(m.group(1)), int(m.group(2))


def driver_version(value: int) -> Optional[CudaVersion]:
    """cuDriverGetVersion's integer: 1000 * major + 10 * minor, e.g. 13000 -> (13, 0); <= 0 -> None."""
    if value <= 0:
        return None
    return value // 1000, (value % 1000) // 10


def nvcc_release(text: str) -> Optional[CudaVersion]:
    """`nvcc --version` -> (13, 0) from 'Cuda compilation tools, release 13.0, V13.0.88'."""
    m = re.search(r"release (\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_capability(text: str) -> CudaVersion:
    """A GPU's compute capability as nvidia-smi prints it: '9.0' -> (9, 0)."""
    return parse_version(text)


# --------------------------------------------------------------------------------------------
# Arch targets (what a build compiles for)


@dataclass(frozen=True)
class ArchTarget:
    """One build target: 9.0a -> cubin sm_90a; 12.0f+PTX -> cubin sm_120f and compute_120 PTX."""

    major: int
    minor: int
    suffix: str  # "", "a" (arch-specific) or "f" (family)
    ptx: bool

    @classmethod
    def parse(cls, text: str) -> "ArchTarget":
        m = _TARGET_RE.fullmatch(text.strip())
        if not m:
            raise ValueError(f"{text!r} is not a CUDA arch; expected e.g. 8.0, 9.0a, 10.0f, 12.0f+PTX")
        return cls(int(m.group(1)), int(m.group(2)), m.group(3).lower(), bool(m.group(4)))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}" + ("+PTX" if self.ptx else "")

    @property
    def code(self) -> str:
        """'90a': the digits and suffix nvcc's compute_/sm_ names share."""
        return f"{self.major}{self.minor}{self.suffix}"

    @property
    def cubin(self) -> str:
        return f"sm_{self.code}"

    @property
    def ptx_name(self) -> Optional[str]:
        # PTX of the plain arch: the family/arch-specific PTX would only JIT on that family.
        return f"compute_{self.major}{self.minor}" if self.ptx else None

    def gencode(self) -> List[str]:
        """nvcc's spelling: ['-gencode', 'arch=compute_90a,code=sm_90a'] (+ the PTX one)."""
        flags = ["-gencode", f"arch=compute_{self.code},code={self.cubin}"]
        if self.ptx_name:
            flags += ["-gencode", f"arch={self.ptx_name},code={self.ptx_name}"]
        return flags


def split_arch_list(raw: str) -> List[str]:
    """torch's TORCH_CUDA_ARCH_LIST separators: '8.0;9.0a 10.0f+PTX' -> ['8.0', '9.0a', '10.0f+PTX']."""
    return [item for item in re.split(r"[;,\s]+", raw.strip()) if item]


def parse_arch_targets(items: Iterable[str]) -> List[ArchTarget]:
    return [ArchTarget.parse(item) for item in items]


def default_target(major: int, minor: int) -> ArchTarget:
    """The target a local build picks for a GPU: arch-specific where that exists (9.0a)."""
    return ArchTarget(major, minor, "a" if (major, minor) == (9, 0) else "", False)


# --------------------------------------------------------------------------------------------
# Code archs (what a fatbin holds) and which GPU they run on


@dataclass(frozen=True)
class CodeArch:
    """'sm_90a' -> CodeArch('sm', 9, 0, 'a'); 'compute_120' -> CodeArch('compute', 12, 0, '')."""

    kind: str  # "sm" (cubin) | "compute" (PTX)
    major: int
    minor: int
    suffix: str

    @classmethod
    def parse(cls, text: str) -> "CodeArch":
        return cls(*_shared.parse_code_arch(text))

    def __str__(self) -> str:
        return f"{self.kind}_{self.major}{self.minor}{self.suffix}"


def _code_kind(text: str) -> Optional[str]:
    try:
        return _shared.parse_code_arch(text)[0]
    except (TypeError, ValueError):
        return None


def is_cubin(text: str) -> bool:
    """'sm_90a' yes; 'compute_120', 'sm90' no."""
    return _code_kind(text) == "sm"


def is_ptx(text: str) -> bool:
    return _code_kind(text) == "compute"


arch_covers = _shared.arch_covers
covering_arch = _shared.covering_arch
runnable_images = _shared.runnable_images
preference = _shared.preference
