"""The PyTorch reference against a per-request, per-head float64 loop written straight from the decode
step in ARCHITECTURE.md."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import cudelta  # noqa: E402
from cudelta.reference import (  # noqa: E402
    HEAD_DIMS,
    gdn_decode_reference,
    gdn_gate,
    kda_decode_reference,
    kda_gate,
)
from decode_loop import inputs, loop_reference, raw_gates  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/step_tolerance.py
from step_tolerance import assert_each_element_close, step_magnitudes  # noqa: E402


def assert_untouched_slots_bit_identical(state, before, idx, lowest=0):
    named = {int(s) for s in idx.tolist() if lowest <= s < state.shape[0]}
    untouched = [s for s in range(state.shape[0]) if s not in named]
    assert untouched and torch.equal(state[untouched], before[untouched]), "a slot not named by idx changed"


SERVED_HEAD_DIMS = [(K, V) for K in HEAD_DIMS for V in HEAD_DIMS]
# The fp32 reference against float64, element by element (tests/step_tolerance.py): a sum over K
# in fp32 is off by a few eps32 of the sum of its |terms|; 4e-6 is 32 eps32.
REFERENCE_REL = 4e-6


def assert_matches_the_loop(out, state, expected, expected_state, mags):
    assert_each_element_close(out, expected, mags.out, "output", rel=REFERENCE_REL)
    assert_each_element_close(state, expected_state, mags.state, "state", rel=REFERENCE_REL)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("K,V", SERVED_HEAD_DIMS)
def test_gdn_matches_the_loop_and_skips_invalid_slots(layout, l2norm, K, V):
    q, k, v, g, beta, state, idx = inputs(K=K, V=V, layout=layout)
    before = state.clone()
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, 0.25, l2norm, layout)
    out = gdn_decode_reference(q, k, v, g, beta, state, idx, scale=0.25, use_qk_l2norm=l2norm, layout=layout)
    mags = step_magnitudes(q, k, v, g, beta, before, idx, scale=0.25, use_qk_l2norm=l2norm, layout=layout)
    assert_matches_the_loop(out, state, expected, expected_state, mags)
    assert torch.all(out[1] == 0) and torch.all(out[4] == 0)
    assert_untouched_slots_bit_identical(state, before, idx)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V", SERVED_HEAD_DIMS)
def test_kda_per_channel_decay_matches_the_loop(layout, K, V):
    q, k, v, g, beta, state, idx = inputs(K=K, V=V, kda=True, layout=layout)
    before = state.clone()
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, K ** -0.5, True, layout)
    out = kda_decode_reference(q, k, v, g, beta, state, idx, use_qk_l2norm=True, layout=layout)
    mags = step_magnitudes(q, k, v, g, beta, before, idx, use_qk_l2norm=True, layout=layout)
    assert_matches_the_loop(out, state, expected, expected_state, mags)
    assert_untouched_slots_bit_identical(state, before, idx)


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("K,V", SERVED_HEAD_DIMS)
def test_bf16_state_at_every_head_dim_is_one_rounding_of_the_loop(kda, K, V):
    q, k, v, g, beta, state, idx = inputs(K=K, V=V, kda=kda, layout="vk", state_dtype=torch.bfloat16)
    before = state.clone()
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, 0.125, True, "vk")
    ref = kda_decode_reference if kda else gdn_decode_reference
    out = ref(q, k, v, g, beta, state, idx, scale=0.125, use_qk_l2norm=True, layout="vk")
    mags = step_magnitudes(q, k, v, g, beta, before, idx, scale=0.125, use_qk_l2norm=True, layout="vk")
    assert_matches_the_loop(out, state, expected, expected_state, mags)
    assert_untouched_slots_bit_identical(state, before, idx)


def test_the_per_element_check_catches_an_error_the_largest_value_would_hide():
    # An element 100x smaller than the largest, off by 5% of itself: well inside 1e-4 of the largest
    # value (the old measure), far outside its own tolerance.
    q, k, v, g, beta, state, idx = inputs(K=64, V=64)
    before = state.clone()
    out = gdn_decode_reference(q, k, v, g, beta, state, idx, scale=0.25)
    mags = step_magnitudes(q, k, v, g, beta, before, idx, scale=0.25)
    flat = out.abs().reshape(-1)
    small = int(((flat - flat.max() / 100).abs() + (flat == 0) * 1e9).argmin())
    bad = out.clone()
    bad.view(-1)[small] *= 1.05
    assert (bad - out).abs().max() / out.abs().max() < 1e-3
    with pytest.raises(AssertionError, match=r"output\[.*\]: .* > tolerance"):
        assert_each_element_close(bad, out, mags.out, "output")


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_raw_gates_are_fused_as_the_formulas_say(kda, layout):
    q, k, v, _g, _beta, state, idx = inputs(kda=kda, layout=layout)
    a, b, A_log, dt_bias = raw_gates(5, 4, 64, kda)
    expected_state = state.clone()
    expected = loop_reference(q, k, v, None, None, expected_state, idx, 0.125, True, layout, a=a, b=b, A_log=A_log,
                              dt_bias=dt_bias)
    ref = kda_decode_reference if kda else gdn_decode_reference
    out = ref(q, k, v, None, None, state, idx, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=0.125,
              use_qk_l2norm=True, layout=layout)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)


def test_raw_and_precomputed_halves_mix():
    q, k, v, g, _beta, state, idx = inputs()
    _a, b, _A_log, _dt = raw_gates(5, 4, 64, False)
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, None, expected_state, idx, 0.125, False, b=b)
    out = gdn_decode_reference(q, k, v, g, None, state, idx, b=b, scale=0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_bf16_state_is_read_and_written_as_bf16_with_fp32_math(layout):
    q, k, v, g, beta, state, idx = inputs(layout=layout, state_dtype=torch.bfloat16)
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, 0.125, True, layout)
    out = gdn_decode_reference(q, k, v, g, beta, state, idx, scale=0.125, use_qk_l2norm=True, layout=layout)
    assert state.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # same bf16 inputs, fp32 vs fp64 math
    # one bf16 rounding of the same value, or its neighbour where fp32 and fp64 straddle a tie
    torch.testing.assert_close(state.float(), expected_state.float(), rtol=8e-3, atol=1e-5)


def test_nonpositive_rule_makes_slot_0_a_null_block():
    q, k, v, g, beta, state, idx = inputs()
    before = state.clone()
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, 0.125, True, lowest=1)
    out = gdn_decode_reference(q, k, v, g, beta, state, idx, scale=0.125, use_qk_l2norm=True,
                               invalid_slot="nonpositive")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(out[2] == 0)  # idx[2] == 0
    assert torch.equal(state[0], before[0])
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)


def test_out_buffer_is_written_and_returned():
    q, k, v, g, beta, state, idx = inputs()
    expected = gdn_decode_reference(q, k, v, g, beta, state.clone(), idx)
    buf = torch.full_like(v, float("nan"))
    out = gdn_decode_reference(q, k, v, g, beta, state, idx, out=buf)
    assert out is buf
    torch.testing.assert_close(buf, expected)  # every element written: no NaN left, zeros for skipped requests


def test_slots_not_named_stay_bit_identical():
    q, k, v, g, beta, state, idx = inputs()
    before = state.clone()
    gdn_decode_reference(q, k, v, g, beta, state, idx)
    for s in (1, 2, 4, 5):
        assert torch.equal(state[s], before[s])


def test_gates_follow_the_formulas():
    a, A_log, dt = torch.tensor([[0.5, 30.0]]), torch.tensor([0.1, -0.2]), torch.tensor([0.3, 0.0])
    expected = -torch.exp(A_log) * torch.nn.functional.softplus(a + dt)
    torch.testing.assert_close(gdn_gate(a, A_log, dt), expected)
    assert gdn_gate(a, A_log, dt)[0, 1] == pytest.approx(-torch.exp(torch.tensor(-0.2)).item() * 30.0)  # threshold 20
    ak, dtk = torch.randn(1, 2, 3), torch.randn(2, 3)
    torch.testing.assert_close(kda_gate(ak, A_log, dtk),
                               -torch.exp(A_log)[:, None] * torch.nn.functional.softplus(ak + dtk))


@pytest.mark.parametrize("K,V,bad", [(96, 64, "K=96"), (64, 32, "V=32"), (512, 64, "K=512")])
def test_head_dims_outside_64_128_256_are_named(K, V, bad):
    q, k, v, g, beta, state, idx = inputs(K=K, V=V)
    with pytest.raises(ValueError, match=f"{bad} is not supported; accepted: 64, 128, 256"):
        gdn_decode_reference(q, k, v, g, beta, state, idx)
    with pytest.raises(ValueError, match=f"{bad} is not supported"):
        cudelta.gdn_decode(q, k, v, g, beta, state, idx)  # the public API says the same on any device


def test_bad_arguments_are_named():
    q, k, v, g, beta, state, idx = inputs()
    a, b, A_log, dt_bias = raw_gates(5, 4, 64, False)
    with pytest.raises(ValueError, match=r"state must be \[P, 4, 64, 64\]"):
        gdn_decode_reference(q, k, v, g, beta, state[:, :, :8], idx)
    with pytest.raises(ValueError, match="layout='kvx'"):
        gdn_decode_reference(q, k, v, g, beta, state, idx, layout="kvx")
    with pytest.raises(ValueError, match="KDA g must be"):
        kda_decode_reference(q, k, v, g, beta, state, idx)
    with pytest.raises(ValueError, match="invalid_slot='zero'.*negative.*nonpositive"):
        gdn_decode_reference(q, k, v, g, beta, state, idx, invalid_slot="zero")
    with pytest.raises(ValueError, match="either g or the raw gate"):
        gdn_decode_reference(q, k, v, g, beta, state, idx, a=a, A_log=A_log, dt_bias=dt_bias)
    with pytest.raises(ValueError, match="missing dt_bias"):
        gdn_decode_reference(q, k, v, None, beta, state, idx, a=a, A_log=A_log)
    with pytest.raises(ValueError, match="exactly one of beta"):
        gdn_decode_reference(q, k, v, g, beta, state, idx, b=b)
    with pytest.raises(ValueError, match="state dtype torch.float16"):
        gdn_decode_reference(q, k, v, g, beta, state.half(), idx)
    with pytest.raises(ValueError, match=r"out must be a torch.float32 tensor of shape \[5, 4, 64\]"):
        gdn_decode_reference(q, k, v, g, beta, state, idx, out=torch.empty(5, 4, 32))


def test_the_public_api_on_cpu_takes_every_option():
    q, k, v, _g, _beta, state, idx = inputs(layout="vk", state_dtype=torch.bfloat16)
    a, b, A_log, dt_bias = raw_gates(5, 4, 64, False)
    before = state.clone()
    expected_state = state.clone()
    expected = loop_reference(q, k, v, None, None, expected_state, idx, 64 ** -0.5, False, "vk", lowest=1, a=a, b=b,
                              A_log=A_log, dt_bias=dt_bias)
    buf = torch.full_like(v, float("nan"))
    out = cudelta.gdn_decode(q, k, v, None, None, state, idx, a=a, b=b, A_log=A_log, dt_bias=dt_bias, layout="vk",
                             invalid_slot="nonpositive", out=buf)
    assert out is buf
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)  # bf16 state read, fp32 vs fp64 math
    assert torch.all(out[1] == 0) and torch.all(out[2] == 0) and torch.all(out[4] == 0)  # slots -1, 0, 9 (P=7)
    torch.testing.assert_close(state.float(), expected_state.float(), rtol=8e-3, atol=1e-5)  # one bf16 rounding
    for s in (0, 1, 2, 4, 5):  # 0: the null block under "nonpositive"; the others named by no request
        assert torch.equal(state[s], before[s])


def test_the_fla_drop_in_updates_vllm_s_pool_in_place():
    q, k, v, g, beta, state, idx = inputs(layout="vk")
    idx = torch.tensor([3, -1, 0, 6, 2])  # vLLM: slot 0 is the null block
    pool = state.clone()
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, 64 ** -0.5, True, "vk", lowest=1)
    o, final = cudelta.fused_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], initial_state=state,
        inplace_final_state=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
    assert final is state and o.shape == (5, 1, 4, 64)
    torch.testing.assert_close(o[:, 0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
    assert torch.all(o[1] == 0) and torch.all(o[2] == 0)
    # the varlen form: B=1, one token per sequence; the same step on the same pool
    o2, final2 = cudelta.fused_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=pool,
        cu_seqlens=torch.arange(6), ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
    assert o2.shape == (1, 5, 4, 64) and final2 is pool
    torch.testing.assert_close(o2[0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, expected_state, rtol=1e-5, atol=1e-5)


def test_the_fla_drop_in_refuses_what_is_not_a_decode_step():
    q, k, v, g, beta, state, idx = inputs(layout="vk")
    two = lambda x: torch.stack([x, x], 1)  # noqa: E731
    with pytest.raises(ValueError, match="T must be 1"):
        cudelta.fused_recurrent_gated_delta_rule(two(q), two(k), two(v), two(g), two(beta), initial_state=state,
                                                 ssm_state_indices=idx)
    with pytest.raises(ValueError, match="inplace_final_state=False"):
        cudelta.fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                 initial_state=state, inplace_final_state=False)
