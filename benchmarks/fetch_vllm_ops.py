"""Fetch vLLM's GDN/KDA decode ops for the benchmarks, without installing vLLM.

    python benchmarks/fetch_vllm_ops.py [--version 0.34.0] [--cache /tmp/vllm-wheel] [--no-cuda-op]

Downloads vLLM's wheel from PyPI (`pip download vllm --no-deps`; 336 MB for 0.33.0, 239 MB for
0.34.0, kept in --cache when given, so a second run downloads nothing) and extracts into ignored
folders (/.peers/ in .gitignore: peer code is never committed), each with a VERSION file the
benchmarks' tables quote:

- .peers/vllm_fla: the Triton modules the recurrent decode kernels need (the GDN packed decode:
  ops/fused_recurrent.py, op.py, utils.py; the GDN MTP step's Triton port,
  ops/fused_gdn_decode_post_conv_mtp.py; the KDA packed decode vLLM runs for Kimi models:
  kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py; the causal-conv1d update vLLM's GDN
  layer runs before the step, model_executor/layers/mamba/ops/causal_conv1d.py, for
  benchmarks/conv_share.py; the gated RMSNorm with its static-FP8 output that vLLM's Qwen3.5
  NVIDIA layers run after the T=1 decode, models/qwen3_5/nvidia/ops/fused_gdn_gated_norm.py, for
  benchmarks/fp8_bench.py, with the one function it takes from ops/layernorm_guard.py cut out of
  that module, whose other imports reach far into vLLM), with small stand-ins for the vLLM modules
  they import (vllm.triton_utils, vllm.platforms, vllm.utils.math_utils, vllm.utils.platform_utils,
  vllm.v1.attention.backends.utils). The names those modules import and the current_platform
  methods they call are checked against the stand-ins here, so that a vLLM needing more fails
  before a GPU machine is started;
- .peers/cuda_op/vllm_C_stable.so.xz: vLLM's compiled ops, vllm/_C_stable_libtorch.abi3.so (92 MB
  in 0.33.0, 89 MB in 0.34.0; the GDN MTP step's CUDA op `torch.ops._C.fused_gdn_decode_post_conv_mtp`
  lives there), its symbol table stripped when `strip` keeps the op's registration, xz-compressed
  (x86 filter, preset 9e: about 60 MiB for 0.33.0, 55.4 MiB for 0.34.0, half a minute to two
  minutes of one core). The folder holds nothing else big, so the device tool
  can carry it alone (`carry: [".peers/cuda_op", ".peers/vllm_fla"]`: its 64 MiB carry limit counts
  the working tree too). mtp_bench.py decompresses it with Python's lzma and loads it.

kernel_bench.py and mtp_bench.py put .peers/vllm_fla on sys.path.
"""

from __future__ import annotations

import argparse
import ast
import lzma
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = "vllm/third_party/flash_linear_attention/ops/"
KDA = "vllm/models/kimi_k3/nvidia/ops/third_party/kda/"
CONV = "vllm/model_executor/layers/mamba/ops/"
QWEN = "vllm/models/qwen3_5/nvidia/ops/"
MODULES = (SRC + "fused_recurrent.py", SRC + "op.py", SRC + "utils.py", SRC + "fused_gdn_decode_post_conv_mtp.py",
           KDA + "fused_recurrent.py", CONV + "causal_conv1d.py", QWEN + "fused_gdn_gated_norm.py")
# Modules of which only some top-level functions are taken, under a header of imports from the
# stand-ins: path -> (header, function names).
EXCERPTS = {
    SRC + "layernorm_guard.py": ("import torch\n\nfrom vllm.utils.math_utils import cdiv, next_power_of_2\n"
                                 "from vllm.utils.platform_utils import num_compute_units\n",
                                 ("calc_rows_per_block",)),
}
CUDA_OP_SO = "vllm/_C_stable_libtorch.abi3.so"
CUDA_OP_FILE = "vllm_C_stable.so.xz"
VERSION_FILE = "VERSION"
FLA_DIR = ROOT / ".peers" / "vllm_fla"
CUDA_OP_DIR = ROOT / ".peers" / "cuda_op"
# The op's schema string, registered by the library's static initialisers: a stripped copy must keep it.
CUDA_OP_SCHEMA = b"fused_gdn_decode_post_conv_mtp(Tensor mixed_qkv"
# x86 branch filter then LZMA2 at its strongest: 0.5 MB smaller than `xz -9` on this library, whose
# bulk (62 of 92 MB) is CUDA fat binaries that are compressed already.
XZ_FILTERS = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]

SHIMS = {
    "vllm/__init__.py": '"""Stand-in package: only what the extracted fla ops import."""\n',
    "vllm/triton_utils.py": (
        "import triton\nimport triton.language as tl\nfrom triton.language.extra import libdevice as tldevice\n"
    ),
    "vllm/platforms.py": '''from typing import NamedTuple

import torch


class DeviceCapability(NamedTuple):
    major: int
    minor: int


class _CudaPlatform:
    """The subset of vllm.platforms.current_platform the fla ops call."""

    def is_cuda(self):
        return True

    def is_cuda_alike(self):
        return True

    def is_rocm(self):
        return False

    def is_cpu(self):
        return False

    def get_device_name(self, device_id=0):
        return torch.cuda.get_device_name(device_id or 0)

    def get_device_capability(self, device_id=0):
        return DeviceCapability(*torch.cuda.get_device_capability(device_id or 0))

    def is_device_capability(self, capability, device_id=0):
        have = self.get_device_capability(device_id)
        if isinstance(capability, tuple):
            return have == capability
        return have.major * 10 + have.minor == capability

    def is_device_capability_family(self, capability, device_id=None):
        return self.get_device_capability(device_id).major * 10 == capability

    def is_arch_support_pdl(self):
        return torch.cuda.get_device_capability()[0] >= 9


current_platform = _CudaPlatform()
''',
    "vllm/third_party/__init__.py": "",
    "vllm/third_party/flash_linear_attention/__init__.py": "",
    # vLLM's ops/__init__ imports the chunked prefill too; the decode kernels need none of it.
    "vllm/third_party/flash_linear_attention/ops/__init__.py": (
        "from .fused_recurrent import fused_recurrent_gated_delta_rule, "
        "fused_recurrent_gated_delta_rule_packed_decode\n"
    ),
    "vllm/utils/__init__.py": "",
    "vllm/utils/math_utils.py": (
        "def cdiv(a: int, b: int) -> int:\n    return -(a // -b)\n\n\n"
        "def next_power_of_2(n: int) -> int:\n    return 1 if n < 1 else 1 << (n - 1).bit_length()\n"
    ),
    # The MTP Triton port sizes its value tiles by the SM count (vLLM asks current_platform).
    "vllm/utils/platform_utils.py": (
        "import torch\n\n\n"
        "def num_compute_units(device_id: int = 0) -> int:\n"
        "    return torch.cuda.get_device_properties(device_id).multi_processor_count\n\n\n"
        "def cuda_get_device_properties(device, names, init_cuda=False):\n"
        "    props = torch.cuda.get_device_properties(device)\n"
        "    return tuple(getattr(props, name) for name in names)\n"
    ),
    # The package __init__s import the chunked prefill too; the packed decode needs none of it.
    "vllm/models/__init__.py": "",
    "vllm/models/kimi_k3/__init__.py": "",
    "vllm/models/qwen3_5/__init__.py": "",
    "vllm/models/qwen3_5/nvidia/__init__.py": "",
    QWEN + "__init__.py": "",
    "vllm/models/kimi_k3/nvidia/__init__.py": "",
    "vllm/models/kimi_k3/nvidia/ops/__init__.py": "",
    "vllm/models/kimi_k3/nvidia/ops/third_party/__init__.py": "",
    KDA + "__init__.py": "from .fused_recurrent import fused_recurrent_kda_packed_decode\n",
    # causal_conv1d.py: its packages' __init__s pull in the model executor; the module itself needs
    # only the two block ids (vllm/v1/attention/backends/utils.py in 0.33).
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/mamba/__init__.py": "",
    CONV + "__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/utils.py": "PAD_SLOT_ID = -1\nNULL_BLOCK_ID = 0\n",
}


def module_name(path: str) -> str:
    """"vllm/a/b.py" -> "vllm.a.b"; a package's "vllm/a/__init__.py" -> "vllm.a"."""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def defined_names(tree: ast.Module) -> set[str]:
    """What `from module import name` can take from a module: its top-level defs, classes,
    assignments and imports, those under a top-level `if` or `try` included."""
    names, nodes = set(), list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If):
            nodes += node.body + node.orelse
        elif isinstance(node, ast.Try):
            nodes += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def missing_stand_ins(files: dict[str, str]) -> list[str]:
    """What vLLM's extracted modules need at import and the stand-ins lack: each top-level
    `from vllm.X import name` must find X among `files` (path -> source) defining name, and each
    `current_platform.attr` the modules use must be a method of the platforms stand-in. A newer vLLM
    that asks for more fails here, before a GPU machine is started, not when a benchmark imports it."""
    trees = {module_name(path): ast.parse(text) for path, text in files.items()}
    platform = next((node for node in trees["vllm.platforms"].body
                     if isinstance(node, ast.ClassDef) and node.name == "_CudaPlatform"), None)
    methods = {f.name for f in platform.body if isinstance(f, ast.FunctionDef)} if platform else set()
    missing = []
    for path in MODULES + tuple(EXCERPTS):
        tree = trees[module_name(path)]
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                if node.module not in trees:
                    missing.append(f"{path}: module {node.module}")
                    continue
                have = defined_names(trees[node.module])
                missing += [f"{path}: {node.module}.{a.name}" for a in node.names if a.name not in have]
        used = {n.attr for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "current_platform"}
        missing += [f"{path}: current_platform.{attr}" for attr in sorted(used - methods)]
    return missing


def excerpt(path: str, source: str) -> str:
    """EXCERPTS[path]'s header and the named top-level functions of source, in that order; a name the
    module no longer defines stops the fetch."""
    header, names = EXCERPTS[path]
    tree = ast.parse(source)
    found = {node.name: ast.get_source_segment(source, node) for node in tree.body
             if isinstance(node, ast.FunctionDef) and node.name in names}
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"fetch_vllm_ops: {path} no longer defines {', '.join(missing)}")
    return header + "".join(f"\n\n{found[name]}\n" for name in names)


def wheel_version(wheel: Path) -> str:
    """vLLM's version from its wheel's file name (what --wheel hands in may not be --version)."""
    from packaging.utils import parse_wheel_filename

    return str(parse_wheel_filename(wheel.name)[1])


def record_version(folder: Path, version: str) -> None:
    """folder/VERSION: which vLLM the benchmarks' tables name as the peer."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / VERSION_FILE).write_text(version + "\n")


def fetched_version(folder: Path) -> str:
    """The vLLM version fetched into folder, as the benchmarks print it."""
    try:
        return (folder / VERSION_FILE).read_text().strip()
    except OSError:
        return "version not recorded"


def find_wheel(version: str, folder: Path) -> Path | None:
    return next(iter(sorted(folder.glob(f"vllm-{version}-*.whl"))), None)


def download_wheel(version: str, folder: Path) -> Path:
    """vLLM's wheel in folder: the one already there, else `pip download`'s."""
    wheel = find_wheel(version, folder)
    if wheel is None:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
                        "--only-binary=:all:", "-d", str(folder)], check=True)
        wheel = find_wheel(version, folder)
        if wheel is None:
            raise SystemExit(f"fetch_vllm_ops: pip download left no vllm-{version}-*.whl in {folder}")
    return wheel


def extract_modules(zf: zipfile.ZipFile, dest: Path) -> None:
    """vLLM's modules and the stand-ins into dest, checked first (a vLLM needing more stand-ins
    leaves dest as it was); dest's VERSION goes while they are replaced, record_version writes it."""
    modules = {name: zf.read(name).decode() for name in MODULES}
    modules.update({name: excerpt(name, zf.read(name).decode()) for name in EXCERPTS})
    missing = missing_stand_ins({**modules, **SHIMS})
    if missing:
        raise SystemExit("fetch_vllm_ops: this vLLM's decode modules need stand-ins SHIMS does not have yet:\n  "
                         + "\n  ".join(missing))
    license_name = SRC.rsplit("ops/", 1)[0] + "LICENSE"
    (dest / VERSION_FILE).unlink(missing_ok=True)
    for rel, text in {**modules, license_name: zf.read(license_name).decode(), **SHIMS}.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def stripped(library: Path, work: Path) -> Path:
    """A copy of library without its symbol table (`strip --strip-unneeded`: the dynamic symbols the
    loader needs stay), or library itself where strip is missing, fails, or loses the op's schema."""
    if shutil.which("strip") is None:
        print("fetch_vllm_ops: no `strip` on PATH; compressing the library as shipped", file=sys.stderr)
        return library
    copy = work / "stripped.so"
    shutil.copyfile(library, copy)
    done = subprocess.run(["strip", "--strip-unneeded", str(copy)], capture_output=True, text=True)
    if done.returncode != 0 or CUDA_OP_SCHEMA not in copy.read_bytes():
        print(f"fetch_vllm_ops: strip did not keep {CUDA_OP_SCHEMA.decode()}... ({done.stderr.strip()}); "
              "compressing the library as shipped", file=sys.stderr)
        return library
    return copy


def extract_cuda_op(zf: zipfile.ZipFile, dest: Path) -> Path:
    """dest/vllm_C_stable.so.xz from the wheel's _C_stable_libtorch library; returns its path."""
    with tempfile.TemporaryDirectory(prefix="fetch-vllm-op-") as tmp:
        library = Path(tmp) / "vllm_C_stable.so"
        library.write_bytes(zf.read(CUDA_OP_SO))
        if CUDA_OP_SCHEMA not in library.read_bytes():
            raise SystemExit(f"fetch_vllm_ops: {CUDA_OP_SO} does not register {CUDA_OP_SCHEMA.decode()}...: this "
                             "vLLM version has no fused GDN MTP op")
        small = stripped(library, Path(tmp))
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / CUDA_OP_FILE
        partial = target.with_suffix(".partial")
        with open(small, "rb") as src, lzma.open(partial, "wb", format=lzma.FORMAT_XZ, filters=XZ_FILTERS) as out:
            shutil.copyfileobj(src, out, 1 << 24)
        (dest / VERSION_FILE).unlink(missing_ok=True)  # record_version names the new library
        partial.replace(target)
        mib = 1 << 20
        print(f"vLLM's CUDA ops: {CUDA_OP_SO} {library.stat().st_size / mib:.1f} MiB, "
              f"{'stripped ' + format(small.stat().st_size / mib, '.1f') + ' MiB, ' if small != library else ''}"
              f"xz {target.stat().st_size / mib:.1f} MiB in {target}")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The newest vLLM the stand-ins cover; the results files up to December 2026 ran against 0.33.0.
    parser.add_argument("--version", default="0.34.0")
    parser.add_argument("--dest", type=Path, default=FLA_DIR)
    parser.add_argument("--cuda-op-dest", type=Path, default=CUDA_OP_DIR,
                        help="folder for vllm_C_stable.so.xz (keep nothing else big in it)")
    parser.add_argument("--no-cuda-op", action="store_true", help="skip the CUDA library (only the Triton modules)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wheel", type=Path, help="use this vLLM wheel instead of downloading one")
    source.add_argument("--cache", type=Path, help="download the wheel into this folder and keep it there "
                        "(a wheel already there is used as is)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fetch-vllm-") as tmp:
        wheel = args.wheel or download_wheel(args.version, args.cache or Path(tmp))
        version = wheel_version(wheel)
        with zipfile.ZipFile(wheel) as zf:
            extract_modules(zf, args.dest)
            record_version(args.dest, version)
            print(f"vLLM {version} GDN and KDA decode ops in {args.dest} (from {wheel.name})")
            if not args.no_cuda_op:
                extract_cuda_op(zf, args.cuda_op_dest)
                record_version(args.cuda_op_dest, version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
