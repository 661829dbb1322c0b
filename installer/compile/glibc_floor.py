"""Release builds link against glibc 2.28, whatever glibc the build host has.

Why: a release wheel is tagged manylinux_2_28 and must load on RHEL 8, Ubuntu 20.04, Debian 11.
Built on a newer host, the library binds its glibc symbols to that host's newest versions: with the
CUDA runtime linked statically that is ~46 symbols at GLIBC_2.34 (pthread, dl and rt moved into
libc in 2.34), plus dlsym@2.34 from torch's headers. Pinning them one by one (.symver) does not
scale; linking against glibc 2.28 itself does. So the final link of a release build:

- searches a folder of glibc 2.28 *stub* libraries first (`libc.so`, `libm.so`, `libpthread.so`,
  `libdl.so`, `librt.so`, ...). The stubs are what `zig cc -target <arch>-linux-gnu.2.28` generates
  from zig's glibc ABI lists (PyPI `ziglang`; any glibc version, any arch, no sysroot to download):
  shared objects exporting exactly the symbols and versions of glibc 2.28. The linker then binds each
  symbol to the newest version <= 2.28 (pthread_create@GLIBC_2.2.5, dlsym@GLIBC_2.2.5), and the
  library still loads on every newer glibc, which keeps those versions for compatibility.
- `libc.so` there is a linker script, like the system's: the 2.28 stub, zig's 2.28
  `libc_nonshared.a` (fstat64 and friends were static wrappers before glibc 2.33) and the dynamic
  loader stub, so symbols that were not exported by libc.so.6 in 2.28 resolve as they would on 2.28.
- adds one tiny object defining `__libc_single_threaded` (hidden, always 0). The host's libstdc++
  headers (glibc >= 2.32) read that variable inline to skip atomic reference counting in
  single-threaded processes; glibc 2.28 has no such symbol, so the stub link would leave it
  unresolved and the library would fail to load there. Our own copy, always "not single-threaded",
  makes that code always take the atomic path: correct, and what 2.28 did anyway.
- keeps libstdc++ and libgcc_s *dynamic*: what our code needs from them is old (GLIBCXX_3.4.21,
  CXXABI_1.3, GCC_3.0, within manylinux_2_28's GLIBCXX_3.4.24 / GCC_7.0.0 policy; check_wheel
  holds it there). Static -static-libstdc++ would drag in libstdc++.a objects compiled against the
  host glibc (arc4random@2.36, _dl_find_object@2.35 in the unwinder), which the 2.28 stubs cannot
  satisfy.

Local builds for the user's own machine need no floor and never come here. In a manylinux_2_28
image the host glibc is 2.28 already and the floor changes nothing, but the same link is used so
that every release cell builds the same way. Without zig (neither `python -m ziglang` nor `zig` on
PATH) a release build says so and links against the host glibc; the tag then says what it needs
(installer/compile/platform_tag.py) and check_wheel refuses it as a release asset.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..core.errors import InstallerError

GLIBC_FLOOR = (2, 28)
# Stub sonames the link may need (-lc, -lm from the compiler driver; rt, pthread, dl from the static
# CUDA runtime), by the -l name that finds them.
STUB_LIBS = ("c", "m", "pthread", "dl", "rt", "resolv", "util")
LOADER_STUB_RE = r"libld\.so\.\d+"  # zig's name for the ld-linux stub (its soname is the real loader's)
COMPAT_SOURCE = (
    "/* installer/compile/glibc_floor.py: libstdc++ headers of glibc >= 2.32 read this; 2.28 has none. */\n"
    '__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;\n'
)


def zig_command() -> Optional[List[str]]:
    """How to run zig: the PyPI `ziglang` package of this interpreter, else `zig` on PATH."""
    try:
        import importlib.util

        if importlib.util.find_spec("ziglang") is not None:
            return [sys.executable, "-m", "ziglang"]
    except (ImportError, ValueError):
        pass
    found = shutil.which("zig")
    return [found] if found else None


def zig_target(machine: str, floor: Tuple[int, int] = GLIBC_FLOOR) -> str:
    """'x86_64' -> 'x86_64-linux-gnu.2.28' (aarch64 likewise)."""
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine.lower())
    if arch not in ("x86_64", "aarch64"):
        raise InstallerError(f"no glibc floor for machine {machine!r}; release wheels are x86_64 or aarch64")
    return f"{arch}-linux-gnu.{floor[0]}.{floor[1]}"


def parse_zig_link_line(verbose: str) -> Dict[str, Path]:
    """The stub libraries and libc_nonshared.a zig passed to ld.lld, from `zig cc -v` output:
    {'libc.so.6': Path(...), 'libc_nonshared.a': Path(...), 'libld.so.2': ...}.

    The last ld.lld line is the program's link: on a cold zig cache the lines before it link the
    stubs themselves, one each."""
    links = [line.split() for line in verbose.splitlines()
             if line.split() and Path(line.split()[0]).name in ("ld.lld", "ld.lld.exe")]
    if not links:
        raise InstallerError("zig cc -v printed no ld.lld line; cannot locate the glibc stubs")
    found = {}
    for word in links[-1][1:]:
        name = Path(word).name
        if re.fullmatch(r"lib[a-z_]+\.so\.\d+", name) or name == "libc_nonshared.a":
            found[name] = Path(word).resolve()  # zig prints paths under its cache, maybe relative
    return found


def stub_folder(libs: Dict[str, Path], out: Path) -> Path:
    """Write `out` with lib<name>.so for each stub (a linker script for libc, symlinks otherwise)."""
    out.mkdir(parents=True, exist_ok=True)
    for lib in STUB_LIBS:
        matches = [path for name, path in libs.items() if re.fullmatch(rf"lib{lib}\.so\.\d+", name)]
        if not matches:
            if lib in ("c", "m", "pthread", "dl", "rt"):
                raise InstallerError(f"zig generated no lib{lib} stub (found: {', '.join(sorted(libs))})")
            continue
        dst = out / f"lib{lib}.so"
        dst.unlink(missing_ok=True)
        if lib == "c":
            group = [str(matches[0])]
            if "libc_nonshared.a" in libs:
                group.append(str(libs["libc_nonshared.a"]))
            group += [f"AS_NEEDED ( {path} )" for name, path in sorted(libs.items())
                      if re.fullmatch(LOADER_STUB_RE, name)]
            dst.write_text("/* glibc %d.%d stubs, installer/compile/glibc_floor.py */\nGROUP ( %s )\n"
                           % (*GLIBC_FLOOR, " ".join(group)))
        else:
            dst.symlink_to(matches[0])
    return out


def host_c_compiler() -> str:
    for name in (os.environ.get("CC", "").split()[:1] or []) + ["cc", "gcc"]:
        if name and shutil.which(name):
            return name
    raise InstallerError("no C compiler (cc) found for the glibc-floor compat object")


def prepare(workdir: Path, machine: Optional[str] = None, zig: Optional[Sequence[str]] = None) -> Tuple[Path, Path]:
    """(stub folder, compat object) for a link against glibc GLIBC_FLOOR; raises InstallerError."""
    zig = list(zig) if zig else zig_command()
    if not zig:
        raise InstallerError("zig not found: pip install ziglang (or put zig on PATH)")
    target = zig_target(machine or platform.machine())
    workdir.mkdir(parents=True, exist_ok=True)
    probe = workdir / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    proc = subprocess.run(zig + ["cc", "-target", target, "-v", str(probe), "-o", str(workdir / "probe")],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise InstallerError(f"zig cc -target {target} failed (exit {proc.returncode}): {tail[0]}")
    stubs = stub_folder(parse_zig_link_line(proc.stderr + proc.stdout), workdir / f"stubs-{target}")
    source = workdir / "glibc_compat.c"
    source.write_text(COMPAT_SOURCE)
    compat = workdir / "glibc_compat.o"
    subprocess.run([host_c_compiler(), "-O2", "-fPIC", "-c", str(source), "-o", str(compat)], check=True,
                   capture_output=True, text=True, timeout=120)
    return stubs, compat


def apply(ext, workdir: Path) -> str:
    """Point the extension's final link at the glibc floor; returns what was done, for the log."""
    try:
        stubs, compat = prepare(workdir)
    except (InstallerError, OSError, subprocess.SubprocessError) as exc:
        return (f"no glibc {GLIBC_FLOOR[0]}.{GLIBC_FLOOR[1]} floor ({exc}): linking against this host's glibc, "
                "so the wheel is tagged by what that needs and is no release asset")
    ext.library_dirs = [str(stubs)] + list(ext.library_dirs or [])
    ext.extra_objects = list(ext.extra_objects or []) + [str(compat)]
    return f"linking against glibc {GLIBC_FLOOR[0]}.{GLIBC_FLOOR[1]} stubs (zig) for a manylinux_2_28 wheel"
