"""The PyTorch reference against a per-request, per-head loop written straight from DESIGN.md."""

import pytest

torch = pytest.importorskip("torch")

from cudelta.reference import (  # noqa: E402
    gdn_decode_reference,
    gdn_gate,
    kda_decode_reference,
    kda_gate,
)


def loop_reference(q, k, v, g, beta, state, idx, scale, l2norm, layout="kv"):
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    out = torch.zeros(N, HV, V, dtype=v.dtype)
    for n in range(N):
        s = int(idx[n])
        if s < 0 or s >= state.shape[0]:
            continue
        for hv in range(HV):
            h_ = hv // (HV // H)
            qq, kk = q[n, h_].double(), k[n, h_].double()
            if l2norm:
                qq = qq / torch.sqrt((qq * qq).sum() + 1e-6)
                kk = kk / torch.sqrt((kk * kk).sum() + 1e-6)
            qq = qq * scale
            h = state[s, hv].double()
            if layout == "vk":
                h = h.T
            gg = g[n, hv].double()
            h = h * (torch.exp(gg)[:, None] if gg.dim() == 1 else torch.exp(gg))
            u = beta[n, hv].double() * (v[n, hv].double() - h.T @ kk)
            h = h + torch.outer(kk, u)
            out[n, hv] = (h.T @ qq).to(v.dtype)
            state[s, hv] = (h.T if layout == "vk" else h).to(state.dtype)
    return out


def inputs(N=5, H=2, HV=4, K=16, V=8, P=7, kda=False, layout="kv", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(N, H, K, generator=gen), torch.randn(N, H, K, generator=gen)
    v = torch.randn(N, HV, V, generator=gen)
    g = -torch.rand(N, HV, K, generator=gen) if kda else -torch.rand(N, HV, generator=gen)
    beta = torch.rand(N, HV, generator=gen)
    shape = (P, HV, K, V) if layout == "kv" else (P, HV, V, K)
    state = torch.randn(*shape, generator=gen)
    idx = torch.tensor([3, -1, 0, 6, 9][:N])  # -1 and 9 (>= P) are skipped
    return q, k, v, g, beta, state, idx


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("l2norm", [True, False])
def test_gdn_matches_the_loop_and_skips_invalid_slots(layout, l2norm):
    q, k, v, g, beta, state, idx = inputs(layout=layout)
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, 0.25, l2norm, layout)
    out = gdn_decode_reference(q, k, v, g, beta, state, idx, scale=0.25, use_qk_l2norm=l2norm, layout=layout)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
    assert torch.all(out[1] == 0) and torch.all(out[4] == 0)


def test_kda_per_channel_decay_matches_the_loop():
    q, k, v, g, beta, state, idx = inputs(kda=True)
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, 16 ** -0.5, True)
    out = kda_decode_reference(q, k, v, g, beta, state, idx, use_qk_l2norm=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)


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


def test_bad_shapes_are_named():
    q, k, v, g, beta, state, idx = inputs()
    with pytest.raises(ValueError, match=r"state must be \[P, 4, 16, 8\]"):
        gdn_decode_reference(q, k, v, g, beta, state[:, :, :8], idx)
    with pytest.raises(ValueError, match="layout='kvx'"):
        gdn_decode_reference(q, k, v, g, beta, state, idx, layout="kvx")
    with pytest.raises(ValueError, match="KDA g must be"):
        kda_decode_reference(q, k, v, g, beta, state, idx)
