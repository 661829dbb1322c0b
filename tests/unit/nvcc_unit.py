"""A kernel unit (kernels/units/*.cu) compiled here with the flags a local build gives nvcc: how unit
tests read what nvcc and ptxas make of the kernels (spills, shared memory, PTX) without a GPU."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from installer.compile import native
from installer.core import shipped
from installer.detect import toolchain


def compile_unit(unit: str, arch: str, output: Path, *args: str) -> str:
    """nvcc with the shipped flags for `arch` (one image) on `unit`, `args` choosing what it writes to
    `output` (-cubin, -ptx, ...); returns nvcc's stderr. The calling test is skipped where no CUDA
    toolkit is found."""
    toolkit, why_not = toolchain.find_cuda("linux", os.environ)  # the nvcc a local build would use
    if toolkit is None:
        pytest.skip(why_not)
    flags = native.nvcc_flags(native.parse_archs([arch]), compress=False, threads=1)
    return subprocess.run([toolkit.nvcc, *flags, *args, "-o", str(output), str(shipped.SOURCE_ROOT / "kernels" / "units" / unit)],
                          capture_output=True, text=True, check=True).stderr
