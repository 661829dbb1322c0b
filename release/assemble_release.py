#!/usr/bin/env python3
"""The release fan-in: `python -m release.assemble_release --version 0.1.0 --out DIR WHEEL...`

After every cell's wheel is built and checked:

1. release/make_release.py: the wheels, manifest.json, SHA256SUMS and the whl/<cuXYZ>/ indexes;
2. the sdist, built only now, with CUDELTA_RELEASE_MANIFEST=DIR/manifest.json, so that it carries
   that manifest as installer/release_manifest.json (installer/commands.py): the installs verify a
   downloaded wheel against what PyPI served, not against anything the download host says;
3. checks the sdist: its version, the embedded manifest equal to DIR/manifest.json, nothing from a
   developer's tree (build/, dist/, *.so), `twine check --strict`;
4. adds the sdist to SHA256SUMS.

release.yml's fan-in job and release/dry_run.py both run this. Options: --python PY builds the
sdist (needs setuptools, wheel and `build`; default this interpreter), --src DIR (default: this
repository, copied as a checkout would be, by release/build_cell.py's rules).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

from installer.choose.manifest import loads_manifest
from installer.fetch.verify import sha256_file

from . import build_cell, make_release

ROOT = Path(__file__).resolve().parent.parent

EMBEDDED = "installer/release_manifest.json"
# Build leftovers, and the release tooling and shell scripts, which never ship (MANIFEST.in grafts
# installer/, csrc/ and kernels/ only; pyproject.toml packages cudelta/ only).
FORBIDDEN_IN_SDIST = ("/build/", "/dist/", ".so", ".whl", "/.git/", "__pycache__", "/release/", "/scripts/")


class AssembleError(Exception):
    pass


def build_sdist(manifest: Path, out: Path, python: str, src: Path) -> Path:
    """The sdist of `src` with `manifest` embedded, written into `out`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDELTA_") and k != "PYTHONPATH"}
    env["CUDELTA_RELEASE_MANIFEST"] = str(manifest.resolve())
    with tempfile.TemporaryDirectory(prefix="cudelta-sdist-") as tmp:
        tree, dist = Path(tmp) / "src", Path(tmp) / "dist"
        build_cell.copy_tree(src, tree)
        (tree / EMBEDDED).unlink(missing_ok=True)  # only the named manifest may end up inside
        proc = subprocess.run([python, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist), str(tree)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise AssembleError(f"python -m build --sdist failed (exit {proc.returncode}):\n"
                                f"{(proc.stdout + proc.stderr)[-3000:]}")
        (sdist,) = dist.glob("*.tar.gz")
        dst = out / sdist.name
        sdist.replace(dst)
        return dst


def check_sdist(sdist: Path, manifest: Path, version: str) -> List[str]:
    """What is wrong with the sdist as a release asset (empty: nothing)."""
    problems = []
    expected_root = f"cudelta-{version}"
    if sdist.name != f"{expected_root}.tar.gz":
        problems.append(f"{sdist.name} is not {expected_root}.tar.gz")
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
        member = f"{expected_root}/{EMBEDDED}"
        if member not in names:
            problems.append(f"no {EMBEDDED} inside: the sdist would trust a downloaded manifest "
                            "(is CUDELTA_RELEASE_MANIFEST honoured by installer/commands.py sdist?)")
        else:
            embedded = loads_manifest(tf.extractfile(member).read().decode("utf-8"))
            if embedded != loads_manifest(manifest.read_text()):
                problems.append(f"{EMBEDDED} differs from {manifest}")
    stray = [n for n in names if any(bad in f"/{n}" for bad in FORBIDDEN_IN_SDIST)]
    if stray:
        problems.append(f"build leftovers or release tooling inside: {', '.join(stray[:5])}")
    twine = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(sdist)],
                           capture_output=True, text=True)
    if twine.returncode != 0 or "PASSED" not in twine.stdout:
        problems.append(f"twine check --strict: {' '.join((twine.stdout + twine.stderr).split())[-300:]}")
    return problems


def add_to_sums(out: Path, paths: Sequence[Path]) -> None:
    """Add `paths` (files in `out`) to out/SHA256SUMS, keeping it sorted by name."""
    sums = out / make_release.SUMS_NAME
    entries = {}
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        entries[name] = digest
    for path in paths:
        entries[path.name] = sha256_file(path)
    sums.write_text(make_release.sha256sums(entries.items()))


def assemble(version: str, out: Path, wheels: Sequence[Path], python: str, src: Path,
             link_base: Optional[str] = None) -> Path:
    try:
        make_release.make_release(version, out, wheels, link_base)
    except make_release.ReleaseError as exc:
        raise AssembleError(str(exc)) from None
    manifest = out / make_release.MANIFEST_NAME
    sdist = build_sdist(manifest, out, python, src)
    problems = check_sdist(sdist, manifest, version)
    if problems:
        raise AssembleError(f"{sdist.name}: " + "; ".join(problems))
    add_to_sums(out, [sdist])
    return sdist


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--src", type=Path, default=ROOT)
    parser.add_argument("--link-base", default=None, help="absolute URL for the index links (see make_release.py)")
    parser.add_argument("wheels", nargs="+", type=Path)
    args = parser.parse_args(argv)
    try:
        sdist = assemble(args.version, args.out, args.wheels, args.python, args.src, args.link_base)
    except AssembleError as exc:
        print(f"assemble_release: error: {exc}", file=sys.stderr)
        return 1
    for path in sorted(args.out.iterdir()):
        if path.is_file():
            print(f"{path.name}  {path.stat().st_size} bytes")
    print(f"sdist {sdist.name} carries {EMBEDDED}; SHA256SUMS covers the wheels, manifest.json and the sdist")
    return 0


if __name__ == "__main__":
    sys.exit(main())
