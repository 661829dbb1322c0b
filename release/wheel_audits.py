"""The wheel checks of what the library links against (LinkChecks: glibc, glibc-binding, libstdcxx,
needed-libs, from objdump) and those that run external auditors (ToolChecks), mixins of
check_wheel.WheelChecker:

  abi3audit        `abi3audit --strict`: no symbol outside the cp310 limited API
  torch-abi-audit  `torch-abi-audit --check both`: only the torch stable ABI, min torch <= floor
  auditwheel       `auditwheel show --json`: auditwheel grants the tag in the name once torch's
                   libraries are excluded (its own reading of symbol versions and NEEDED)
  twine            `twine check --strict`: the metadata PyPI-style uploaders accept

Each tool is taken from this interpreter's packages, else PATH; a missing tool fails its check.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

from installer.compile.platform_tag import defined_symbols, required_symbol_versions, unversioned_undefined
from installer.detect.toolchain import run_process

from .wheel_parsers import (GLIBC_SONAMES, LIBRARY, MANYLINUX_LIBS, PACKAGE, PYTHON_FLOOR, SYMBOL_VERSION_LIMITS,
                           TOOL_TIMEOUT_S, TORCH_LIBS, ToolMissing, auditwheel_verdict, console_script, dist_version,
                           first_line, parse_needed, platform_glibc, symbol_version_check, version_tuple)


def python_tool(module: str, dist_name: str, script: str) -> list:
    """[python, -m, module] when importable here, else the console script on PATH."""
    if importlib.util.find_spec(module) is not None:
        return [sys.executable, "-m", module]
    cmd = console_script(dist_name, script)
    if cmd is None:
        raise ToolMissing(f"{script} not installed: pip install {dist_name}")
    return cmd


class ToolChecks:
    """Needs self.wheel, self.workdir, self.info, self.name, require_info(), require_library()."""

    def check_abi3audit(self):
        cmd = python_tool("abi3audit", "abi3audit", "abi3audit")
        report_path = self.workdir.parent / "abi3audit.json"
        out = run_process(cmd + ["--strict", "--report", "--output", str(report_path), str(self.wheel)], timeout=TOOL_TIMEOUT_S)
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
        out = run_process(cmd + ["--json", "--check", "both", str(self.workdir / PACKAGE)], timeout=TOOL_TIMEOUT_S)
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

    def check_auditwheel(self):
        cmd = python_tool("auditwheel", "auditwheel", "auditwheel")
        out = run_process(cmd + ["show", "--json", str(self.wheel)], timeout=TOOL_TIMEOUT_S)
        claimed = self.name["platform"]
        try:
            report = json.loads(out.stdout)
        except ValueError:
            return False, f"auditwheel show --json exited {out.returncode}: {first_line(out.stderr + out.stdout)}", {}
        problems, granted = auditwheel_verdict(report, claimed, TORCH_LIBS)
        detail = "; ".join(problems) or (
            f"auditwheel {dist_version('auditwheel')}: {granted} (symbols alone: {report.get('sym_tag')}; "
            f"torch's {', '.join(sorted(report.get('external_libs') or {}))} excluded, as repair --exclude does)")
        return not problems, detail, {"granted": granted, "report": report, "version": dist_version("auditwheel")}

    def check_twine(self):
        cmd = python_tool("twine", "twine", "twine")
        out = run_process(cmd + ["check", "--strict", str(self.wheel)], timeout=TOOL_TIMEOUT_S)
        ok = out.returncode == 0 and "PASSED" in out.stdout
        text = " ".join((out.stdout + out.stderr).split())
        detail = (f"twine {dist_version('twine')} check --strict: PASSED" if ok
                  else f"twine check --strict exited {out.returncode}: {text[-300:]}")
        return ok, detail, {"version": dist_version("twine")}


class LinkChecks:
    """Needs self.objdump(option), self.name, self.require_library()."""

    def check_glibc(self):
        self.require_library()
        required = required_symbol_versions(self.objdump("-T"))
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
        required = required_symbol_versions(self.objdump("-T"))
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

    def check_glibc_binding(self):
        self.require_library()
        unversioned = set(unversioned_undefined(self.objdump("-T")))
        glibc = host_glibc_symbols()
        if not glibc:
            raise ToolMissing("cannot read this host's glibc libraries (ldconfig -p, objdump)")
        unbound = sorted(unversioned & glibc)
        detail = (f"glibc symbols bound to no version (missing from older glibc, the library would not "
                  f"load there): {', '.join(unbound)}" if unbound else
                  f"every required glibc symbol is versioned ({len(unversioned)} unversioned symbols, "
                  "all torch / Python)")
        return not unbound, detail, {"unbound": unbound}

    def check_needed_libs(self):
        self.require_library()
        needed = parse_needed(self.objdump("-p"))
        allowed = MANYLINUX_LIBS | TORCH_LIBS
        cuda = [lib for lib in needed if lib.startswith(("libcudart", "libcuda."))]
        unexpected = [lib for lib in needed if lib not in allowed and lib not in cuda]
        problems = []
        if cuda:
            problems.append(f"{', '.join(cuda)} NEEDED: the CUDA runtime must be linked statically "
                            "(cudart_static, installer/compile/native.py link_libraries) and the driver dlopen'ed")
        if unexpected:
            problems.append(f"unexpected: {', '.join(unexpected)} (allowed: manylinux system libraries, "
                            f"{', '.join(sorted(TORCH_LIBS))})")
        return not problems, "; ".join(problems) or ", ".join(needed), {"needed": needed}


_HOST_GLIBC: Optional[set] = None


def host_glibc_symbols() -> set:
    """Every symbol this host's glibc libraries (and dynamic loader) define, read once. ldconfig -p
    lines read `libc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6`; 32-bit entries have
    no comma in the parentheses and are skipped."""
    global _HOST_GLIBC
    if _HOST_GLIBC is None:
        try:
            listing = run_process(["ldconfig", "-p"], timeout=30).stdout
        except OSError:
            listing = ""
        paths: dict = {}
        for soname, abi, path in re.findall(r"^\s*(\S+) \(([^)]*)\) => (\S+)\s*$", listing, re.M):
            if (soname in GLIBC_SONAMES or soname.startswith("ld-linux")) and "," in abi:
                paths.setdefault(soname, path)
        exe = shutil.which("objdump")
        symbols: set = set()
        for path in paths.values() if exe else ():
            symbols |= defined_symbols(run_process([exe, "-T", path], timeout=60).stdout)
        _HOST_GLIBC = symbols
    return _HOST_GLIBC


def _sort_key(version: str):
    try:
        return (0, version_tuple(version))
    except ValueError:
        return (1, ())
