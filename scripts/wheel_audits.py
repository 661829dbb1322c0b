"""The wheel checks that run external auditors (a mixin of check_wheel.WheelChecker):

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
import sys
from pathlib import Path

from wheel_parsers import (LIBRARY, PACKAGE, PYTHON_FLOOR, TORCH_LIBS, ToolMissing, auditwheel_verdict,
                           console_script, dist_version, first_line, run_tool, version_tuple)


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

    def check_auditwheel(self):
        cmd = python_tool("auditwheel", "auditwheel", "auditwheel")
        out = run_tool(cmd + ["show", "--json", str(self.wheel)])
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
        out = run_tool(cmd + ["check", "--strict", str(self.wheel)])
        ok = out.returncode == 0 and "PASSED" in out.stdout
        text = " ".join((out.stdout + out.stderr).split())
        detail = (f"twine {dist_version('twine')} check --strict: PASSED" if ok
                  else f"twine check --strict exited {out.returncode}: {text[-300:]}")
        return ok, detail, {"version": dist_version("twine")}
