from installer.platform_tag import glibc_versions, manylinux_tag

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
