"""The extension compiles every CUDA unit under kernels/, and no file includes a .cu (the launch rules
that benchmarks/warp_sweep.cu shares live in a header)."""

import re

from installer.compile import native
from installer.core import shipped

ROOT = shipped.SOURCE_ROOT


def test_every_cuda_unit_is_compiled_and_every_source_exists():
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kernels").rglob("*.cu")}
    assert set(native.SOURCES) == on_disk | {"csrc/ops.cpp"}
    assert all((ROOT / source).is_file() for source in native.SOURCES)


def test_no_source_includes_a_cu_file():
    sources = [p for folder in ("kernels", "csrc", "benchmarks") for p in (ROOT / folder).rglob("*")
               if p.suffix in (".cu", ".cuh", ".h", ".cpp")]
    including = [p.name for p in sources if re.search(r'^\s*#\s*include\s*"[^"]+\.cu"', p.read_text(), re.M)]
    assert sources and including == []
