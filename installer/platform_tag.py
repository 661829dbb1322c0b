"""The manylinux tag a built library can honestly claim: the newest glibc symbol version it needs.

A release built inside a manylinux_2_28 image needs nothing newer than GLIBC_2.28 and is tagged so;
the same sources built on a newer host (dlsym moved to libc in 2.34, libstdc++ headers reach for
__libc_single_threaded from 2.32) get the tag that host's glibc forces, instead of a claim that
would make pip install a library that fails to load on an older system.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Iterable, Optional

MANYLINUX_FLOOR = (2, 17)


def required_symbol_versions(objdump_dynamic_symbols: str) -> list[tuple[str, str, str]]:
    """`objdump -T` -> [(family, version, symbol)] for every undefined (required) versioned symbol of
    glibc, libstdc++ and libgcc: e.g. ('GLIBC', '2.34', 'dlsym'), ('CXXABI', 'TM_1', ...)."""
    required = []
    for line in objdump_dynamic_symbols.splitlines():
        if "*UND*" not in line:
            continue
        m = re.search(r"\(?\b(GLIBCXX|GLIBC|CXXABI|GCC)_([A-Za-z0-9_.]+)\)?\s+(\S+)\s*$", line)
        if m:
            required.append((m.group(1), m.group(2), m.group(3)))
    return required


def glibc_versions(objdump_dynamic_symbols: str) -> list[tuple[int, int]]:
    """GLIBC_x.y versions the library requires (GLIBC_PRIVATE and the like are not versions)."""
    found = []
    for family, version, _symbol in required_symbol_versions(objdump_dynamic_symbols):
        m = re.match(r"(\d+)\.(\d+)", version)
        if family == "GLIBC" and m:
            found.append((int(m.group(1)), int(m.group(2))))
    return found


def required_glibc(libraries: Iterable[Path]) -> Optional[tuple[int, int]]:
    """Newest glibc any of `libraries` needs; None when objdump is unavailable."""
    newest = MANYLINUX_FLOOR
    for lib in libraries:
        try:
            out = subprocess.run(["objdump", "-T", str(lib)], capture_output=True, text=True, timeout=60, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        newest = max([newest, *glibc_versions(out.stdout)])
    return newest


def manylinux_tag(glibc: tuple[int, int], machine: str) -> str:
    return f"manylinux_{glibc[0]}_{glibc[1]}_{machine}"
