import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from installer.compile.platform_tag import glibc_versions, manylinux_tag, release_platform, required_glibc

OBJDUMP = """
0000000000000000      DF *UND*	0000000000000000 (GLIBC_2.34) dlsym
0000000000000000      DO *UND*	0000000000000000 (GLIBC_2.32) __libc_single_threaded
0000000000000000      DF *UND*	0000000000000000 (GLIBC_2.2.5) memcpy
0000000000012340 g    DF .text	0000000000000010  Base        GLIBC_2.99_looks_defined_not_needed
"""


def test_only_undefined_symbols_are_requirements():
    assert sorted(glibc_versions(OBJDUMP)) == [(2, 2), (2, 32), (2, 34)]


def test_tag_from_the_newest_requirement():
    assert manylinux_tag(max(glibc_versions(OBJDUMP)), "x86_64") == "manylinux_2_34_x86_64"


def _library(tmp_path, name: str, source: str) -> Path:
    if not (shutil.which("gcc") and shutil.which("objdump")):
        pytest.skip("needs gcc and objdump")
    (tmp_path / f"{name}.c").write_text(source)
    lib = tmp_path / f"{name}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, tmp_path / f"{name}.c"], check=True)
    return lib


def test_a_library_that_needs_older_glibc_still_claims_manylinux_2_28(tmp_path):
    # Its symbols would allow a lower tag, but the C++ runtime parts (GLIBCXX_3.4.21 from GCC >= 5)
    # need manylinux_2_24 by auditwheel's policy, and 2_28 is what release builds link against
    # (installer/compile/glibc_floor.py): the claim is never below that.
    lib = _library(tmp_path, "old", "int answer(void) { return 42; }\n")
    assert all(v < (2, 28) for v in glibc_versions(subprocess.run(["objdump", "-T", lib], capture_output=True,
                                                                   text=True, check=True).stdout))
    assert required_glibc([lib]) == (2, 28)
    assert manylinux_tag(required_glibc([lib]), "x86_64") == release_platform("x86_64") == "manylinux_2_28_x86_64"


def test_a_library_that_needs_newer_glibc_claims_what_it_needs(tmp_path):
    if tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 34):
        pytest.skip("dlsym moved into libc (GLIBC_2.34) only from glibc 2.34")
    old = _library(tmp_path, "old", "int answer(void) { return 42; }\n")
    new = _library(tmp_path, "new", '#include <dlfcn.h>\nvoid *find(void) { return dlsym(0, "x"); }\n')
    assert required_glibc([old, new]) == (2, 34)
    assert required_glibc([tmp_path / "missing.so"]) is None  # objdump fails: no claim at all


def test_the_release_links_against_the_glibc_it_claims():
    from installer.compile.glibc_floor import zig_target
    from installer.compile.platform_tag import MANYLINUX_FLOOR

    assert zig_target("x86_64").endswith(f".{MANYLINUX_FLOOR[0]}.{MANYLINUX_FLOOR[1]}")
    assert release_platform("aarch64").startswith(f"manylinux_{MANYLINUX_FLOOR[0]}_{MANYLINUX_FLOOR[1]}_")


def test_unversioned_required_symbols_and_defined_ones():
    from installer.compile.platform_tag import defined_symbols, unversioned_undefined

    text = OBJDUMP + ("0000000000000000      D  *UND*\t0000000000000000  Base        fstat64\n"
                      "0000000000000000  w   D  *UND*\t0000000000000000  Base        __gmon_start__\n")
    assert unversioned_undefined(text) == ["fstat64"]
    assert defined_symbols(text) == {"GLIBC_2.99_looks_defined_not_needed"}


def test_elf_machine_reads_the_header(tmp_path):
    import struct

    from installer.compile.platform_tag import elf_machine

    for machine, name in ((62, "x86_64"), (183, "aarch64")):
        lib = tmp_path / f"{name}.so"
        lib.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(11) + struct.pack("<H", machine) + bytes(40))
        assert elf_machine(lib) == name


# --- installer/compile/glibc_floor.py: the release link against glibc 2.28 ------------------------------

ZIG_VERBOSE_COLD = """\
ld.lld -shared -soname libm.so.6 -o /c/o/aa/libm.so.6 /c/o/aa/m.s
ld.lld --error-limit=0 -m elf_x86_64 -o probe /c/o/11/crt1.o --dynamic-linker /lib64/ld-linux-x86-64.so.2 \
/c/o/11/probe.o --as-needed /c/o/aa/libm.so.6 /c/o/aa/libc.so.6 /c/o/aa/libld.so.2 /c/o/aa/libpthread.so.0 \
/c/o/aa/libdl.so.2 /c/o/aa/librt.so.1 /c/o/bb/libc_nonshared.a /c/o/cc/libcompiler_rt.a
"""


def test_the_stubs_come_from_zigs_last_link_line():
    from pathlib import Path

    from installer.compile.glibc_floor import parse_zig_link_line

    found = parse_zig_link_line(ZIG_VERBOSE_COLD)  # the first line links a stub itself (cold cache)
    assert found["libc.so.6"] == Path("/c/o/aa/libc.so.6")
    assert found["libc_nonshared.a"] == Path("/c/o/bb/libc_nonshared.a")
    assert set(found) == {"libm.so.6", "libc.so.6", "libld.so.2", "libpthread.so.0", "libdl.so.2", "librt.so.1",
                          "libc_nonshared.a"}


def test_the_stub_folder_makes_libc_a_linker_script_with_nonshared_and_the_loader(tmp_path):
    from installer.compile.glibc_floor import parse_zig_link_line, stub_folder

    out = stub_folder(parse_zig_link_line(ZIG_VERBOSE_COLD), tmp_path / "stubs")
    script = (out / "libc.so").read_text()
    assert "GROUP ( /c/o/aa/libc.so.6 /c/o/bb/libc_nonshared.a AS_NEEDED ( /c/o/aa/libld.so.2 ) )" in script
    for lib in ("m", "pthread", "dl", "rt"):
        assert (out / f"lib{lib}.so").is_symlink()


def test_zig_targets_and_a_missing_stub(tmp_path):
    import pytest

    from installer.compile.glibc_floor import stub_folder, zig_target
    from installer.core.errors import InstallerError

    assert zig_target("x86_64") == "x86_64-linux-gnu.2.28"
    assert zig_target("arm64") == "aarch64-linux-gnu.2.28"
    with pytest.raises(InstallerError, match="no glibc floor for machine 'ppc64le'; release wheels are x86_64 or"):
        zig_target("ppc64le")
    with pytest.raises(InstallerError, match="no libc stub"):
        stub_folder({}, tmp_path / "stubs")


def test_without_zig_the_extension_is_left_alone_and_the_log_says_why(tmp_path, monkeypatch):
    from installer.compile import glibc_floor

    class Ext:
        library_dirs = ["/torch/lib"]
        extra_objects: list = []

    monkeypatch.setattr(glibc_floor, "zig_command", lambda: None)
    ext = Ext()
    message = glibc_floor.apply(ext, tmp_path)
    assert "no glibc 2.28 floor" in message and "pip install ziglang" in message
    assert ext.library_dirs == ["/torch/lib"] and ext.extra_objects == []


def test_release_wheels_are_tagged_for_the_arch_they_were_built_on():
    assert release_platform("x86_64") == "manylinux_2_28_x86_64"
    assert release_platform("aarch64") == "manylinux_2_28_aarch64"
