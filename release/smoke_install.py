#!/usr/bin/env python3
"""Install a built wheel into a fresh venv and load its library: `python -m release.smoke_install WHEEL`.

The release matrix runs this after the checks, in the cell's image (no GPU there): a new venv, torch
from the cell's index (--torch-index URL, --torch VERSION), the wheel with `pip install --no-deps`,
then, in that venv with -I (never the source tree): `import cudelta`, the build record, and the
library loaded by cudelta's own loader (torch.ops.load_library after its compatibility checks).
Loading needs no GPU: the CUDA runtime is linked statically and looks for the driver only when a
kernel runs. --torch-from VENV makes that venv's torch visible through a .pth instead of
installing it (local runs, no download).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import venv
from pathlib import Path
from typing import Optional, Sequence

PROBE = """
import json, cudelta, torch
from cudelta import _native
s = _native.status()
print(json.dumps({"torch": torch.__version__, "library": str(s.path), "loaded": s.loaded, "reason": s.reason,
                  "cuda_label": (s.build_info or {}).get("cuda_label"), "archs": (s.build_info or {}).get("archs")}))
raise SystemExit(0 if s.loaded else 1)
"""


def site_packages(env: Path) -> Path:
    return env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--torch", default="torch", help="requirement, e.g. torch==2.14.1")
    parser.add_argument("--torch-index", default=None, help="e.g. https://download.pytorch.org/whl/cu130")
    parser.add_argument("--torch-from", type=Path, default=None, help="a venv whose torch to reuse")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cudelta-smoke-") as tmp:
        env = Path(tmp) / "venv"
        venv.EnvBuilder(with_pip=True).create(env)
        py = str(env / "bin" / "python")
        if args.torch_from:
            (site_packages(env) / "_torch_from.pth").write_text(str(site_packages(args.torch_from.resolve())) + "\n")
        else:
            index = ["--index-url", args.torch_index] if args.torch_index else []
            subprocess.run([py, "-m", "pip", "install", "-q", args.torch, *index], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(args.wheel)], check=True)
        proc = subprocess.run([py, "-I", "-c", PROBE], cwd=tmp, capture_output=True, text=True)
        print(proc.stdout.strip() or proc.stderr.strip()[-2000:])
        if proc.returncode != 0:
            print(f"smoke_install: {args.wheel.name} did not load", file=sys.stderr)
            return 1
    print(f"smoke_install: {args.wheel.name} installs into a fresh venv and loads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
