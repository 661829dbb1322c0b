"""cudelta.vllm_compat.fused_kda_decode (vLLM 0.33's Kimi K3 KDA decode step) on CPU tensors laid out
as vLLM's layer hands them over, against an independent float64 model of vLLM's op
(tests/kda_cases.py), and the op's argument rules; the bounded ("safe") KDA gate it needs, in
cudelta.kda_decode and its reference; the conv reference's tap-major weight."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/kda_cases.py
import kda_cases as kc  # noqa: E402

import cudelta  # noqa: E402
from cudelta import vllm_compat  # noqa: E402
from cudelta.conv_reference import causal_conv1d_update_reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:cudelta. CPU tensors run the PyTorch reference")


def run(args, fn=vllm_compat.fused_kda_decode):
    return fn(**args)


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("lower_bound, epilogue, bias", [(-5.0, True, False), (None, True, True), (-1.0, False, True)],
                         ids=["safe-gate-norm", "softplus-norm-bias", "safe-gate-plain-bias"])
def test_the_drop_in_matches_the_float64_model_on_vllm_s_pages(layout, lower_bound, epilogue, bias):
    # Requests 1 and 3 name no state: vLLM's null block (0) and its padding slot (-1).
    idx = torch.tensor([5, 0, 2, -1], dtype=torch.int32)
    args, pages = kc.kimi_call(4, 2, 8, seed=3, layout=layout, epilogue=epilogue, lower_bound=lower_bound, bias=bias,
                               idx=idx)
    want_out, want_conv, want_state = kc.kimi_model(args)
    before = pages.clone()
    out = run(args)
    assert out.shape == (1, 4, 2, kc.D) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want_out, rtol=1 / 64, atol=1e-3 * float(want_out.abs().max()))
    assert torch.equal(out[0, [1, 3]], torch.zeros_like(out[0, [1, 3]]))
    torch.testing.assert_close(args["state"].double(), want_state, rtol=1e-4, atol=1e-5)
    assert torch.equal(args["conv_state"].double(), want_conv)  # the window holds copies of bf16 inputs
    written = torch.zeros(8, dtype=torch.bool)
    written[[5, 2]] = True
    assert torch.equal(pages[~written], before[~written])  # the null block and every slot not named
    assert not torch.equal(pages[written], before[written])


def test_the_reference_entry_is_the_drop_in_s_semantics():
    a1, _ = kc.kimi_call(3, 1, 5, seed=4)
    a2, _ = kc.kimi_call(3, 1, 5, seed=4)
    assert torch.equal(run(a1), run(a2, vllm_compat.fused_kda_decode_reference))
    assert torch.equal(a1["state"], a2["state"]) and torch.equal(a1["conv_state"], a2["conv_state"])


def test_a_bf16_state_pool_runs_as_cudelta_s_extension():
    args, _ = kc.kimi_call(2, 1, 4, seed=5, state_dtype=torch.bfloat16)
    want_out, _, want_state = kc.kimi_model(args)
    out = run(args)
    torch.testing.assert_close(out.double(), want_out, rtol=1 / 32, atol=2e-3 * float(want_out.abs().max()))
    torch.testing.assert_close(args["state"].double(), want_state, rtol=1 / 100, atol=1e-3)


def spoil(**changes):
    def apply(args):
        for k, v in changes.items():
            args[k] = v(args) if callable(v) else v
    return apply


@pytest.mark.parametrize("change, message", [
    (spoil(x=lambda a: a["x"].float()), "x must be a bfloat16 tensor; got torch.float32"),
    (spoil(weight=lambda a: a["weight"].to(torch.bfloat16)), "weight must be a float32 tensor"),
    (spoil(weight=lambda a: a["weight"][:, :3]), r"weight must have shape \[3, 4, H \* 128\] = \[3, 4, 256\]"),
    (spoil(conv_state=lambda a: a["conv_state"].contiguous().transpose(1, 2).contiguous().transpose(1, 2)[:, :, :2]),
     r"conv_state must have shape \[slots, 3 \* H \* 128, 3\]"),
    (spoil(conv_state=lambda a: torch.zeros(6, 768, 5, dtype=torch.bfloat16)[:, :, :3]),
     "conv_state must use the SD or DS cache layout"),
    (spoil(raw_g=lambda a: a["raw_g"][0]), r"raw_g must have shape \[1, 3, 2, 128\]"),
    (spoil(dt_bias=lambda a: a["dt_bias"][:128]), "dt_bias must be contiguous with 256 elements; got 128"),
    (spoil(state_indices=lambda a: a["state_indices"].long()), "state_indices must be an int32 tensor; got torch.int64"),
    (spoil(state=lambda a: a["state"].transpose(2, 3)), "state must have contiguous"),
    (spoil(norm_weight=None), "output_gate and norm_weight must be provided together"),
    (spoil(norm_weight=lambda a: a["norm_weight"].to(torch.bfloat16)), "norm_weight must be a float32 tensor"),
    (spoil(norm_eps=-1.0), "norm_eps must be non-negative; got -1.0"),
    (spoil(x=lambda a: a["x"][:, :200]), r"x must have shape \[B, 3 \* H \* 128\]; got \(3, 200\)"),
    (spoil(lower_bound=0.0), r"gate_lower_bound must be a finite number < 0 \(or None\); got 0.0"),
    (spoil(lower_bound=float("nan")), "gate_lower_bound must be a finite number < 0"),
])
def test_vllm_s_rules_name_the_bad_argument_and_nothing_is_written(change, message):
    args, pages = kc.kimi_call(3, 2, 6, seed=6)
    before = pages.clone()
    change(args)
    with pytest.raises(ValueError, match=message):
        run(args)
    assert torch.equal(pages, before)


def test_the_bounded_gate_is_lower_bound_times_a_sigmoid():
    a = torch.tensor([[[-30.0, 0.0, 2.0, 40.0]]])
    A_log, dt = torch.tensor([0.0]), torch.zeros(1, 4)
    g = cudelta.kda_gate(a, A_log, dt, -5.0)
    torch.testing.assert_close(g, -5.0 * torch.sigmoid(a))
    assert float(g.min()) >= -5.0 and float(g.max()) < 0  # decays in [e^-5, 1): bounded below, unlike softplus
    assert float(cudelta.kda_gate(a, A_log, dt)[0, 0, 3]) == pytest.approx(-40.0)


def test_kda_decode_takes_the_bounded_gate_and_other_calls_refuse_it():
    gen = torch.Generator().manual_seed(9)
    N, H, K = 2, 1, 64
    q, k, v = (torch.randn(N, H, K, generator=gen) for _ in range(3))
    a, b = torch.randn(N, H, K, generator=gen), torch.randn(N, H, generator=gen)
    A_log, dt = torch.randn(H, generator=gen), torch.randn(H, K, generator=gen)
    state = torch.randn(3, H, K, K, generator=gen) * 0.1
    idx = torch.tensor([2, 0])
    s1, s2 = state.clone(), state.clone()
    g = cudelta.kda_gate(a, A_log, dt, -2.5)
    bounded = cudelta.kda_decode(q, k, v, None, None, s1, idx, a=a, b=b, A_log=A_log, dt_bias=dt, gate_lower_bound=-2.5)
    given = cudelta.kda_decode(q, k, v, g, torch.sigmoid(b), s2, idx)
    assert torch.equal(bounded, given) and torch.equal(s1, s2)
    with pytest.raises(ValueError, match="gate_lower_bound=-2.5 needs kda_decode with the raw gate a"):
        cudelta.kda_decode(q, k, v, g, torch.sigmoid(b), state, idx, gate_lower_bound=-2.5)
    with pytest.raises(TypeError):
        cudelta.gdn_decode(q, k, v[:, :, :], None, None, state, idx, gate_lower_bound=-2.5)


def test_the_conv_reference_reads_vllm_s_tap_major_kda_weight():
    gen = torch.Generator().manual_seed(2)
    seg, width = 8, 4
    w3 = torch.randn(3, width, seg, generator=gen)
    w2 = torch.cat([w3[s].T for s in range(3)])  # [dim, width]
    x = torch.randn(2, 3 * seg, generator=gen)
    cs1 = torch.randn(3, 3 * seg, width - 1, generator=gen)
    cs2 = cs1.clone()
    idx = torch.tensor([2, 1])
    o1 = causal_conv1d_update_reference(x, cs1, w3, None, "silu", idx)
    o2 = causal_conv1d_update_reference(x, cs2, w2, None, "silu", idx)
    assert torch.equal(o1, o2) and torch.equal(cs1, cs2)
    with pytest.raises(ValueError, match=r"weight must be \[dim=24, width >= 2\], or \[segments, width"):
        causal_conv1d_update_reference(x, cs1, w3[:, :, :5], None, "silu", idx)
