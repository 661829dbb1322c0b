"""The pure parts of the wheel checks (release/check_wheel.py): constants, tool-output parsers,
ELF and RECORD readers, and how the external tools are found and run. No check lives here.

Tested on sample tool output by tests/unit/test_check_wheel.py, which imports them from here.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import io
import os
import re
import shutil
import struct
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from installer.compile import native, platform_tag
from installer.core import cuda, shipped

from .matrix import ARCHS

PACKAGE = "cudelta"
LIBRARY = "cudelta/_C.abi3.so"
BUILD_INFO = "cudelta/_build_info.json"
# A release asset claims the manylinux_2_28 tag (installer/compile/platform_tag.py release_platform), on either
# arch: the build links against glibc 2.28 (installer/compile/glibc_floor.py), and the glibc check holds the
# library to the tag it claims.
EXPECTED_TAG = f"{native.PY_LIMITED_API_TAG}-abi3-{platform_tag.release_platform('x86_64')}"
EXPECTED_TAG_RE = re.compile(rf"^{native.PY_LIMITED_API_TAG}-abi3-("
                             + "|".join(re.escape(platform_tag.release_platform(arch)) for arch in ARCHS) + ")$")
# An auditor on a fat binary takes minutes on a slow runner; the installer's probes take seconds.
TOOL_TIMEOUT_S = 300
POLICY = shipped.load("_release_policy")  # release archs and floors
PYTHON_FLOOR = POLICY.PYTHON_FLOOR

# auditwheel's manylinux_2_28 x86_64 policy (src/auditwheel/policy/manylinux-policy.json): the newest
# symbol version of each versioned system library a manylinux_2_28 wheel may require.
SYMBOL_VERSION_LIMITS = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)}
NON_NUMERIC_ALLOWED = {"CXXABI": {"FLOAT128", "TM_1"}}
MANYLINUX_LIBS = {
    "libatomic.so.1", "libgcc_s.so.1", "libstdc++.so.6", "libm.so.6", "libmvec.so.1", "libanl.so.1",
    "libdl.so.2", "librt.so.1", "libc.so.6", "libnsl.so.1", "libutil.so.1", "libpthread.so.0",
    "libresolv.so.2", "libz.so.1", "ld-linux-x86-64.so.2",
}
# Loaded by `import torch` before our library (torch's own libraries). The CUDA runtime is linked
# statically (installer/compile/native.py) and finds the driver itself: neither libcudart nor libcuda may
# be NEEDED, so one wheel loads under a CUDA 12 or 13 build of torch alike.
TORCH_LIBS = {"libc10.so", "libc10_cuda.so", "libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so"}

CHECK_NAMES = (
    "wheel-tag", "version-label", "metadata", "record", "build-info", "cubins", "cubin-variants", "ptx",
    "fatbin-compression", "abi3audit", "torch-abi-audit", "glibc", "glibc-binding", "libstdcxx", "needed-libs",
    "auditwheel", "twine",
)
# Where the host's glibc libraries are looked up for the glibc-binding check.
GLIBC_SONAMES = ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1")

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


def elf_listing_name(cubin: str) -> str:
    """How `cuobjdump --list-elf` names a build-info cubin: nvcc 13 lists the family cubins sm_100f /
    sm_120f as sm_100 / sm_120, and keeps arch-specific names (sm_90a)."""
    if not cuda.is_cubin(cubin):
        raise ValueError(f"{cubin!r} is not a cubin arch (sm_80, sm_90a, sm_100f)")
    return _listing_name(cuda.CodeArch.parse(cubin))


def ptx_listing_name(ptx: str) -> str:
    """How `cuobjdump --list-ptx` (and the fatbin header) names a build-info PTX: compute_120 -> sm_120."""
    if not cuda.is_ptx(ptx):
        raise ValueError(f"{ptx!r} is not a PTX arch (compute_120)")
    return _listing_name(cuda.CodeArch.parse(ptx))


def _listing_name(arch: "cuda.CodeArch") -> str:
    return str(cuda.CodeArch("sm", arch.major, arch.minor, "a" if arch.suffix == "a" else ""))


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


def parse_needed(text: str) -> list[str]:
    """`objdump -p` -> the DT_NEEDED sonames."""
    return re.findall(r"^\s*NEEDED\s+(\S+)\s*$", text, re.MULTILINE)


def auditwheel_verdict(report: dict, claimed: str, excluded: Iterable[str]) -> tuple[list[str], str]:
    """Judge `auditwheel show --json` against the platform tag the wheel claims. Returns (problems,
    the tag auditwheel grants).

    auditwheel's overall tag for any torch extension is linux_*: it counts torch's libraries (not
    on any manylinux whitelist) as external, which is why the release's `auditwheel repair`
    excludes them (they come from the user's torch). So the tag auditwheel grants is the claimed
    policy when (1) the symbol versions allow it (`sym_tag` at or below the claim: glibc *and*
    libstdc++/libgcc versions), (2) the only libraries that policy would need eliminated are the
    excluded ones, (3) no other library is external, and (4) no unsupported ISA extension is used."""
    problems = []
    sym_tag = report.get("sym_tag") or "?"
    claimed_glibc, sym_glibc = platform_glibc(claimed), platform_glibc(sym_tag)
    excluded = set(excluded)
    if sym_glibc is None or claimed_glibc is None or sym_glibc > claimed_glibc:
        problems.append(f"symbol versions need {sym_tag}, above the claimed {claimed}")
    policy = (report.get("policy_upgrades") or {}).get(claimed)
    if policy is None and report.get("overall_tag") != claimed:
        problems.append(f"auditwheel knows no way to {claimed} (overall {report.get('overall_tag')})")
    elif policy is not None:
        extra = sorted(set(policy.get("libs_to_eliminate", [])) - excluded)
        if extra:
            problems.append(f"{claimed} needs {', '.join(extra)} eliminated (not torch's)")
    external = sorted(set(report.get("external_libs") or {}) - excluded)
    if external:
        problems.append(f"external libraries beyond torch's: {', '.join(external)}")
    if report.get("unsupported_isa"):
        problems.append("uses an ISA extension the manylinux policy does not allow")
    return problems, (sym_tag if problems else claimed)


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


def first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class ToolMissing(Exception):
    pass
