"""The build's first decision, and what a local compile builds for. Pure: settings and target in.

    pure     no native code at all (not Linux, or CUDELTA_DRIVER_CUDA=cpu): the pure-Python wheel
    fetch    look for a verified prebuilt wheel (installer/fetch/prebuilt.py), else compile
    compile  FORCE_BUILD / CUDELTA_RELEASE_BUILD: compile, never download (installer/compile/local_build.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from ..core import cuda, shipped
from ..core.settings import Settings
from ..core.target import TargetEnv
from .choose import pure_python_reason


@dataclass(frozen=True)
class Plan:
    kind: str  # "pure" | "fetch" | "compile"
    reason: str


def plan_for(settings: Settings, target: TargetEnv) -> Plan:
    """The first decision: no native code at all, try a prebuilt wheel, or compile."""
    pure = pure_python_reason(target)  # the one place "pure-Python?" is decided
    if pure is not None:
        return Plan("pure", pure)
    if settings.release_build:
        return Plan("compile", "CUDELTA_RELEASE_BUILD=1: compiling the release fat binary")
    if settings.force_build:
        return Plan("compile", "FORCE_BUILD=1: compiling locally, no download")
    return Plan("fetch", "looking for a prebuilt wheel")


def release_targets() -> List[cuda.ArchTarget]:
    return cuda.parse_arch_targets(shipped.load("_release_policy").RELEASE_ARCHS)


def archs_for_gpus(capabilities: Sequence[Tuple[int, int]]) -> List[cuda.ArchTarget]:
    """The local-build default: one cubin per distinct GPU, arch-specific where it exists (9.0a)."""
    return [cuda.default_target(major, minor) for major, minor in sorted(set(capabilities))]


def compile_archs(settings: Settings, target: TargetEnv) -> Tuple[List[cuda.ArchTarget], str]:
    """What a local compile builds for, and why (said in the log)."""
    if settings.cuda_archs:
        return list(settings.cuda_archs), "from CUDELTA_CUDA_ARCHS / TORCH_CUDA_ARCH_LIST"
    if settings.release_build:
        return release_targets(), "release archs"
    if target.gpus:
        return archs_for_gpus([(g.major, g.minor) for g in target.gpus]), "the GPUs present"
    return release_targets(), "no GPU visible, so all release archs (set TORCH_CUDA_ARCH_LIST to build fewer)"
