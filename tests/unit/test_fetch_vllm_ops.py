"""benchmarks/fetch_vllm_ops.py without vLLM's wheel: the check that its stand-ins cover what vLLM's
decode modules import, and the version the benchmarks' tables quote."""

import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fetch_vllm_ops as fetch  # noqa: E402

RECURRENT = "vllm/third_party/flash_linear_attention/ops/fused_recurrent.py"
UTILS = "vllm/third_party/flash_linear_attention/ops/utils.py"
OP = "vllm/third_party/flash_linear_attention/ops/op.py"
CONV = "vllm/model_executor/layers/mamba/ops/causal_conv1d.py"
NORM = "vllm/models/qwen3_5/nvidia/ops/fused_gdn_gated_norm.py"
GUARD = "vllm/third_party/flash_linear_attention/ops/layernorm_guard.py"
# vLLM 0.34's layernorm_guard.py as far as the fetch reads it: imports from far into vLLM, the one
# function the norm module takes, and more beside it.
GUARD_0_34 = ("import torch\nfrom einops import rearrange\n"
              "from vllm.model_executor.warmup.jit_warmup import VllmJitKernel\n"
              "from vllm.utils.math_utils import cdiv, next_power_of_2\n"
              "from vllm.utils.platform_utils import num_compute_units\n\n\n"
              "def calc_rows_per_block(M: int, device: torch.device) -> int:\n"
              "    sm_count = num_compute_units(device.index)\n"
              "    return min(next_power_of_2(cdiv(M, 2 * sm_count)), 4)\n\n\n"
              "class LayerNormFwdKernel(VllmJitKernel):\n    pass\n")


def modules(sources: dict[str, str]) -> dict[str, str]:
    """Every module fetch_vllm_ops extracts (empty but for `sources`: path -> text), and its SHIMS."""
    return {**{name: "" for name in fetch.MODULES + tuple(fetch.EXCERPTS)}, **sources, **fetch.SHIMS}


def test_the_stand_ins_cover_what_vllm_0_34_s_packed_decode_asks_for():
    # 0.34's fused_recurrent.py and utils.py, as far as they reach into vLLM (what 0.33's stand-ins lacked).
    recurrent = ("from vllm.platforms import current_platform\nfrom vllm.triton_utils import tl, triton\n"
                 "def pick(dev):\n    return current_platform.is_cuda() and "
                 "current_platform.is_device_capability(90, device_id=dev.index)\n")
    utils = ("from vllm.platforms import current_platform\nfrom vllm.triton_utils import triton\n"
             "from vllm.utils.platform_utils import cuda_get_device_properties\n"
             "hopper = 'NVIDIA H' in current_platform.get_device_name(0) or "
             "current_platform.get_device_capability(0).major >= 9\namd = current_platform.is_rocm()\n")
    assert fetch.missing_stand_ins(modules({RECURRENT: recurrent, UTILS: utils})) == []


def test_the_norm_module_gets_the_one_function_it_takes_from_layernorm_guard():
    # 0.34's fused_gdn_gated_norm.py imports calc_rows_per_block; the rest of layernorm_guard.py
    # (its JIT warm-up classes) is not taken, nor its imports.
    norm = ("import torch\nfrom vllm.third_party.flash_linear_attention.ops.layernorm_guard import "
            "calc_rows_per_block\nfrom vllm.triton_utils import tl, triton\n")
    cut = fetch.excerpt(GUARD, GUARD_0_34)
    assert "def calc_rows_per_block" in cut and "LayerNormFwdKernel" not in cut and "jit_warmup" not in cut
    assert fetch.missing_stand_ins(modules({NORM: norm, GUARD: cut})) == []
    namespace = {}
    exec(compile(cut.replace("from vllm.", "# from vllm."), GUARD, "exec"), namespace)  # noqa: S102
    assert "calc_rows_per_block" in namespace


def test_a_function_the_excerpted_module_no_longer_defines_stops_the_fetch():
    with pytest.raises(SystemExit, match="layernorm_guard.py no longer defines calc_rows_per_block"):
        fetch.excerpt(GUARD, "def calc_rows(M, device):\n    return 1\n")


def test_a_name_or_a_platform_method_the_stand_ins_lack_is_named_with_its_module():
    recurrent = ("from vllm.platforms import current_platform\nfrom vllm.utils.math_utils import cdiv, round_up\n"
                 "from vllm.envs import VLLM_FLAG\nxpu = current_platform.is_xpu()\n")
    missing = fetch.missing_stand_ins(modules({RECURRENT: recurrent}))
    assert missing == [f"{RECURRENT}: vllm.utils.math_utils.round_up", f"{RECURRENT}: module vllm.envs",
                       f"{RECURRENT}: current_platform.is_xpu"]


def test_names_defined_under_a_top_level_if_or_try_count_as_defined():
    op = ("import os\nif os.environ.get('FAST') == '1':\n    exp = 1\nelse:\n    exp = 2\n    log = 3\n"
          "try:\n    from math import gather\nexcept ImportError:\n    def gather():\n        pass\n")
    user = "from vllm.third_party.flash_linear_attention.ops.op import exp, log, gather\n"
    assert fetch.missing_stand_ins(modules({OP: op, RECURRENT: user})) == []


def test_an_import_inside_a_function_is_not_required_at_import_time():
    # causal_conv1d.py imports its CPU kernel inside the function that runs on CPU only.
    conv = "def update(x):\n    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import update\n"
    assert fetch.missing_stand_ins(modules({CONV: conv})) == []


def test_the_version_comes_from_the_wheel_s_name_not_from_the_version_flag():
    assert fetch.wheel_version(Path("/x/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl")) == "0.34.0"
    assert fetch.wheel_version(Path("vllm-0.33.0rc1-cp38-abi3-manylinux_2_28_x86_64.whl")) == "0.33.0rc1"


def test_the_recorded_version_is_what_the_benchmarks_read_back(tmp_path):
    assert fetch.fetched_version(tmp_path / "cuda_op") == "version not recorded"
    fetch.record_version(tmp_path / "cuda_op", "0.34.0")
    assert fetch.fetched_version(tmp_path / "cuda_op") == "0.34.0"


@pytest.mark.parametrize("path,name", [("vllm/a/b.py", "vllm.a.b"), ("vllm/a/__init__.py", "vllm.a"),
                                       ("vllm/__init__.py", "vllm")])
def test_module_names_follow_python_s_rule_for_packages(path, name):
    assert fetch.module_name(path) == name


def test_the_platform_stand_in_answers_capability_questions_as_vllm_s_does(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    namespace = {}
    exec(compile(fetch.SHIMS["vllm/platforms.py"], "vllm/platforms.py", "exec"), namespace)
    platform = namespace["current_platform"]
    assert platform.is_device_capability(90, device_id=None) and platform.is_device_capability((9, 0))
    assert not platform.is_device_capability(100) and not platform.is_device_capability((9, 1))
    assert platform.is_device_capability_family(90) and not platform.is_device_capability_family(100)
    assert platform.get_device_capability(0).major == 9 and not platform.is_rocm()


def test_a_vllm_needing_more_stand_ins_leaves_the_fetched_folder_as_it_was(tmp_path):
    wheel = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in fetch.MODULES:
            zf.writestr(name, "from vllm.platforms import current_platform\nx = current_platform.is_xpu()\n"
                        if name == RECURRENT else "")
        zf.writestr(GUARD, GUARD_0_34)
    dest = tmp_path / "vllm_fla"
    fetch.record_version(dest, "0.33.0")
    (dest / "kept.py").write_text("old")
    with zipfile.ZipFile(wheel) as zf, pytest.raises(SystemExit, match="current_platform.is_xpu"):
        fetch.extract_modules(zf, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["VERSION", "kept.py"]
    assert fetch.fetched_version(dest) == "0.33.0"
