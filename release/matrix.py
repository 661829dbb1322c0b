#!/usr/bin/env python3
"""The release matrix: the one place that lists the build cells (CUDA toolkit x CPU arch).

    python -m release.matrix                 # {"include": [cell, ...]} as JSON on stdout
    python -m release.matrix --github-output # also `matrix=<json>` into $GITHUB_OUTPUT
    python -m release.matrix --cell 13.0 x86_64   # one cell, e.g. for release/build_cell.py
    python -m release.matrix --tag v0.1.0 --github-output   # also version=0.1.0, after checking that
                                                            # the tag is pyproject.toml's version

release.yml's `plan` job runs this and feeds `fromJSON(needs.plan.outputs.matrix)` to the build
job. The toolkits are the release policy's (cudelta/_release_policy.py CUDA_VERSIONS), the CPU
archs are ARCHS here: adding a CUDA version is an edit there (ARCHITECTURE.md "Where changes go").
tests/unit/test_workflows.py holds the workflows to it.

Each cell: the toolkit, the arch, the GitHub runner (arm64 runners for aarch64: no emulation), the
manylinux_2_28 CUDA build image (PyTorch's builder images: AlmaLinux 8, glibc 2.28, the toolkit
under /usr/local/cuda, CPython under /opt/python), the torch wheel index that matches the toolkit,
the wheel's platform tag, the +cuXYZ label, and an artifact name unique per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from installer.core import cuda, shipped

ROOT = Path(__file__).resolve().parent.parent

POLICY = shipped.load("_release_policy")
CUDA_VERSIONS = POLICY.CUDA_VERSIONS  # the toolkits built: the release policy's
ARCHS = ("x86_64", "aarch64")
# torch the release builds against (any torch >= the floor 2.10 works: the stable ABI is the contract).
TORCH_VERSION = "2.14.1"
BUILD_PYTHON = "cp311-cp311"  # interpreter inside the image; the wheel is cp310-abi3 whatever builds it
RUNNERS = {"x86_64": "ubuntu-24.04", "aarch64": "ubuntu-24.04-arm"}
IMAGES = {
    # Rotate images (or pin by digest, image@sha256:...) here; RELEASING.md "Rotating the manylinux image".
    "x86_64": "pytorch/manylinux2_28-builder:cuda{cuda}",
    "aarch64": "pytorch/manylinuxaarch64-builder:cuda{cuda}",
}


def cell(toolkit: str, arch: str) -> Dict[str, str]:
    if toolkit not in CUDA_VERSIONS or arch not in ARCHS:
        raise ValueError(f"no cell CUDA {toolkit} / {arch}; cells: CUDA {', '.join(CUDA_VERSIONS)} x {', '.join(ARCHS)}")
    POLICY.newest_gcc(toolkit)  # a toolkit built without its GCC limit is a policy error, said here
    label = cuda.label_of(toolkit)
    return {
        "cuda": toolkit,
        "arch": arch,
        "label": label,
        "runner": RUNNERS[arch],
        "image": IMAGES[arch].format(cuda=toolkit),
        "python": f"/opt/python/{BUILD_PYTHON}/bin/python",
        "torch": TORCH_VERSION,
        "torch_index": f"https://download.pytorch.org/whl/{label}",
        "platform": f"manylinux_2_28_{arch}",
        "artifact": f"wheel-{label}-{arch}",
    }


def cells() -> List[Dict[str, str]]:
    return [cell(toolkit, arch) for toolkit in CUDA_VERSIONS for arch in ARCHS]


def matrix() -> Dict[str, List[Dict[str, str]]]:
    return {"include": cells()}


def tag_version(tag: str, pyproject: Path = Path(__file__).resolve().parents[1] / "pyproject.toml") -> str:
    """'v0.1.0' -> '0.1.0', if pyproject.toml says version 0.1.0 (a tag must release what it names)."""
    m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
    version = m.group(1) if m else None
    if tag != f"v{version}":
        raise ValueError(f"tag {tag} does not name pyproject.toml's version {version} (expected v{version})")
    return version


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--github-output", action="store_true", help="append matrix=<json> to $GITHUB_OUTPUT")
    parser.add_argument("--cell", nargs=2, metavar=("CUDA", "ARCH"), help="print one cell")
    parser.add_argument("--tag", help="the release tag (vX.Y.Z); checked against pyproject.toml")
    args = parser.parse_args(argv)
    try:
        data = cell(*args.cell) if args.cell else matrix()
        version = tag_version(args.tag) if args.tag else None
    except ValueError as exc:
        print(f"matrix: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(data, separators=(",", ":"))
    print(text)
    if args.github_output:
        out = os.environ.get("GITHUB_OUTPUT")
        if not out:
            print("matrix: error: --github-output needs $GITHUB_OUTPUT", file=sys.stderr)
            return 2
        with open(out, "a", encoding="utf-8") as fh:
            fh.write(f"matrix={text}\n")
            if version:
                fh.write(f"version={version}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
