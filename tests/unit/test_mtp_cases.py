"""The case builder and checker that tests/gpu/test_mtp_gpu.py runs the kernels through
(tests/mtp_cases.py), on CPU tensors: cases of the GPU suite pass it with the PyTorch reference in the
kernels' place; it fails a call that is wrong in each way the GPU suite is there to catch; the
matrix holds every pair of option values; and the tolerances it uses bound what they claim to."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/mtp_cases.py, tests/step_tolerance.py
import mtp_cases as mc  # noqa: E402
from decode_loop import loop_gates  # noqa: E402
from step_tolerance import epilogue_tolerance, step_magnitudes, token_magnitudes, ulp  # noqa: E402

import cudelta  # noqa: E402


def test_the_gpu_matrix_holds_every_pair_of_option_values():
    names = list(mc.FACTORS)
    missing = [(a, x, b, y) for i, a in enumerate(names) for b in names[i + 1:] for x in mc.FACTORS[a]
               for y in mc.FACTORS[b]
               if not any(getattr(c, a) == x and getattr(c, b) == y for c in mc.MATRIX)]
    assert not missing, f"pairs no case of the matrix holds: {missing[:5]}"
    # at least (token forms) x (the next widest option's values) calls; the greedy stays near that
    assert 30 <= len(mc.MATRIX) <= 36
    every = mc.MATRIX + mc.HEAD_DIMS + mc.ENGINE + mc.VLLM_CALLS
    assert len({c.id for c in every}) == len(every), "two GPU cases share an id"


def test_pairwise_on_a_small_design_is_smaller_than_the_product_and_complete():
    factors = {"a": (1, 2, 3), "b": ("x", "y", "z"), "c": (True, False), "d": ("p", "q"), "e": ("u", "v")}
    rows = mc.pairwise(factors)
    assert len(rows) < 3 * 3 * 2 * 2 * 2
    for a, b in [(a, b) for i, a in enumerate(factors) for b in list(factors)[i + 1:]]:
        assert {(r[a], r[b]) for r in rows} == {(x, y) for x in factors[a] for y in factors[b]}
    assert mc.pairwise(factors) == rows  # deterministic: the GPU ids never change between runs


# A quarter of the matrix, other head dims, and vLLM's call, on the CPU.
CPU_CASES = mc.MATRIX[::4] + [mc.HEAD_DIMS[1], mc.HEAD_DIMS[8], mc.VLLM_CALLS[-1]]


@pytest.mark.parametrize("case", CPU_CASES, ids=mc.case_id)
def test_the_reference_passes_the_checker(case):
    mc.run_and_check(case, "cpu")


def test_the_fused_epilogue_check_passes_for_the_reference():
    mc.check_fused_epilogue(mc.Case(kind="kda", tokens="T3", slots="ckpt", epilogue="sigmoid", K=64, V=64, seed=7),
                            "cpu")


def test_two_runs_of_one_call_compare_equal():
    case = mc.Case(state="fp32", K=64, V=64, seed=8)
    a, b = mc.build(case, "cpu"), mc.build(case, "cpu")
    before = mc.snapshot(a)
    mc.compare(case, a, mc.call(case, a), b, mc.call(case, b), before)


# --- the checker fails a call that is wrong -----------------------------------------------------------------

# fp32 outputs and state: what is wrong is not hidden under a bf16 rounding
EXACT = mc.Case(kind="gdn", state="fp32", io="fp32", tokens="varlen", slots="accepted", epilogue="none", K=64, V=64,
                seed=11)


def run_wrong(case, wrong_call=None, after=None, call_case=None, match=""):
    """Runs the case on the CPU, with the call (or its result) made wrong, and expects the checker to
    say so with `match`."""
    step = mc.build(case, "cpu")
    before = mc.snapshot(step)
    out = wrong_call(step) if wrong_call else mc.call(call_case or case, step)
    if after:
        after(step, out)
    with pytest.raises(AssertionError, match=match):
        mc.check(case, step, before, out)


def ran_token(case):
    """A token of a request that has a starting slot (its output and state are computed)."""
    step = mc.build(case, "cpu")
    exp = mc.expect(case, mc.snapshot(step))
    return int((~exp.zero).nonzero()[0])


def test_it_fails_an_output_element_off_by_a_thousandth():
    def nudge(step, out):
        token = out[ran_token(EXACT)]
        token.view(-1)[token.abs().argmax()] *= 1.001  # its largest element: the one most sure to be seen

    run_wrong(EXACT, after=nudge, match=r"^output\[")


def test_it_fails_a_stored_state_element_off_by_a_thousandth():
    def nudge(step, out):
        slot = sorted(mc.expect(EXACT, mc.snapshot(step)).mags.state)[0]
        step.state[slot, 0, 3, 4] *= 1.001

    # the nudge changes a byte the call may write, so only the tolerance check can see it
    run_wrong(EXACT, after=nudge, match=r"^state stored\[slot ")


def test_it_fails_an_output_element_left_unwritten():
    run_wrong(EXACT, after=lambda step, out: out[ran_token(EXACT), 0, 0].fill_(float("nan")),
              match="never written")


def test_it_fails_an_output_for_a_request_without_a_starting_slot():
    def leak(step, out):
        exp = mc.expect(EXACT, mc.snapshot(step))
        out[int(exp.zero.nonzero()[0]), 0, 0] = 1e-3

    run_wrong(EXACT, after=leak, match="no starting slot .* but a non-zero output")


@pytest.mark.parametrize("where", ["padding", "conv state", "a slot not written"])
def test_it_fails_a_changed_byte_outside_the_written_blocks(where):
    case = replace(EXACT, pool="pages")

    def flip(step, out):
        written = sorted(mc.expect(case, mc.snapshot(step)).mags.state)
        untouched = [s for s in range(step.state.shape[0]) if s not in written][0]
        at = {"padding": step.base + written[0] * step.slot_bytes + step.block_bytes + 3,
              "conv state": written[-1] * step.slot_bytes + 17,
              "a slot not written": step.base + untouched * step.slot_bytes + 100}[where]
        step.storage[at] ^= 1

    run_wrong(case, after=flip, match="bytes changed that the call must not write")


@pytest.mark.parametrize("wrong", ["default eps", "other activation"])
def test_it_fails_an_epilogue_with_the_wrong_eps_or_activation(wrong):
    case = replace(EXACT, epilogue="silu", eps=1e-2)
    call_case = replace(case, eps=None) if wrong == "default eps" else replace(case, epilogue="sigmoid")
    run_wrong(case, call_case=call_case, match="^output after the silu epilogue")


def test_it_fails_a_call_that_ignores_the_accepted_tokens():
    def from_column_0(step):
        args, kw = mc.call_args(EXACT, step.t, step.out)
        del kw["num_accepted_tokens"]
        return cudelta.gdn_decode(*args, step.state, step.t["idx"], **kw)

    run_wrong(EXACT, wrong_call=from_column_0, match="output")


def test_it_fails_a_call_that_takes_the_null_block_for_a_state():
    case = replace(EXACT, rule="nonpositive")
    run_wrong(case, call_case=replace(case, rule="negative"), match="non-zero output|bytes changed")


def test_it_fails_a_bf16_state_reread_between_tokens():
    # The state is carried in fp32 from token to token; a call that stored and re-read it in bf16 after
    # every token is off by about 2^-9 of the state per token, which fp32 outputs show.
    case = mc.Case(tokens="T4", slots="final", state="bf16", io="fp32", epilogue="none", gates="pre",
                   rule="negative", pool="contiguous", K=64, V=64, seed=12)

    def token_by_token(step):
        t = step.t
        outs = [cudelta.gdn_decode(t["q"][:, i], t["k"][:, i], t["v"][:, i], t["g"][:, i], t["beta"][:, i],
                                   step.state, t["idx"], use_qk_l2norm=True, layout=case.layout)
                for i in range(4)]
        return step.out.copy_(torch.stack(outs, dim=1))

    run_wrong(case, wrong_call=token_by_token, match="output|state stored")


# --- the builder -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [mc.Case(seed=3), mc.Case(tokens="T4", slots="ckpt", rule="negative", seed=4),
                                  mc.Case(tokens="T2", slots="final", rule="negative", seed=5)], ids=mc.case_id)
def test_the_builder_is_deterministic_and_singles_out_the_contract_s_rows(case):
    a, b = mc.build(case, "cpu"), mc.build(case, "cpu")
    for name, x in a.t.items():
        assert (x is None and b.t[name] is None) or torch.equal(x, b.t[name]), name
    assert torch.equal(a.storage, b.storage)
    idx, acc, P = a.t["idx"], a.t["accepted"], a.state.shape[0]
    lowest = mc.LOWEST[case.rule]
    valid = (idx >= lowest) & (idx < P)
    named = idx[valid].tolist()
    assert len(named) == len(set(named)), "a slot named twice"
    assert len(set(range(P)) - set(named)) >= 3, "no slot left that no request names"
    assert (0 in named) == (case.rule == "negative")  # slot 0: a state, or the null block
    starts = [mc._start(idx, acc, n, lowest, P) for n in range(len(a.lens))]
    assert any(s is None and T for s, T in zip(starts, a.lens)), "no request with tokens lacks a start"
    if idx.dim() == 2:
        assert bool((idx >= P).any()), "no column past the pool"
        assert any(not valid[n].all() and starts[n] is not None for n in range(len(a.lens))), "no holes"
    if acc is not None:
        C = idx.shape[1]
        assert {0, C + 1, 1, C} <= set(acc.tolist())
        assert any(1 <= acc[n] < C and starts[n] is not None and a.lens[n] for n in range(len(a.lens))), \
            "no rejected draft"
    if case.tokens == "varlen":
        assert 0 in a.lens and int(a.t["cu_seqlens"][-1]) == a.t["q"].shape[0] - mc.PAD_TOKENS


def test_every_gpu_case_names_each_slot_once_and_runs_some_requests_but_not_all():
    gpu_cases = mc.MATRIX + mc.HEAD_DIMS + mc.ENGINE + mc.VLLM_CALLS
    for case in gpu_cases:
        lens = mc.token_lens(case)
        idx, acc, P = mc._slots(case, lens, torch.Generator().manual_seed(case.seed))
        lowest = mc.LOWEST[case.rule]
        named = idx[(idx >= lowest) & (idx < P)].tolist()
        assert len(named) == len(set(named)), case.id
        assert (0 in named) == (case.rule == "negative"), case.id
        starts = [mc._start(idx, acc, n, lowest, P) for n in range(len(lens))]
        assert any(s is not None and T for s, T in zip(starts, lens)), f"{case.id}: no request runs"
        if len(lens) > 2:
            assert any(s is None and T for s, T in zip(starts, lens)), f"{case.id}: every request has a start"


def test_another_seed_changes_the_values_not_the_shapes():
    case = mc.Case(seed=20)
    a, b = mc.build(case, "cpu"), mc.build(replace(case, seed=21), "cpu")
    for name, x in a.t.items():
        if x is not None:
            assert x.shape == b.t[name].shape and x.dtype == b.t[name].dtype, name
    assert a.storage.shape == b.storage.shape
    assert not torch.equal(a.t["idx"], b.t["idx"]) and not torch.equal(a.t["cu_seqlens"], b.t["cu_seqlens"])


# --- the tolerances ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_vectorised_gates_equal_the_loop_s(kind):
    t = mc.build(mc.Case(kind=kind, gates="raw", K=64, V=64, seed=30), "cpu").t
    g, beta = mc.gates64(t, kind)
    g_loop, beta_loop = loop_gates(None, None, t["a"], t["b"], t["A_log"], t["dt_bias"])
    torch.testing.assert_close(g, g_loop, rtol=1e-14, atol=0)
    torch.testing.assert_close(beta, beta_loop, rtol=1e-14, atol=0)


def test_token_magnitudes_of_one_token_each_are_the_step_s():
    case = mc.Case(tokens="single", slots="final", gates="pre", layout="kv", rule="negative", seed=31)
    t = mc.build(case, "cpu")
    q, k, v, g, beta, idx = (t.t[n] for n in ("q", "k", "v", "g", "beta", "idx"))
    step = step_magnitudes(q, k, v, g, beta, t.state, idx, use_qk_l2norm=True)
    tokens = token_magnitudes(q, k, v, g, beta, t.state, idx, list(range(len(idx) + 1)), use_qk_l2norm=True)
    torch.testing.assert_close(tokens.out, step.out, rtol=0, atol=0)
    valid = [int(s) for s in idx if 0 <= s < t.state.shape[0]]
    assert sorted(tokens.state) == sorted(valid)
    for s in valid:
        torch.testing.assert_close(tokens.state[s], step.state[s], rtol=0, atol=0)


def test_token_magnitudes_store_at_the_slots_the_contract_names():
    # tests/unit/test_multi_token.py's example: token counts 3, 1, 0, 4, 2, 2 against this idx, accepted
    idx = torch.tensor([[1, 2, 3, -1], [4, 5, -1, -1], [6, 7, 8, 9], [10, -1, 11, 12], [13, -1, -1, -1],
                        [14, 99, 15, 0]])
    accepted = torch.tensor([2, 1, 4, 1, 0, 3])
    cu = [0, 3, 4, 4, 8, 10, 12]
    L, H, K = 12, 1, 64
    ones = torch.ones(L, H, K)
    # beta = 0: no update, so token t's state is exp(-(t + 1)) times the starting one, and what it counts
    # shows the weighting alone
    m = token_magnitudes(ones, ones, torch.ones(L, 1, K), -torch.ones(L, 1), torch.zeros(L, 1),
                         torch.ones(16, 1, K, K), idx, cu, accepted=accepted)
    assert sorted(m.state) == [1, 2, 3, 4, 10, 11, 12, 14]
    assert torch.all(m.out[8:10] == 0) and torch.all(m.out[:8] > 0)  # request 4: no starting column
    e = torch.exp(torch.tensor(-1.0, dtype=torch.float64))
    for t, slot in enumerate([1, 2, 3]):  # request 0: token t stored at idx[0, t], counting t + 1 steps
        torch.testing.assert_close(m.out[t], (t + 1) * e ** (t + 1) * m.out[0] / e, rtol=1e-12, atol=0)
        torch.testing.assert_close(m.state[slot], torch.full((1, K, K), float((t + 1) * e ** (t + 1)),
                                                             dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", range(6))
def test_the_epilogue_tolerance_bounds_what_the_output_s_tolerance_does(seed):
    # y of an o moved by up to o_tol per element (each way, and all toward a smaller mean) stays within
    # the tolerance minus its own ulp and fp32 shares
    gen = torch.Generator().manual_seed(seed)
    o = (torch.randn(5, 3, 64, generator=gen, dtype=torch.float64) * 0.1).to(torch.bfloat16).double()
    o[0, 0] *= 1e-3  # a head of tiny outputs: eps dominates
    z, w = torch.randn(5, 3, 64, generator=gen, dtype=torch.float64), 1 + torch.rand(64, generator=gen).double()
    o_tol = ulp(torch.bfloat16, o) * (1 + torch.rand(o.shape, generator=gen, dtype=torch.float64))

    def y_of(x, act):
        gate = torch.sigmoid(z) if act == "sigmoid" else z * torch.sigmoid(z)
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-3) * w * gate

    for act in ("silu", "sigmoid"):
        y = y_of(o, act)
        bound = epilogue_tolerance(y, o, o_tol, z, w, 1e-3, act, rel=0) - ulp(torch.float64, y)
        sign = torch.randint(0, 2, o.shape, generator=gen).double() * 2 - 1
        for moved in (o + sign * o_tol, o - o.sign() * o_tol, o + o.sign() * o_tol):
            assert torch.all((y_of(moved, act) - y).abs() <= bound), act
