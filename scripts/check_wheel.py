#!/usr/bin/env python3
"""Release check of a built cudelta wheel: `python scripts/check_wheel.py WHEEL [--json OUT]`.

Unpacks the wheel, reads cudelta/_build_info.json and checks that the wheel is what it claims:

  wheel-tag          cp310-abi3-manylinux_2_NN_x86_64 in the name, in WHEEL, an .abi3.so inside
  version-label      the version carries +cuXYZ matching build info's cuda_toolkit
  metadata           METADATA Name/Version and the dist-info folder match the filename
  record             RECORD lists every file with its right sha256 and size
  build-info         a release build: the release archs and PTX, compression on, torch floor
  cubins             cuobjdump --list-elf: every cubin arch of build info, in every module, no other
  cubin-variants     the fatbin headers: the exact variant (sm_100f, not plain sm_100; sm_90a)
  ptx                cuobjdump --list-ptx: the PTX of build info, in every module, no other
  fatbin-compression every fatbin entry is compressed
  abi3audit          `abi3audit --strict` finds no symbol outside the cp310 limited API
  torch-abi-audit    `torch-abi-audit --check both`: only the torch stable ABI; its minimum torch
                     is not above build info's torch_floor
  glibc              every GLIBC symbol version the library needs is <= 2.NN of its manylinux_2_NN tag
  libstdcxx          GLIBCXX / CXXABI / GCC versions within manylinux_2_28 (auditwheel's policy)
  needed-libs        DT_NEEDED: manylinux system libraries, torch's, the CUDA runtime of the toolkit

It prints one row per check (PASS / FAIL; INFO rows never fail) and exits 1 if any check failed.
Tools: cuobjdump (PyPI `nvidia-cuda-cuobjdump`, else PATH, else $CUDA_HOME/bin), objdump
(binutils), and the PyPI packages `abi3audit` and `torch-abi-audit` importable by this interpreter.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from email.parser import HeaderParser
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from installer import native, platform_tag  # noqa: E402  (stdlib only: release archs, floor, ELF versions)

PACKAGE = "cudelta"
LIBRARY = "cudelta/_C.abi3.so"
BUILD_INFO = "cudelta/_build_info.json"
# The platform part is whatever glibc the build host forced (installer/platform_tag.py): 2_28 from a
# manylinux_2_28 image; the glibc check below holds the library to the tag it claims.
EXPECTED_TAG = f"{native.PY_LIMITED_API_TAG}-abi3-manylinux_2_28_x86_64"
EXPECTED_TAG_RE = re.compile(rf"^{native.PY_LIMITED_API_TAG}-abi3-manylinux_2_(\d+)_x86_64$")
PYTHON_FLOOR = "3.10"

# auditwheel's manylinux_2_28 x86_64 policy (src/auditwheel/policy/manylinux-policy.json): the newest
# symbol version of each versioned system library a manylinux_2_28 wheel may require.
SYMBOL_VERSION_LIMITS = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)}
NON_NUMERIC_ALLOWED = {"CXXABI": {"FLOAT128", "TM_1"}}
MANYLINUX_LIBS = {
    "libatomic.so.1", "libgcc_s.so.1", "libstdc++.so.6", "libm.so.6", "libmvec.so.1", "libanl.so.1",
    "libdl.so.2", "librt.so.1", "libc.so.6", "libnsl.so.1", "libutil.so.1", "libpthread.so.0",
    "libresolv.so.2", "libz.so.1", "ld-linux-x86-64.so.2",
}
# Loaded by `import torch` before our library (torch's wheel and its nvidia-cuda-runtime dependency).
TORCH_LIBS = {"libc10.so", "libc10_cuda.so", "libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so"}

CHECK_NAMES = (
    "wheel-tag", "version-label", "metadata", "record", "build-info", "cubins", "cubin-variants", "ptx",
    "fatbin-compression", "abi3audit", "torch-abi-audit", "glibc", "libstdcxx", "needed-libs",
)

PASS, FAIL, INFO = "PASS", "FAIL", "INFO"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    data: dict = field(default_factory=dict)


# --- pure helpers (tests/unit/test_check_wheel.py) ----------------------------------------------

def version_tuple(text: str) -> tuple[int, ...]:
    """'2.2.5' -> (2, 2, 5); raises ValueError for a non-numeric version such as 'PRIVATE'."""
    return tuple(int(part) for part in text.split("."))


def parse_wheel_filename(filename: str) -> dict:
    m = re.fullmatch(r"(?P<name>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?"
                     r"-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl", Path(filename).name)
    if not m:
        raise ValueError(f"{filename!r} is not a wheel filename (name-version-python-abi-platform.whl)")
    return m.groupdict()


def cuda_label(toolkit: str) -> str:
    """'13.0' -> 'cu130': the local version label and build info's variant."""
    major, minor = (int(x) for x in toolkit.split(".")[:2])
    return f"cu{major}{minor}"


def elf_listing_name(cubin: str) -> str:
    """How `cuobjdump --list-elf` names a build-info cubin: nvcc 13 lists the family cubins sm_100f /
    sm_120f as sm_100 / sm_120, and keeps arch-specific names (sm_90a)."""
    m = re.fullmatch(r"sm_(\d+)([af]?)", cubin)
    if not m:
        raise ValueError(f"{cubin!r} is not a cubin arch (sm_80, sm_90a, sm_100f)")
    return f"sm_{m.group(1)}" + ("a" if m.group(2) == "a" else "")


def ptx_listing_name(ptx: str) -> str:
    """How `cuobjdump --list-ptx` (and the fatbin header) names a build-info PTX: compute_120 -> sm_120."""
    m = re.fullmatch(r"compute_(\d+)([af]?)", ptx)
    if not m:
        raise ValueError(f"{ptx!r} is not a PTX arch (compute_120)")
    return f"sm_{m.group(1)}" + ("a" if m.group(2) == "a" else "")


def parse_cuobjdump_list(text: str, kind: str) -> list[tuple[str, str]]:
    """`cuobjdump --list-elf` / `--list-ptx` output -> [(module, arch)] in library order.

    Lines read `ELF file    3: gdn_decode.sm_100.cubin` / `PTX file    1: gdn_decode.sm_120.ptx`; the
    module is the source file's stem when nvcc recorded it (-lineinfo), else `<library>.<index>`
    (`_C.abi3.3.sm_100.cubin`), so the module names cannot be relied on to group entries."""
    label, ext = {"elf": ("ELF", "cubin"), "ptx": ("PTX", "ptx")}[kind]
    found: list[tuple[str, str]] = []
    for line in text.splitlines():
        m = re.match(rf"\s*{label} file\s+\d+:\s+(?P<file>\S+)\s*$", line)
        if not m:
            continue
        parts = m.group("file").rsplit(".", 2)
        if len(parts) != 3 or parts[2] != ext or not re.fullmatch(r"sm_\d+[af]?", parts[1]):
            raise ValueError(f"unexpected cuobjdump --list-{kind} line: {line.strip()!r}")
        found.append((parts[0], parts[1]))
    return found


def coverage(entries: Sequence[str], want: dict[str, str], what: str) -> tuple[list[str], int]:
    """Does every translation unit carry every wanted image? `entries`: the arch name of each fatbin
    entry of one kind (as listed); `want`: {listed name: build-info name}. nvcc puts one image per arch
    in each translation unit's fatbin, so each wanted name must occur equally often (the number of
    modules) and nothing else may occur. Returns (problems, modules)."""
    counts = Counter(entries)
    modules = max(counts.values(), default=0)
    problems = []
    for listed, name in want.items():
        shown = name if listed == name else f"{name} (listed {listed})"
        if counts[listed] == 0:
            problems.append(f"no {what} for {shown}")
        elif counts[listed] < modules:
            problems.append(f"{what} for {shown} in {counts[listed]} of {modules} modules only")
    extra = sorted(set(counts) - set(want))
    if extra:
        problems.append(f"{what}s not in build info: {', '.join(f'{a} x{counts[a]}' for a in extra)}")
    return problems, modules


def parse_fatbin_headers(text: str) -> list[dict]:
    """The per-entry headers cuobjdump prints before a dump (`--dump-resource-usage`, `-elf`, `-ptx`):

        Fatbin elf code:
        ================
        arch = sm_100f
        code version = [1,8]
        host = linux
        compile_size = 64bit
        compressed
        identifier = /src/kernels/gdn_decode.cu

    -> [{"kind": "elf", "arch": "sm_100f", "compressed": True, "identifier": "...", ...}]."""
    entries: list[dict] = []
    current: Optional[dict] = None
    for raw in text.splitlines():
        line = raw.strip()
        m = re.fullmatch(r"Fatbin (elf|ptx) code:", line)
        if m:
            current = {"kind": m.group(1), "compressed": False}
            entries.append(current)
            continue
        if current is None:
            continue
        if not line or line.startswith("="):
            if not line and len(current) > 2:
                current = None  # the header ends at the first blank line after its fields
            continue
        if line == "compressed":
            current["compressed"] = True
        elif " = " in line:
            key, _, value = line.partition(" = ")
            current[key.strip()] = value.strip()
        else:
            current = None
    return entries


# `objdump -T` -> [(family, version, symbol)]: the same reading the release build tags the wheel by.
parse_objdump_versions = platform_tag.required_symbol_versions


def parse_needed(text: str) -> list[str]:
    """`objdump -p` -> the DT_NEEDED sonames."""
    return re.findall(r"^\s*NEEDED\s+(\S+)\s*$", text, re.MULTILINE)


def platform_glibc(platform: str) -> Optional[tuple[int, int]]:
    """manylinux_2_34_x86_64 -> (2, 34)."""
    m = re.match(r"^manylinux_(\d+)_(\d+)_", platform)
    return (int(m.group(1)), int(m.group(2))) if m else None


def symbol_version_check(required: Sequence[tuple[str, str, str]], families: Iterable[str],
                         limits: Optional[dict] = None) -> tuple[bool, dict]:
    """Compare required versions with `limits` (default SYMBOL_VERSION_LIMITS). Returns (ok, {family:
    {max, limit, offenders: {version: [symbols]}}})."""
    limits = {**SYMBOL_VERSION_LIMITS, **(limits or {})}
    report: dict = {}
    ok = True
    for family in families:
        limit = limits[family]
        allowed_names = NON_NUMERIC_ALLOWED.get(family, set())
        versions: dict[str, list[str]] = {}
        for fam, version, symbol in required:
            if fam == family:
                versions.setdefault(version, []).append(symbol)
        offenders = {}
        numeric = []
        for version, symbols in versions.items():
            try:
                numeric.append(version_tuple(version))
                too_new = version_tuple(version) > limit
            except ValueError:
                too_new = version not in allowed_names  # GLIBC_PRIVATE is never acceptable
            if too_new:
                offenders[version] = sorted(set(symbols))
        newest = ".".join(map(str, max(numeric))) if numeric else None
        ok = ok and not offenders
        report[family] = {"max": newest, "limit": ".".join(map(str, limit)), "offenders": offenders}
    return ok, report


def record_problems(files: dict[str, bytes], record_name: str) -> list[str]:
    """RECORD against the wheel's contents: every file listed once with its sha256 and size."""
    problems = []
    rows = list(csv.reader(io.StringIO(files[record_name].decode("utf-8"))))
    listed = {}
    for row in rows:
        if not row:
            continue
        path, digest, size = (row + ["", ""])[:3]
        listed[path] = (digest, size)
        if path == record_name:
            continue
        if path not in files:
            problems.append(f"{path}: in RECORD, not in the wheel")
            continue
        data = files[path]
        algo, _, value = digest.partition("=")
        if algo != "sha256":
            problems.append(f"{path}: hash {digest or '(none)'} is not sha256")
            continue
        actual = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if actual != value:
            problems.append(f"{path}: sha256 mismatch")
        if size != str(len(data)):
            problems.append(f"{path}: size {size} in RECORD, {len(data)} in the wheel")
    for path in files:
        if path not in listed:
            problems.append(f"{path}: in the wheel, not in RECORD")
    return problems


def elf_sections(data: bytes) -> dict[str, tuple[int, int]]:
    """{section name: (offset, size)} of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]
    sections = {}
    for name_off, _type, _flags, _addr, offset, size in headers:
        start = strtab_off + name_off
        name = data[start:data.index(b"\0", start)].decode("ascii", "replace")
        sections[name] = (offset, size)
    return sections


def fatbin_payload_sizes(blob: bytes) -> tuple[int, int, int]:
    """Best effort over the (undocumented) fatbin container in .nv_fatbin: (entries, stored bytes,
    bytes once decompressed). Layout as read by cuobjdump-compatible tools: a 16-byte header
    (magic 0xBA55ED50, version, header size, payload size), then entries of a 16-byte prefix (kind,
    version, header size, payload size) whose header holds the decompressed size at byte 56."""
    entries = stored = expanded = 0
    pos = 0
    while pos + 16 <= len(blob):
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", blob, pos)
        if magic != 0xBA55ED50:
            pos += 8  # containers are 8-byte aligned
            continue
        entry, end = pos + header_size, pos + header_size + fat_size
        while entry + 64 <= end:
            _kind, _ver, entry_header, payload = struct.unpack_from("<HHIQ", blob, entry)
            decompressed, = struct.unpack_from("<Q", blob, entry + 56)
            entries += 1
            stored += payload
            expanded += decompressed or payload
            entry += entry_header + payload
        pos = end
    return entries, stored, expanded


# --- tools --------------------------------------------------------------------------------------

def find_cuobjdump(explicit: Optional[str] = None) -> Optional[str]:
    """The PyPI package's binary (located through its installed file list), else PATH, else the toolkit."""
    if explicit:
        return explicit
    for dist_name in ("nvidia-cuda-cuobjdump",):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for entry in dist.files or ():
            if entry.name == "cuobjdump" and entry.parent.name == "bin":
                path = Path(str(dist.locate_file(entry)))
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "cuobjdump").is_file():
            return str(Path(root) / "bin" / "cuobjdump")
    return None


def console_script(dist_name: str, script: str) -> Optional[list[str]]:
    """Run a package's console script with this interpreter (its entry point), else from PATH."""
    try:
        eps = importlib.metadata.distribution(dist_name).entry_points
        ep = next(e for e in eps if e.group == "console_scripts" and e.name == script)
        module, _, attr = ep.value.partition(":")
        return [sys.executable, "-c", f"import sys; from {module} import {attr} as main; sys.exit(main())"]
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        found = shutil.which(script)
        return [found] if found else None


def dist_version(dist_name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_tool(cmd: Sequence[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


def first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class ToolMissing(Exception):
    pass


# --- the checks ---------------------------------------------------------------------------------

class WheelChecker:
    def __init__(self, wheel: Path, workdir: Path, cuobjdump: Optional[str] = None):
        self.wheel = wheel
        self.workdir = workdir
        self.cuobjdump = find_cuobjdump(cuobjdump)
        with zipfile.ZipFile(wheel) as zf:
            self.files = {info.filename: zf.read(info) for info in zf.infolist() if not info.is_dir()}
            zf.extractall(workdir)
        self.lib_path = workdir / LIBRARY
        self.name = parse_wheel_filename(wheel.name)
        self.info_problem = f"{BUILD_INFO} is missing from the wheel"
        try:
            self.info: dict = json.loads(self.files[BUILD_INFO])
        except KeyError:
            self.info = {}
        except ValueError as exc:
            self.info, self.info_problem = {}, f"{BUILD_INFO} is not JSON: {exc}"
        self._cache: dict[str, str] = {}

    # tools, run once each
    def cuobj(self, option: str) -> str:
        if option not in self._cache:
            if not self.cuobjdump:
                raise ToolMissing("cuobjdump not found: pip install nvidia-cuda-cuobjdump (or put the CUDA "
                                  "toolkit's bin on PATH)")
            out = run_tool([self.cuobjdump, option, str(self.lib_path)])
            if out.returncode != 0:
                raise RuntimeError(f"cuobjdump {option} exited {out.returncode}: {first_line(out.stderr + out.stdout)}")
            self._cache[option] = out.stdout
        return self._cache[option]

    def objdump(self, option: str) -> str:
        key = "objdump" + option
        if key not in self._cache:
            exe = shutil.which("objdump")
            if not exe:
                raise ToolMissing("objdump not found: install binutils")
            out = run_tool([exe, option, str(self.lib_path)])
            if out.returncode != 0:
                raise RuntimeError(f"objdump {option} exited {out.returncode}: {first_line(out.stderr)}")
            self._cache[key] = out.stdout
        return self._cache[key]

    def require_library(self) -> None:
        if LIBRARY not in self.files:
            raise RuntimeError(f"{LIBRARY} is not in the wheel")

    def require_info(self, *keys: str) -> None:
        if not self.info:
            raise RuntimeError(self.info_problem)
        missing = [k for k in keys if k not in self.info]
        if missing:
            raise RuntimeError(f"{BUILD_INFO} lacks {', '.join(missing)}")

    # each returns (ok, detail, data)
    def check_wheel_tag(self):
        tag = f"{self.name['python']}-{self.name['abi']}-{self.name['platform']}"
        problems = []
        if not EXPECTED_TAG_RE.match(tag):
            problems.append(f"filename tag {tag}, expected {EXPECTED_TAG_RE.pattern}")
        wheel_meta = self._dist_info_file("WHEEL")
        tags = re.findall(r"^Tag:\s*(\S+)\s*$", wheel_meta, re.MULTILINE)
        if tags != [tag]:
            problems.append(f"WHEEL Tag {tags}, expected [{tag}] as in the filename")
        if not re.search(r"^Root-Is-Purelib:\s*false\s*$", wheel_meta, re.MULTILINE):
            problems.append("WHEEL Root-Is-Purelib is not false")
        libs = sorted(p for p in self.files if p.endswith(".so"))
        if libs != [LIBRARY]:
            problems.append(f"shared libraries {libs}, expected [{LIBRARY}]")
        return not problems, "; ".join(problems) or f"{tag} (filename and WHEEL), {LIBRARY}", {"tag": tag}

    def check_version_label(self):
        self.require_info("cuda_toolkit", "variant", "version")
        version = self.name["version"]
        m = re.fullmatch(r"(?P<public>[0-9][^+]*)\+(?P<label>cu\d+)", version)
        expected = cuda_label(self.info["cuda_toolkit"])
        problems = []
        if not m:
            problems.append(f"version {version} has no +cuXYZ local label")
        else:
            if m.group("label") != expected:
                problems.append(f"label +{m.group('label')}, but build info's cuda_toolkit "
                                f"{self.info['cuda_toolkit']} means +{expected}")
            if self.info["version"] != m.group("public"):
                problems.append(f"build info version {self.info['version']} != {m.group('public')}")
        if self.info["variant"] != expected:
            problems.append(f"build info variant {self.info['variant']} != {expected}")
        detail = "; ".join(problems) or f"{version}: +{expected} = CUDA {self.info['cuda_toolkit']}"
        return not problems, detail, {"version": version, "label": expected}

    def check_metadata(self):
        version = self.name["version"]
        dist_infos = sorted({p.split("/")[0] for p in self.files if p.split("/")[0].endswith(".dist-info")})
        expected_dir = f"{self.name['name']}-{version}.dist-info"
        problems = []
        if dist_infos != [expected_dir]:
            problems.append(f"dist-info folders {dist_infos}, expected [{expected_dir}]")
        meta = HeaderParser().parsestr(self._dist_info_file("METADATA"))
        if meta.get("Name", "").lower() != PACKAGE:
            problems.append(f"METADATA Name {meta.get('Name')!r}")
        if meta.get("Version") != version:
            problems.append(f"METADATA Version {meta.get('Version')!r} != filename version {version!r}")
        detail = "; ".join(problems) or f"METADATA Version {meta.get('Version')} = filename, {expected_dir}"
        return not problems, detail, {"metadata_version": meta.get("Version")}

    def check_record(self):
        problems = record_problems(self.files, self._dist_info_path("RECORD"))
        detail = "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
        return not problems, detail or f"{len(self.files) - 1} files, sha256 and sizes match", {"problems": problems}

    def check_build_info(self):
        self.require_info("archs", "ptx", "build", "fatbin_compression", "torch_floor", "python_floor")
        release = native.parse_archs(native.RELEASE_ARCHS)
        want_archs = [a.cubin for a in release]
        want_ptx = [a.ptx_name for a in release if a.ptx_name]
        problems = []
        if self.info["build"] != "release":
            problems.append(f"build {self.info['build']!r}, expected 'release' (CUDELTA_RELEASE_BUILD=1)")
        if list(self.info["archs"]) != want_archs:
            problems.append(f"archs {self.info['archs']} != release archs {want_archs} "
                            "(is CUDELTA_CUDA_ARCHS / TORCH_CUDA_ARCH_LIST set in the release job?)")
        if list(self.info["ptx"]) != want_ptx:
            problems.append(f"ptx {self.info['ptx']} != release {want_ptx}")
        if self.info["fatbin_compression"] is not True:
            problems.append("fatbin_compression is not true")
        if self.info["torch_floor"] != native.TORCH_FLOOR:
            problems.append(f"torch_floor {self.info['torch_floor']} != {native.TORCH_FLOOR}")
        if self.info["python_floor"] != PYTHON_FLOOR:
            problems.append(f"python_floor {self.info['python_floor']} != {PYTHON_FLOOR}")
        detail = "; ".join(problems) or (
            f"release: {', '.join(want_archs + want_ptx)}; torch >= {self.info['torch_floor']}, "
            f"built with torch {self.info.get('torch_built_with')}, nvcc {self.info.get('cuda_toolkit')}, "
            f"git {self.info.get('git_revision')}")
        return not problems, detail, {}

    def check_cubins(self):
        self.require_info("archs")
        self.require_library()
        listed = parse_cuobjdump_list(self.cuobj("--list-elf"), "elf")
        want = {elf_listing_name(a): a for a in self.info["archs"]}
        # Normalised both ways: a cuobjdump that lists family cubins as sm_100f still matches; the
        # exact variant is cubin-variants' job.
        problems, modules = coverage([elf_listing_name(arch) for _, arch in listed], want, "cubin")
        shown = ", ".join(a if elf_listing_name(a) == a else f"{a} (listed {elf_listing_name(a)})"
                          for a in self.info["archs"])
        detail = "; ".join(problems) or f"{shown} in each of {modules} modules{_module_names(listed, modules)}"
        return not problems, detail, {"listed": [f"{m}.{a}" for m, a in listed]}

    def check_cubin_variants(self):
        self.require_info("archs")
        self.require_library()
        headers = [h for h in parse_fatbin_headers(self.cuobj("--dump-resource-usage")) if h["kind"] == "elf"]
        arches = [h.get("arch", "?") for h in headers]
        problems, modules = coverage(arches, {a: a for a in self.info["archs"]}, "cubin")
        detail = "; ".join(problems) or f"{', '.join(self.info['archs'])} exactly, in each of {modules} modules"
        return not problems, detail, {"headers": arches}

    def check_ptx(self):
        self.require_info("ptx")
        self.require_library()
        listed = parse_cuobjdump_list(self.cuobj("--list-ptx"), "ptx")
        want = {ptx_listing_name(p): p for p in self.info["ptx"]}
        problems, modules = coverage([elf_listing_name(arch) for _, arch in listed], want, "PTX")
        shown = ", ".join(f"{p} (listed {ptx_listing_name(p)}.ptx)" for p in self.info["ptx"]) or "none"
        detail = "; ".join(problems) or (f"{shown} in each of {modules} modules{_module_names(listed, modules)}" if want else "no PTX, none claimed")
        return not problems, detail, {"listed": [f"{m}.{a}" for m, a in listed]}

    def check_fatbin_compression(self):
        self.require_library()
        headers = parse_fatbin_headers(self.cuobj("--dump-resource-usage"))
        plain = [f"{Path(h.get('identifier', '?')).name}:{h['kind']}:{h.get('arch', '?')}"
                 for h in headers if not h["compressed"]]
        data = self._fatbin_sizes()
        sizes = ""
        if data.get("nv_fatbin_bytes"):
            sizes = f"; .nv_fatbin {data['nv_fatbin_bytes']:,} B"
            if data.get("device_code_bytes"):
                sizes += f" holding {data['device_code_bytes']:,} B of device code"
        ok = bool(headers) and not plain
        if not headers:
            detail = "cuobjdump printed no fatbin headers"
        elif plain:
            detail = f"{len(plain)}/{len(headers)} entries not compressed: {', '.join(plain)}{sizes}"
        else:
            detail = f"{len(headers)}/{len(headers)} fatbin entries compressed{sizes}"
        return ok, detail, data

    def check_abi3audit(self):
        if importlib.util.find_spec("abi3audit") is not None:
            cmd = [sys.executable, "-m", "abi3audit"]
        elif shutil.which("abi3audit"):
            cmd = [shutil.which("abi3audit")]
        else:
            raise ToolMissing("abi3audit not installed: pip install abi3audit")
        report_path = self.workdir.parent / "abi3audit.json"
        out = run_tool(cmd + ["--strict", "--report", "--output", str(report_path), str(self.wheel)])
        problems = []
        results = []
        if out.returncode != 0:
            problems.append(f"abi3audit exited {out.returncode}: {first_line(out.stderr + out.stdout)}")
        try:
            report = json.loads(report_path.read_text())
            for spec in report.get("specs", {}).values():
                results += spec.get("wheel", [])
        except (OSError, ValueError) as exc:
            problems.append(f"no JSON report ({exc})")
        if not results and not problems:
            problems.append("abi3audit scanned no extension")
        baseline = version_tuple(PYTHON_FLOOR)
        for item in results:
            res = item.get("result", {})
            if not res.get("is_abi3"):
                problems.append(f"{item.get('name')}: not abi3")
            if res.get("non_abi3_symbols"):
                problems.append(f"{item.get('name')}: symbols outside the limited API: "
                                f"{', '.join(map(str, res['non_abi3_symbols'][:10]))}")
            computed = res.get("computed")
            if computed and version_tuple(str(computed)) > baseline:
                problems.append(f"{item.get('name')}: needs the limited API of {computed} > {PYTHON_FLOOR}")
        names = ", ".join(f"{i.get('name')} (abi3, limited API {i.get('result', {}).get('computed')})"
                          for i in results)
        detail = "; ".join(problems) or f"{names}: no violations (--strict)"
        return not problems, detail, {"results": results, "version": dist_version("abi3audit")}

    def check_torch_abi_audit(self):
        self.require_info("torch_floor")
        self.require_library()
        cmd = console_script("torch-abi-audit", "torch-abi-audit")
        if cmd is None:
            raise ToolMissing("torch-abi-audit not installed: pip install torch-abi-audit")
        out = run_tool(cmd + ["--json", "--check", "both", str(self.workdir / PACKAGE)])
        problems = []
        libs: list[dict] = []
        if out.returncode != 0:
            problems.append(f"torch-abi-audit --check both exited {out.returncode}: "
                            f"{first_line(out.stderr) or first_line(out.stdout)}")
        try:
            report = json.loads(out.stdout)
            libs = list(report.get("extensions", [])) + list(report.get("bundled_libs", []))
            if report.get("error"):
                problems.append(f"error: {report['error']}")
        except ValueError:
            problems.append("torch-abi-audit printed no JSON")
        ours = [lib for lib in libs if Path(lib.get("path", "")).name == Path(LIBRARY).name]
        if not ours and not problems:
            problems.append(f"torch-abi-audit did not inspect {LIBRARY}")
        floor = version_tuple(self.info["torch_floor"])
        summary = []
        for lib in libs:
            torch_info = lib.get("torch", {})
            name = Path(lib.get("path", "?")).name
            if lib.get("error"):
                problems.append(f"{name}: {lib['error']}")
            if torch_info.get("uses_torch") and not torch_info.get("stable"):
                problems.append(f"{name}: unstable torch symbols: "
                                f"{', '.join(torch_info.get('unstable_symbols', [])[:10])}")
            if lib in ours and not torch_info.get("uses_torch"):
                problems.append(f"{name}: references no torch symbol at all")
            min_torch = torch_info.get("min_torch_version")
            if min_torch and version_tuple(min_torch)[:len(floor)] > floor:
                problems.append(f"{name}: needs torch {min_torch} (defined by "
                                f"{', '.join(torch_info.get('version_defining_symbols', [])[:6])}), "
                                f"above build info's torch_floor {self.info['torch_floor']}")
            if torch_info.get("unknown_shim_symbols"):
                problems.append(f"{name}: shim symbols unknown to torch-abi-audit: "
                                f"{', '.join(torch_info['unknown_shim_symbols'][:10])}")
            summary.append(f"{name}: stable ABI, {torch_info.get('stable_shim_count')} shim symbols, "
                           f"{len(torch_info.get('unstable_symbols', []))} unstable, min torch {min_torch} "
                           f"<= floor {self.info['torch_floor']}")
        detail = "; ".join(problems) or "; ".join(summary)
        return not problems, detail, {"libs": libs, "version": dist_version("torch-abi-audit")}

    def check_glibc(self):
        self.require_library()
        required = parse_objdump_versions(self.objdump("-T"))
        claimed = platform_glibc(self.name["platform"]) or SYMBOL_VERSION_LIMITS["GLIBC"]
        ok, report = symbol_version_check(required, ["GLIBC"], {"GLIBC": claimed})
        glibc = report["GLIBC"]
        if ok:
            detail = f"max GLIBC_{glibc['max']} <= {glibc['limit']} claimed by {self.name['platform']}"
        else:
            detail = (f"needs glibc newer than {glibc['limit']} ({self.name['platform']} is not honest): "
                      + ", ".join(f"GLIBC_{v} ({', '.join(s)})"
                                  for v, s in sorted(glibc["offenders"].items(), key=lambda kv: _sort_key(kv[0]),
                                                     reverse=True)))
        return ok, detail, report

    def check_libstdcxx(self):
        self.require_library()
        required = parse_objdump_versions(self.objdump("-T"))
        families = ["GLIBCXX", "CXXABI", "GCC"]
        ok, report = symbol_version_check(required, families)
        parts = []
        for family in families:
            r = report[family]
            if r["offenders"]:
                parts.append(f"{family} > {r['limit']}: " + ", ".join(
                    f"{family}_{v} ({', '.join(s[:3])})" for v, s in sorted(r["offenders"].items())))
            else:
                parts.append(f"max {family}_{r['max']} <= {r['limit']}" if r["max"] else f"no {family}")
        return ok, "; ".join(parts), report

    def check_needed_libs(self):
        self.require_info("cuda_toolkit")
        self.require_library()
        needed = parse_needed(self.objdump("-p"))
        cudart = f"libcudart.so.{self.info['cuda_toolkit'].split('.')[0]}"
        allowed = MANYLINUX_LIBS | TORCH_LIBS | {cudart, "libcuda.so.1"}
        unexpected = [lib for lib in needed if lib not in allowed]
        detail = (f"unexpected: {', '.join(unexpected)} (allowed: manylinux system libraries, "
                  f"{', '.join(sorted(TORCH_LIBS))}, {cudart})" if unexpected else ", ".join(needed))
        return not unexpected, detail, {"needed": needed}

    # helpers
    def _dist_info_path(self, name: str) -> str:
        matches = [p for p in self.files if re.fullmatch(r"[^/]+\.dist-info/" + re.escape(name), p)]
        if len(matches) != 1:
            raise RuntimeError(f"expected one *.dist-info/{name}, found {matches}")
        return matches[0]

    def _dist_info_file(self, name: str) -> str:
        return self.files[self._dist_info_path(name)].decode("utf-8")

    def _fatbin_sizes(self) -> dict:
        data = self.files.get(LIBRARY, b"")
        try:
            sections = elf_sections(data)
        except (ValueError, struct.error):
            return {}
        out: dict = {"debug_bytes": sum(size for name, (_, size) in sections.items() if name.startswith(".debug_"))}
        if ".nv_fatbin" in sections:
            offset, size = sections[".nv_fatbin"]
            out["nv_fatbin_bytes"] = size
            try:
                entries, stored, expanded = fatbin_payload_sizes(data[offset:offset + size])
                if entries:
                    out.update(fatbin_entries=entries, device_code_stored_bytes=stored, device_code_bytes=expanded)
            except struct.error:
                pass
        return out

    def sizes(self) -> Check:
        data = {"wheel_bytes": self.wheel.stat().st_size, "library_bytes": len(self.files.get(LIBRARY, b""))}
        data.update(self._fatbin_sizes())
        parts = [f"wheel {data['wheel_bytes']:,} B", f"{Path(LIBRARY).name} {data['library_bytes']:,} B"]
        if "nv_fatbin_bytes" in data:
            parts.append(f".nv_fatbin {data['nv_fatbin_bytes']:,} B")
        if data.get("debug_bytes"):
            parts.append(f"host .debug_* {data['debug_bytes']:,} B")
        return Check("sizes", INFO, ", ".join(parts), data)

    def run(self) -> list[Check]:
        checks = []
        for name in CHECK_NAMES:
            method: Callable = getattr(self, "check_" + name.replace("-", "_"))
            try:
                ok, detail, data = method()
                checks.append(Check(name, PASS if ok else FAIL, detail, data))
            except ToolMissing as exc:
                checks.append(Check(name, FAIL, f"tool missing: {exc}"))
            except Exception as exc:  # a check that cannot run is a failed check, never a skipped one
                checks.append(Check(name, FAIL, f"error: {type(exc).__name__}: {exc}"))
        checks.append(self.sizes())
        return checks

    def tools(self) -> dict:
        cuobjdump_version = None
        if self.cuobjdump:
            try:
                out = run_tool([self.cuobjdump, "--version"], timeout=30)
                m = re.search(r"release [\d.]+, V([\d.]+)", out.stdout)
                cuobjdump_version = m.group(1) if m else first_line(out.stdout)
            except (OSError, subprocess.SubprocessError):
                pass
        return {"cuobjdump": self.cuobjdump, "cuobjdump_version": cuobjdump_version,
                "objdump": shutil.which("objdump"), "abi3audit": dist_version("abi3audit"),
                "torch-abi-audit": dist_version("torch-abi-audit"), "python": sys.executable}


def _module_names(listed: Sequence[tuple[str, str]], modules: int) -> str:
    """' (gdn_decode, probe)' where cuobjdump could name the modules, else ''."""
    names = list(dict.fromkeys(module for module, _ in listed))
    return f" ({', '.join(names)})" if len(names) == modules else ""


def _sort_key(version: str):
    try:
        return (0, version_tuple(version))
    except ValueError:
        return (1, ())


def check_wheel(wheel: Path, cuobjdump: Optional[str] = None) -> tuple[list[Check], dict]:
    """Run every check on `wheel`; returns (checks, tools used)."""
    with tempfile.TemporaryDirectory(prefix="check-wheel-") as tmp:
        checker = WheelChecker(Path(wheel), Path(tmp) / "unpacked", cuobjdump=cuobjdump)
        return checker.run(), checker.tools()


def format_table(checks: Sequence[Check]) -> str:
    name_w = max(len(c.name) for c in checks)
    lines = [f"{'check':<{name_w}}  status  detail", f"{'-' * name_w}  ------  {'-' * 6}"]
    for c in checks:
        lines.append(f"{c.name:<{name_w}}  {c.status:<6}  {c.detail}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Release checks of a built cudelta wheel.")
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument("--cuobjdump", metavar="PATH", help="cuobjdump to use (default: the nvidia-cuda-cuobjdump "
                                                              "package, else PATH, else $CUDA_HOME/bin)")
    args = parser.parse_args(argv)
    if not args.wheel.is_file() or not zipfile.is_zipfile(args.wheel):
        print(f"error: {args.wheel} is not a wheel file", file=sys.stderr)
        return 2
    try:
        checks, tools = check_wheel(args.wheel, cuobjdump=args.cuobjdump)
    except (ValueError, zipfile.BadZipFile) as exc:
        print(f"error: {args.wheel}: {exc}", file=sys.stderr)
        return 2
    failed = [c.name for c in checks if c.status == FAIL]
    print(f"wheel: {args.wheel.name}")
    print(f"tools: cuobjdump {tools['cuobjdump_version']} ({tools['cuobjdump']}), abi3audit {tools['abi3audit']}, "
          f"torch-abi-audit {tools['torch-abi-audit']}, objdump {tools['objdump']}")
    print(format_table(checks))
    print(f"\n{len(checks) - len(failed) - sum(c.status == INFO for c in checks)} passed, {len(failed)} failed"
          + (f": {', '.join(failed)}" if failed else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"wheel": str(args.wheel), "passed": not failed, "failed": failed,
                                         "tools": tools, "checks": [asdict(c) for c in checks]},
                                        indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
