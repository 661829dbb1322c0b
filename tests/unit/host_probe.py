"""Host programs built against the kernels' headers with the nvcc a local build would use: how unit
tests ask the C++ launch rules themselves rather than a copy of them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from installer.core import shipped
from installer.detect import toolchain


def run_host_probe(source: str, folder: Path) -> str:
    """Compile `source` (C++17, kernels/ on the include path) in `folder`, run it, and return what it
    printed; the calling test is skipped where no CUDA toolkit is found."""
    toolkit, why_not = toolchain.find_cuda("linux", os.environ)
    if toolkit is None:
        pytest.skip(why_not)
    (folder / "probe.cu").write_text(source)
    subprocess.run([toolkit.nvcc, "-std=c++17", "-I", str(shipped.SOURCE_ROOT / "kernels"), "-o", str(folder / "probe"),
                    str(folder / "probe.cu")], check=True, capture_output=True, text=True)
    return subprocess.run([str(folder / "probe")], check=True, capture_output=True, text=True).stdout
