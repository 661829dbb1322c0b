"""benchmarks/vllm_surface.py without vLLM's wheels: what it reports changed between two releases,
from sources and library contents written here in the shapes vLLM 0.33 and 0.34 have them."""

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vllm_surface as surface  # noqa: E402

OPS = "vllm/_custom_ops.py"
LAYER = surface.GDN_LAYER
MTP_OP = '''
def fused_gdn_decode_post_conv_mtp(mixed_qkv, a, b, state, out=None, scale: float = 128**-0.5):
    if out is None:
        out = torch.empty_like(mixed_qkv)
    torch.ops._C.fused_gdn_decode_post_conv_mtp(mixed_qkv, a, b, state, out, scale)
    return out
'''


def test_formatting_alone_is_no_change_and_a_changed_constant_shows_its_values():
    reformatted = MTP_OP.replace("out=None, scale", "out = None,\n        scale")
    old = {OPS: MTP_OP, LAYER: "MAX_FUSED_GDN_MTP_TOKENS = 8\n"}
    new = {OPS: reformatted, LAYER: "MAX_FUSED_GDN_MTP_TOKENS = 9  # kMaxMtpTokens\n"}
    assert surface.python_changes(old, new) == [f"- {LAYER}: MAX_FUSED_GDN_MTP_TOKENS: 8 -> 9"]


def test_a_new_argument_is_a_signature_change_with_the_diff_of_the_code():
    new = MTP_OP.replace("scale: float = 128**-0.5)", "scale: float = 128**-0.5, norm_eps: float = 1e-05)")
    lines = surface.python_changes({OPS: MTP_OP}, {OPS: new})
    assert lines[0] == (f"- {OPS}: fused_gdn_decode_post_conv_mtp: signature (mixed_qkv, a, b, state, out=None, "
                        "scale: float=128 ** (-0.5)) -> (mixed_qkv, a, b, state, out=None, scale: float=128 ** (-0.5), "
                        "norm_eps: float=1e-05)")
    assert any(line.strip().startswith("+def fused_gdn_decode_post_conv_mtp(") for line in lines[1:])


def test_a_method_is_found_inside_its_class_and_a_body_change_is_shown():
    layer = "class GatedDeltaNet:\n    def _can_use_fused_gdn_mtp_decode(self, m):\n        return m.S <= {}\n"
    lines = surface.python_changes({LAYER: layer.format(8)}, {LAYER: layer.format(9)})
    assert lines[0] == f"- {LAYER}: _can_use_fused_gdn_mtp_decode: body changed"
    assert [line.strip() for line in lines[1:] if line.strip()[:1] in "+-"] == ["-    return m.S <= 8",
                                                                               "+    return m.S <= 9"]


def test_a_call_that_is_gone_or_new_is_said():
    old = {OPS: MTP_OP + "\ndef fused_kda_decode(x):\n    pass\n"}
    assert surface.python_changes(old, {OPS: MTP_OP}) == [f"- {OPS}: fused_kda_decode: gone"]
    assert surface.python_changes({OPS: MTP_OP}, old) == [f"- {OPS}: fused_kda_decode: new"]
    assert surface.python_changes({}, {LAYER: "X = 1\n"}) == [
        f"- {LAYER}: {name}: the file is new" for path, name in surface.SURFACE if path == LAYER]


# nm -C lines as 0.33's and 0.34's libraries print them (abridged).
NM_033 = [
    "0000000000dfa240 t void (anonymous namespace)::gdn_decode_post_conv_mtp_kernel<float, 1, false>(float const*)",
    "0000000000dfa240 t void (anonymous namespace)::gdn_decode_post_conv_mtp_kernel<float, 2, true>(float const*)",
    "0000000000dff800 t void (anonymous namespace)::launch_gdn_decode_post_conv_mtp<float, 1, false>(int, int)",
    "0000000000aa0000 t void (anonymous namespace)::kda_decode_fusion_many_heads_kernel<false, 96>(int)",
    "0000000000aa0100 t vllm::cross_device_reduce_1stage<float, 2>(float*)",
]
NM_034 = [line.replace(", false>(float", ", false, 4>(float").replace(", true>(float", ", true, 1>(float")
          for line in NM_033] + [
    "0000000000dfa600 t (anonymous namespace)::choose_split_v(int, int)",
    "0000000000dfa640 t void (anonymous namespace)::gdn_decode_post_conv_mtp_kernel<float, 1, false, 2>(float const*)",
]


def test_the_library_s_kernels_are_summed_up_by_template_parameter_and_new_helpers_named():
    strings_033 = ["state_indices must have shape [N, S] with 1 <= S <= 8", "request_state_indices must be int32",
                   "_ZN12_GLOBAL__N_114choose_split_vEii", "cudaLaunchKernel"]
    strings_034 = [s.replace("<= 8", "<= 9") for s in strings_033]
    old = surface.library_facts(strings_033, NM_033)
    new = surface.library_facts(strings_034, NM_034)
    assert old["helpers"] == {"launch_gdn_decode_post_conv_mtp"}
    assert surface.library_changes(old, new) == [
        "- library string gone: state_indices must have shape [N, S] with 1 <= S <= 8",
        "- library string new: state_indices must have shape [N, S] with 1 <= S <= 9",
        "- kernel gdn_decode_post_conv_mtp_kernel: 2 x <float, 1|2, false|true> -> 3 x <float, 1|2, false|true, 1|2|4>",
        "- function new: choose_split_v",
    ]


def test_without_nm_the_strings_are_still_compared_and_the_rest_said_to_be_skipped():
    old = surface.library_facts(["GDN decode MTP fusion requires HV/H in {1, 2, 4}"], None)
    new = surface.library_facts(["GDN decode MTP fusion requires HV/H in {1, 2, 3, 4, 8}"], None)
    lines = surface.library_changes(old, new)
    assert lines[:2] == ["- library string gone: GDN decode MTP fusion requires HV/H in {1, 2, 4}",
                         "- library string new: GDN decode MTP fusion requires HV/H in {1, 2, 3, 4, 8}"]
    assert lines[2] == "- kernels and helper functions: not compared (no `nm` on PATH)"


def test_printable_strings_are_what_strings_prints():
    data = b"\x00\x01short\x00" + b"state_indices must be int32\x00\xff" + b"x" * 8
    assert surface.printable_strings(data) == ["state_indices must be int32", "xxxxxxxx"]


def test_two_wheels_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr(surface.shutil, "which", lambda name: None)  # no nm: strings only
    wheels = []
    for version, cap, message in (("0.33.0", 8, b"1 <= S <= 8"), ("0.34.0", 9, b"1 <= S <= 9")):
        wheel = tmp_path / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(OPS, MTP_OP)
            zf.writestr(LAYER, f"MAX_FUSED_GDN_MTP_TOKENS = {cap}\n")
            zf.writestr(surface.CUDA_OP_SO, b"\x7fELF\x00state_indices must have shape [N, S] with " + message + b"\x00")
        wheels.append(wheel)
    text = surface.report(*wheels)
    assert text.splitlines()[0] == "vLLM 0.33.0 -> 0.34.0: what cudelta.vllm_compat mirrors and the benchmarks run"
    assert f"- {LAYER}: MAX_FUSED_GDN_MTP_TOKENS: 8 -> 9" in text
    assert "- library string new: state_indices must have shape [N, S] with 1 <= S <= 9" in text
    assert f"{OPS}:" not in text  # the op's wrapper is the same in both
