"""The manylinux tag a built library can honestly claim: the newest glibc symbol version it needs.

A release build links against glibc 2.28 (installer/compile/glibc_floor.py, on any host) and needs nothing
newer than GLIBC_2.28, so it is tagged manylinux_2_28; a build that could not (no zig: dlsym moved
to libc in 2.34, libstdc++ headers reach for __libc_single_threaded from 2.32) gets the tag its host's
glibc forces, instead of a claim that would make pip install a library that fails to load on an
older system.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Iterable, Optional

# The lowest tag a release claims: manylinux_2_28, what release builds link against
# (installer/compile/glibc_floor.py). Lower would not be honest even where the glibc symbols allow it: the
# C++ runtime parts (GLIBCXX_3.4.21 from GCC >= 5) need manylinux_2_24 by auditwheel's policy, and
# 2_28 is the floor the project documents and checks (release/check_wheel.py).
MANYLINUX_FLOOR = (2, 28)


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


def unversioned_undefined(objdump_dynamic_symbols: str) -> list[str]:
    """`objdump -T` -> the strong (not weak) required symbols bound to no version. torch's and
    Python's symbols are unversioned and fine; a glibc symbol among them means the link found no
    versioned definition (e.g. linked against older glibc stubs that lack it) and the library would
    fail to load wherever glibc lacks that symbol, which no version check can see."""
    names = []
    for line in objdump_dynamic_symbols.splitlines():
        if "*UND*" not in line:
            continue
        flags, _, rest = line.partition("*UND*")
        if re.search(r"\bw\b", flags[16:]):
            continue  # weak: absence is allowed
        words = rest.split()
        # *UND*  <size>  [version]  name  ("Base" or nothing when unversioned)
        if len(words) == 2 or (len(words) == 3 and words[1] in ("Base", "*local*")):
            names.append(words[-1])
    return names


def defined_symbols(objdump_dynamic_symbols: str) -> set[str]:
    """`objdump -T` -> the names a library defines (exports)."""
    names = set()
    for line in objdump_dynamic_symbols.splitlines():
        words = line.split()
        if len(words) >= 4 and "*UND*" not in line and re.fullmatch(r"[0-9a-f]{8,16}", words[0]):
            names.add(words[-1])
    return names


def elf_machine(library: Path) -> str:
    """The CPU a built library is for, from its ELF header: 'x86_64' or 'aarch64' (the release
    tag's arch must come from the library, not from a constant)."""
    with open(library, "rb") as fh:
        header = fh.read(20)
    if header[:4] != b"\x7fELF":
        raise ValueError(f"{library} is not an ELF file")
    order = "little" if header[5] == 1 else "big"
    machine = int.from_bytes(header[18:20], order)
    return {62: "x86_64", 183: "aarch64"}.get(machine, f"elf-machine-{machine}")


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


def release_platform(machine: str) -> str:
    """The tag a release wheel claims: manylinux_2_28_<machine>. The one place it is spelled
    (the release build's wheel name, release/check_wheel.py's expected tag)."""
    return manylinux_tag(MANYLINUX_FLOOR, machine)
