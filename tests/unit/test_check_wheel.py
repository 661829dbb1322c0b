"""The parsing helpers of release/check_wheel.py, on sample tool output (no torch, no CUDA, no tools)."""

import base64
import hashlib
import json
import struct
import sys
import zipfile

import pytest

from installer.compile import native
from installer.compile.platform_tag import defined_symbols, required_symbol_versions, unversioned_undefined
from installer.core import cuda
from release import wheel_parsers as wp
from release.check_wheel import WheelChecker

# cuobjdump 13.x on a wheel built with nvcc 13.0 for sm_80, sm_90a, sm_100f, sm_120f + compute_120.
LIST_ELF = """\
ELF file    1: gdn_decode.sm_80.cubin
ELF file    2: gdn_decode.sm_90a.cubin
ELF file    3: gdn_decode.sm_100.cubin
ELF file    4: gdn_decode.sm_120.cubin
ELF file    5: probe.sm_80.cubin
ELF file    6: probe.sm_90a.cubin
ELF file    7: probe.sm_100.cubin
ELF file    8: probe.sm_120.cubin
"""
LIST_PTX = """\
PTX file    1: gdn_decode.sm_120.ptx
PTX file    2: probe.sm_120.ptx
"""
RES_USAGE = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]
host = linux
compile_size = 64bit
compressed
identifier = /src/kernels/gdn_decode.cu

Resource usage:
 Common:
  GLOBAL:0
 Function _ZN7cudelta17gdn_decode_kernelI6__halfLi64ELNS_7VariantE0EEEvNS_15GdnDecodeParamsE:
  REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_100f
code version = [1,8]
host = linux
compile_size = 64bit
identifier = /src/kernels/gdn_decode.cu

Resource usage:
 Common:
  GLOBAL:0

Fatbin ptx code:
================
arch = sm_120
code version = [9,0]
host = linux
compile_size = 64bit
compressed
identifier = /src/kernels/gdn_decode.cu
"""
OBJDUMP_T = """
cudelta/_C.abi3.so:     file format elf64-x86-64

DYNAMIC SYMBOL TABLE:
0000000000000000      DF *UND*\t0000000000000000 (GLIBCXX_3.4) _ZNSt9basic_iosIcSt11char_traitsIcEE5clearESt12_Ios_Iostate
0000000000000000      DF *UND*\t0000000000000000  Base        _ZNSt7__cxx1119basic_ostringstreamIcSt11char_traitsIcESaIcEEC1Ev
0000000000000000      DF *UND*\t0000000000000000 (CXXABI_1.3) __cxa_begin_catch
0000000000000000      DF *UND*\t0000000000000000 (libcudart.so.13) __cudaGetKernel
0000000000000000      DF *UND*\t0000000000000000 (CXXABI_1.3.9) _ZdlPvm
0000000000000000      DF *UND*\t0000000000000000  Base        aoti_torch_get_data_ptr
0000000000000000      DF *UND*\t0000000000000000 (GLIBCXX_3.4.21) _ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE6appendEPKcm
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.2.5) strlen
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.14) memcpy
0000000000000000      DO *UND*\t0000000000000000 (GLIBC_2.32) __libc_single_threaded
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.34) dlsym
0000000000000000      DF *UND*\t0000000000000000 (GCC_3.0) _Unwind_Resume
0000000000000000  w   DF *UND*\t0000000000000000 (GLIBC_2.2.5) __cxa_finalize
0000000000010020 g    DF .text\t000000000000002d  Base        _ZN7cudelta12variant_nameENS_7VariantE
"""
OBJDUMP_P = """
Dynamic Section:
  NEEDED               libc10.so
  NEEDED               libtorch_cpu.so
  NEEDED               libcudart.so.13
  NEEDED               libstdc++.so.6
  NEEDED               libc.so.6
  INIT                 0x0000000000004000
"""


# --- names ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cubin, listed", [
    ("sm_80", "sm_80"), ("sm_86", "sm_86"), ("sm_90a", "sm_90a"), ("sm_100a", "sm_100a"),
    ("sm_100f", "sm_100"), ("sm_120f", "sm_120"), ("sm_103f", "sm_103"),
])
def test_elf_listing_name_drops_only_the_family_suffix(cubin, listed):
    assert wp.elf_listing_name(cubin) == listed


@pytest.mark.parametrize("ptx, listed", [("compute_120", "sm_120"), ("compute_80", "sm_80"), ("compute_90a", "sm_90a")])
def test_ptx_listing_name(ptx, listed):
    assert wp.ptx_listing_name(ptx) == listed


@pytest.mark.parametrize("bad", ["sm80", "compute_120", "sm_100x", ""])
def test_elf_listing_name_rejects_what_is_not_a_cubin(bad):
    with pytest.raises(ValueError, match=rf"^{bad!r} is not a cubin arch \(sm_80, sm_90a, sm_100f\)$"):
        wp.elf_listing_name(bad)


def test_release_archs_map_onto_the_listing():
    info_archs = ["sm_80", "sm_90a", "sm_100f", "sm_120f"]
    listed = wp.parse_cuobjdump_list(LIST_ELF, "elf")
    want = {wp.elf_listing_name(a): a for a in info_archs}
    assert wp.coverage([arch for _, arch in listed], want, "cubin") == ([], 2)


@pytest.mark.parametrize("toolkit, label", [("13.0", "cu130"), ("12.8", "cu128"), ("13.1.2", "cu131")])
def test_cuda_label(toolkit, label):
    assert cuda.label_of(toolkit) == label  # the one label function: installer's


# --- cuobjdump ---------------------------------------------------------------------------------

def test_parse_list_elf():
    listed = wp.parse_cuobjdump_list(LIST_ELF, "elf")
    assert listed[:4] == [("gdn_decode", "sm_80"), ("gdn_decode", "sm_90a"), ("gdn_decode", "sm_100"),
                          ("gdn_decode", "sm_120")]
    assert [m for m, _ in listed[4:]] == ["probe"] * 4


def test_listing_names_are_normalised_whether_or_not_cuobjdump_keeps_the_family_suffix():
    want = {wp.elf_listing_name(a): a for a in ["sm_90a", "sm_100f"]}
    for listed in (["sm_90a", "sm_100"], ["sm_90a", "sm_100f"]):
        assert wp.coverage([wp.elf_listing_name(a) for a in listed], want, "cubin") == ([], 1)


def test_parse_list_ptx():
    assert wp.parse_cuobjdump_list(LIST_PTX, "ptx") == [("gdn_decode", "sm_120"), ("probe", "sm_120")]


def test_parse_list_without_lineinfo_names_modules_after_the_library():
    # Built without -lineinfo, nvcc records no source name: cuobjdump numbers the entries instead.
    text = "ELF file    1: _C.abi3.1.sm_80.cubin\nELF file    2: _C.abi3.2.sm_90a.cubin\n"
    assert wp.parse_cuobjdump_list(text, "elf") == [("_C.abi3.1", "sm_80"), ("_C.abi3.2", "sm_90a")]


def test_parse_list_ignores_other_lines():
    text = "cuobjdump info    : File 'x.so' has no PTX\nELF file    1: my.kernels.sm_80.cubin\n"
    assert wp.parse_cuobjdump_list(text, "elf") == [("my.kernels", "sm_80")]
    assert wp.parse_cuobjdump_list("", "ptx") == []


def test_coverage_finds_missing_partial_and_unclaimed_images():
    want = {"sm_80": "sm_80", "sm_100": "sm_100f"}
    assert wp.coverage(["sm_80", "sm_100", "sm_80", "sm_100"], want, "cubin") == ([], 2)
    problems, modules = wp.coverage(["sm_80", "sm_100", "sm_80"], want, "cubin")
    assert modules == 2 and problems == ["cubin for sm_100f (listed sm_100) in 1 of 2 modules only"]
    problems, _ = wp.coverage(["sm_80", "sm_86"], want, "cubin")
    assert problems == ["no cubin for sm_100f (listed sm_100)", "cubins not in build info: sm_86 x1"]
    assert wp.coverage([], want, "cubin")[0] == ["no cubin for sm_80", "no cubin for sm_100f (listed sm_100)"]


def test_parse_list_rejects_an_unknown_name_format():
    with pytest.raises(ValueError, match="unexpected cuobjdump --list-elf line: 'ELF file    1: gdn_decode.cubin'"):
        wp.parse_cuobjdump_list("ELF file    1: gdn_decode.cubin\n", "elf")


def test_parse_fatbin_headers_reads_arch_variant_and_compression():
    entries = wp.parse_fatbin_headers(RES_USAGE)
    assert [(e["kind"], e["arch"], e["compressed"]) for e in entries] == [
        ("elf", "sm_90a", True), ("elf", "sm_100f", False), ("ptx", "sm_120", True)]
    assert all(e["identifier"] == "/src/kernels/gdn_decode.cu" for e in entries)
    assert entries[0]["code version"] == "[1,8]"


def test_parse_fatbin_headers_without_identifier():
    text = "Fatbin elf code:\n================\narch = sm_100f\ncode version = [1,8]\nhost = linux\n" \
           "compile_size = 64bit\ncompressed\n\nResource usage:\n Common:\n  GLOBAL:0\n"
    assert wp.parse_fatbin_headers(text) == [{"kind": "elf", "compressed": True, "arch": "sm_100f",
                                              "code version": "[1,8]", "host": "linux", "compile_size": "64bit"}]


def test_parse_fatbin_headers_does_not_read_resource_lines_as_fields():
    entries = wp.parse_fatbin_headers(RES_USAGE)
    assert not any("REG" in key or "Common" in key for e in entries for key in e)


# --- objdump / symbol versions -----------------------------------------------------------------

def test_required_symbol_versions_keeps_required_glibc_libstdcxx_libgcc_only():
    required = required_symbol_versions(OBJDUMP_T)
    assert ("GLIBC", "2.34", "dlsym") in required
    assert ("GLIBC", "2.32", "__libc_single_threaded") in required
    assert ("GLIBCXX", "3.4.21", "_ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE6appendEPKcm") in required
    assert ("GCC", "3.0", "_Unwind_Resume") in required
    assert ("GLIBC", "2.2.5", "__cxa_finalize") in required  # weak undefined counts too
    assert all(fam in {"GLIBC", "GLIBCXX", "CXXABI", "GCC"} for fam, _, _ in required)
    assert not any(sym.startswith("aoti_") or sym == "__cudaGetKernel" for _, _, sym in required)
    assert not any("variant_name" in sym for _, _, sym in required)  # defined, not required


def test_required_symbol_versions_without_parentheses():
    line = "0000000000000000      DF *UND*  0000000000000000  GLIBC_2.17  clock_gettime\n"
    assert required_symbol_versions(line) == [("GLIBC", "2.17", "clock_gettime")]


def test_version_tuple_orders_numerically():
    assert wp.version_tuple("2.2.5") < wp.version_tuple("2.14") < wp.version_tuple("2.28") < wp.version_tuple("2.34")
    assert wp.version_tuple("3.4.9") < wp.version_tuple("3.4.21") <= wp.version_tuple("3.4.24")
    with pytest.raises(ValueError, match="'PRIVATE'"):
        wp.version_tuple("PRIVATE")


def test_glibc_above_2_28_fails_and_names_the_symbols():
    ok, report = wp.symbol_version_check(required_symbol_versions(OBJDUMP_T), ["GLIBC"])
    assert not ok
    assert report["GLIBC"]["max"] == "2.34"
    assert report["GLIBC"]["offenders"] == {"2.32": ["__libc_single_threaded"], "2.34": ["dlsym"]}


def test_glibc_at_or_below_2_28_passes():
    text = "\n".join(line for line in OBJDUMP_T.splitlines() if "2.32" not in line and "2.34" not in line)
    ok, report = wp.symbol_version_check(required_symbol_versions(text), ["GLIBC"])
    assert ok and report["GLIBC"]["max"] == "2.14"


def test_libstdcxx_reports_the_newest_version_and_its_limit():
    ok, report = wp.symbol_version_check(required_symbol_versions(OBJDUMP_T), ["GLIBCXX", "CXXABI", "GCC"])
    assert ok
    assert report["GLIBCXX"] == {"max": "3.4.21", "limit": "3.4.24", "offenders": {}}
    assert report["CXXABI"]["max"] == "1.3.9"


def test_libstdcxx_too_new_and_non_numeric_versions():
    required = [("GLIBCXX", "3.4.30", "_ZSt28__throw_bad_array_new_lengthv"), ("CXXABI", "TM_1", "x"),
                ("GLIBC", "PRIVATE", "_dl_x")]
    ok, report = wp.symbol_version_check(required, ["GLIBCXX", "CXXABI"])
    assert not ok and report["GLIBCXX"]["offenders"] == {"3.4.30": ["_ZSt28__throw_bad_array_new_lengthv"]}
    assert report["CXXABI"]["offenders"] == {}  # TM_1 is in the manylinux_2_28 policy
    ok, report = wp.symbol_version_check(required, ["GLIBC"])
    assert not ok and "PRIVATE" in report["GLIBC"]["offenders"]


def test_parse_needed():
    assert wp.parse_needed(OBJDUMP_P) == ["libc10.so", "libtorch_cpu.so", "libcudart.so.13", "libstdc++.so.6",
                                          "libc.so.6"]


# --- wheel name, RECORD, fatbin container ------------------------------------------------------

def test_parse_wheel_filename():
    parts = wp.parse_wheel_filename("cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl")
    assert parts == {"name": "cudelta", "version": "0.1.0+cu130", "build": None, "python": "cp310",
                     "abi": "abi3", "platform": "manylinux_2_28_x86_64"}
    with pytest.raises(ValueError, match=r"'cudelta-0.1.0.tar.gz' is not a wheel filename \(name-version-python"):
        wp.parse_wheel_filename("cudelta-0.1.0.tar.gz")


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def test_record_problems():
    files = {"a/x.py": b"x = 1\n", "a/y.json": b"{}"}
    record = "\n".join([_record_line(p, d) for p, d in files.items()] + ["d.dist-info/RECORD,,"]) + "\n"
    files["d.dist-info/RECORD"] = record.encode()
    assert wp.record_problems(files, "d.dist-info/RECORD") == []
    files["a/y.json"] = b'{"archs": []}'
    files["a/z.txt"] = b""
    problems = wp.record_problems(files, "d.dist-info/RECORD")
    assert any("a/y.json: sha256 mismatch" in p for p in problems)
    assert any("a/z.txt: in the wheel, not in RECORD" in p for p in problems)


def test_fatbin_payload_sizes_reads_stored_and_decompressed_sizes():
    def entry(kind, payload, decompressed):
        header = struct.pack("<HHIQ", kind, 0x101, 64, len(payload)) + bytes(40) + struct.pack("<Q", decompressed)
        return header + payload
    body = entry(2, b"\1" * 24, 100) + entry(1, b"\2" * 8, 0)
    blob = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body
    assert wp.fatbin_payload_sizes(bytes(8) + blob) == (2, 32, 108)


def test_wheel_level_checks_on_a_synthetic_wheel(tmp_path):
    """wheel-tag, version-label, metadata, record and build-info need no external tool."""
    version = "0.1.0+cu130"
    release = native.parse_archs(wp.POLICY.RELEASE_ARCHS)  # whatever the policy ships (test_plan.py pins the list)
    info = {"archs": [a.cubin for a in release], "ptx": [a.ptx_name for a in release if a.ptx_name],
            "build": "release", "cuda_toolkit": "13.0", "variant": "cu130", "version": "0.1.0",
            "fatbin_compression": True, "torch_floor": wp.POLICY.TORCH_FLOOR, "python_floor": wp.POLICY.PYTHON_FLOOR}
    files = {
        "cudelta/_C.abi3.so": b"\x7fELF",
        "cudelta/_build_info.json": json.dumps(info).encode(),
        f"cudelta-{version}.dist-info/METADATA": f"Metadata-Version: 2.4\nName: cudelta\nVersion: {version}\n".encode(),
        f"cudelta-{version}.dist-info/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {wp.EXPECTED_TAG}\n".encode(),
    }
    record_name = f"cudelta-{version}.dist-info/RECORD"
    files[record_name] = ("\n".join([_record_line(p, d) for p, d in files.items()] + [f"{record_name},,"]) + "\n").encode()
    wheel = tmp_path / f"cudelta-{version}-{wp.EXPECTED_TAG}.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    checker = WheelChecker(wheel, tmp_path / "unpacked", cuobjdump="/nonexistent")
    for name in ("wheel_tag", "version_label", "metadata", "record", "build_info"):
        ok, detail, _ = getattr(checker, "check_" + name)()
        assert ok, (name, detail)

    checker.info["cuda_toolkit"] = "12.8"
    ok, detail, _ = checker.check_version_label()
    assert not ok and "+cu128" in detail
    checker.info["cuda_toolkit"] = "13.0"
    checker.info["archs"] = ["sm_80", "sm_90a"]
    ok, detail, _ = checker.check_build_info()
    assert not ok and "release archs" in detail


def test_glibc_limit_follows_the_claimed_manylinux_tag():
    required = required_symbol_versions(OBJDUMP_T)
    assert wp.platform_glibc("manylinux_2_34_x86_64") == (2, 34)
    ok, _ = wp.symbol_version_check(required, ["GLIBC"], {"GLIBC": (2, 34)})
    assert ok
    ok, report = wp.symbol_version_check(required, ["GLIBC"], {"GLIBC": (2, 32)})
    assert not ok and report["GLIBC"]["offenders"] == {"2.34": ["dlsym"]}


# --- the release rules added with the glibc 2.28 floor -------------------------------------------

@pytest.mark.parametrize("tag, ok", [
    ("cp310-abi3-manylinux_2_28_x86_64", True), ("cp310-abi3-manylinux_2_28_aarch64", True),
    ("cp310-abi3-manylinux_2_34_x86_64", False), ("cp310-abi3-linux_x86_64", False),
    ("cp311-abi3-manylinux_2_28_x86_64", False)])
def test_a_release_wheel_is_manylinux_2_28_on_either_arch(tag, ok):
    assert bool(wp.EXPECTED_TAG_RE.match(tag)) is ok


OBJDUMP_UNVERSIONED = """\
0000000000000000      DF *UND*\t0000000000000000  Base        aoti_torch_get_data_ptr
0000000000000000      D  *UND*\t0000000000000000  Base        fstat64
0000000000000000  w   D  *UND*\t0000000000000000  Base        __gmon_start__
0000000000000000      DF *UND*\t0000000000000000              PyModule_Create2
0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.2.5) strlen
0000000000012340 g    DF .text\t0000000000000010  Base        PyInit__C
"""


def test_unversioned_required_symbols_exclude_weak_and_versioned_ones():
    assert unversioned_undefined(OBJDUMP_UNVERSIONED) == ["aoti_torch_get_data_ptr", "fstat64", "PyModule_Create2"]
    assert defined_symbols(OBJDUMP_UNVERSIONED) == {"PyInit__C"}


def _checker_with(tmp_path, objdump_output: dict):
    """A WheelChecker over a minimal wheel whose objdump answers are given."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    wheel = tmp_path / f"cudelta-0.1.0+cu130-{wp.EXPECTED_TAG}.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(wp.LIBRARY, b"\x7fELF")
    checker = WheelChecker(wheel, tmp_path / "unpacked", cuobjdump="/nonexistent")
    checker.objdump = lambda option: objdump_output[option]
    return checker


def test_needed_libs_refuse_the_cuda_runtime_and_the_driver(tmp_path):
    needed = "  NEEDED               libc10.so\n  NEEDED               libc.so.6\n"
    ok, detail, _ = _checker_with(tmp_path, {"-p": needed}).check_needed_libs()
    assert ok, detail
    for lib in ("libcudart.so.13", "libcudart.so.12", "libcuda.so.1"):
        ok, detail, _ = _checker_with(tmp_path / lib, {"-p": needed + f"  NEEDED               {lib}\n"}
                                      ).check_needed_libs()
        assert not ok and lib in detail and "statically" in detail
    ok, detail, _ = _checker_with(tmp_path / "x", {"-p": needed + "  NEEDED               libfoo.so\n"}).check_needed_libs()
    assert not ok and "unexpected: libfoo.so" in detail


def test_glibc_binding_names_glibc_symbols_left_without_a_version(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["release.wheel_audits"], "host_glibc_symbols", lambda: {"fstat64", "strlen", "memcpy"})
    ok, detail, data = _checker_with(tmp_path, {"-T": OBJDUMP_UNVERSIONED}).check_glibc_binding()
    assert not ok and data["unbound"] == ["fstat64"] and "fstat64" in detail
    clean = OBJDUMP_UNVERSIONED.replace("fstat64", "torch_new_list_reserve_size")
    ok, detail, _ = _checker_with(tmp_path / "b", {"-T": clean}).check_glibc_binding()
    assert ok, detail


def _auditwheel_report(sym_tag="manylinux_2_24_x86_64", external=("libc10.so", "libtorch_cuda.so"), extra=()):
    eliminate = sorted(set(external) | set(extra))
    return {"overall_tag": "linux_x86_64", "sym_tag": sym_tag, "unsupported_isa": False,
            "external_libs": {lib: None for lib in list(external) + list(extra)},
            "policy_upgrades": {f"manylinux_2_{v}_x86_64": {"libs_to_eliminate": eliminate} for v in (17, 24, 28, 34)}}


def test_auditwheel_grants_the_claim_once_torch_is_excluded():
    problems, granted = wp.auditwheel_verdict(_auditwheel_report(), "manylinux_2_28_x86_64", wp.TORCH_LIBS)
    assert (problems, granted) == ([], "manylinux_2_28_x86_64")


@pytest.mark.parametrize("report, needle", [
    (_auditwheel_report(sym_tag="manylinux_2_34_x86_64"), "symbol versions need manylinux_2_34_x86_64"),
    (_auditwheel_report(extra=("libcudart.so.13",)), "libcudart.so.13"),
    ({**_auditwheel_report(), "unsupported_isa": True}, "ISA"),
])
def test_auditwheel_refuses_what_torch_does_not_explain(report, needle):
    problems, granted = wp.auditwheel_verdict(report, "manylinux_2_28_x86_64", wp.TORCH_LIBS)
    assert problems and needle in "; ".join(problems) and granted != "manylinux_2_28_x86_64"
