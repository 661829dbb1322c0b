"""The release policy: what a release builds and the floors it promises, in one place.

Read by the release matrix (release/matrix.py), the build (installer/: archs, floors, the newest
GCC of each toolkit), the release assets and their checks (release/make_release.py,
release/check_wheel.py), the dry run (release/dry_run.py) and the loader's driver guard
(cudelta/_native.py). Standard library only and no import of the package: the installer loads
this file by path (installer/core/shipped.py), where torch may not be installed; it ships in the wheel
because the run time applies the driver-floor rule too.

Adding a CUDA version: CUDA_VERSIONS and its MAX_GCC_FOR_CUDA entry (tests/unit/test_release_policy.py
fails on a version without one, and so does the matrix).
"""

from __future__ import annotations

from typing import Mapping, Tuple

# The toolkits a release builds, one wheel per toolkit and CPU arch (release/matrix.py).
CUDA_VERSIONS: Tuple[str, ...] = ("12.9", "13.0")
# The cell a machine outside CI builds in a dry run: the toolkit of a developer's nvcc and of the
# CI cell job (the 12.9 cells need a 12.9 toolkit, which only the CI images have).
CELL_CUDA = "13.0"
# Newest GCC major each toolkit's nvcc accepts (CUDA installation guides). Every CUDA_VERSIONS
# entry needs one; local builds with a toolkit missing here skip the check.
MAX_GCC_FOR_CUDA: Mapping[Tuple[int, int], int] = {
    (12, 4): 13, (12, 5): 13, (12, 6): 13, (12, 8): 14, (12, 9): 14, (13, 0): 15, (13, 1): 15,
}
# What a release wheel carries: sm_80 covers 8.x, the arch-specific sm_90a Hopper, the family
# cubins sm_100f / sm_120f Blackwell datacenter / consumer, and compute_120 PTX for what comes next.
RELEASE_ARCHS: Tuple[str, ...] = ("8.0", "9.0a", "10.0f", "12.0f+PTX")
# The oldest torch whose stable ABI the library uses, and the oldest Python (cp310-abi3).
TORCH_FLOOR = "2.10"
PYTHON_FLOOR = "3.10"


def toolkit_version(toolkit: str) -> Tuple[int, int]:
    """'13.0' or '13.0.88' -> (13, 0); ValueError naming the text otherwise."""
    parts = str(toolkit).strip().split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{toolkit!r} is not a CUDA version like '13.0'")
    return int(parts[0]), int(parts[1])


def driver_floor(toolkit: str) -> Tuple[int, int]:
    """The oldest driver (its CUDA version) that runs a library built with `toolkit`: the toolkit's
    major release. The CUDA runtime is linked statically, so minor-version compatibility holds
    within a major."""
    return toolkit_version(toolkit)[0], 0


def newest_gcc(toolkit: str) -> int:
    """The newest GCC major `toolkit`'s nvcc accepts; ValueError naming the toolkit if the policy has none."""
    version = toolkit_version(toolkit)
    if version not in MAX_GCC_FOR_CUDA:
        raise ValueError(f"no newest GCC for CUDA {toolkit}: add it to MAX_GCC_FOR_CUDA in cudelta/_release_policy.py")
    return MAX_GCC_FOR_CUDA[version]
