"""Fetch vLLM's flash-linear-attention decode ops for the benchmark, without installing vLLM.

    python benchmarks/fetch_vllm_ops.py [--version 0.33.0] [--dest .peers/vllm_fla]

Downloads vLLM's wheel from PyPI (`pip download vllm --no-deps`), extracts only the modules the
recurrent decode kernels need (the GDN packed decode: ops/fused_recurrent.py, op.py, utils.py; the
KDA packed decode vLLM runs for Kimi models: kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py)
into an ignored folder (/.peers/ in .gitignore: peer code is never committed), and writes small
stand-ins for the vLLM modules they import (vllm.triton_utils, vllm.platforms, vllm.utils.math_utils).
The device tool carries the folder to the GPU machine (`carry: [".peers"]`); kernel_bench.py puts it
on sys.path.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = "vllm/third_party/flash_linear_attention/ops/"
KDA = "vllm/models/kimi_k3/nvidia/ops/third_party/kda/"
MODULES = (SRC + "fused_recurrent.py", SRC + "op.py", SRC + "utils.py", KDA + "fused_recurrent.py")

SHIMS = {
    "vllm/__init__.py": '"""Stand-in package: only what the extracted fla ops import."""\n',
    "vllm/triton_utils.py": (
        "import triton\nimport triton.language as tl\nfrom triton.language.extra import libdevice as tldevice\n"
    ),
    "vllm/platforms.py": '''import torch


class _CudaPlatform:
    """The subset of vllm.platforms.current_platform the fla ops call."""

    def is_cuda(self):
        return True

    def is_cuda_alike(self):
        return True

    def is_device_capability_family(self, capability, device_id=None):
        major, _ = torch.cuda.get_device_capability(device_id or 0)
        return major * 10 == capability

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
    # The package __init__s import the chunked prefill too; the packed decode needs none of it.
    "vllm/models/__init__.py": "",
    "vllm/models/kimi_k3/__init__.py": "",
    "vllm/models/kimi_k3/nvidia/__init__.py": "",
    "vllm/models/kimi_k3/nvidia/ops/__init__.py": "",
    "vllm/models/kimi_k3/nvidia/ops/third_party/__init__.py": "",
    KDA + "__init__.py": "from .fused_recurrent import fused_recurrent_kda_packed_decode\n",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default="0.33.0")
    parser.add_argument("--dest", type=Path, default=ROOT / ".peers" / "vllm_fla")
    parser.add_argument("--wheel", type=Path, help="use this vLLM wheel instead of downloading one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={args.version}", "--no-deps",
                            "--only-binary=:all:", "-d", tmp], check=True)
            wheel = next(Path(tmp).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            for name in MODULES:
                target = args.dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(name))
            license_name = SRC.rsplit("ops/", 1)[0] + "LICENSE"
            (args.dest / license_name).write_bytes(zf.read(license_name))
    for rel, text in SHIMS.items():
        path = args.dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"vLLM {args.version} GDN and KDA decode ops in {args.dest} (from {wheel.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
