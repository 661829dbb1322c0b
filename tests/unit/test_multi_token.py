"""Several tokens per request (speculative decoding), per-token state checkpoints, the accepted-token
start, the gated RMSNorm epilogue and vLLM's padded pool: the PyTorch reference against the float64
loop of decode_loop.py, and the rules of the contract (ARCHITECTURE.md, "The decode step")."""

import pytest

torch = pytest.importorskip("torch")

import cudelta  # noqa: E402
from cudelta.reference import gated_rms_norm, gdn_decode_reference, kda_decode_reference  # noqa: E402
from decode_loop import loop_reference, random_pool, token_inputs, vllm_pool  # noqa: E402

P = 16
# Six requests: token counts 3, 1, 0, 4, 2, 2 (T varies; one request has none), slot columns C = 4.
LENS = [3, 1, 0, 4, 2, 2]
IDX = torch.tensor([
    [1, 2, 3, -1],  # accepted 2 of the last step: starts at slot 2, stores 1, 2, 3
    [4, 5, -1, -1],  # accepted 1: starts at 4
    [6, 7, 8, 9],  # no tokens: nothing is read or written
    [10, -1, 11, 12],  # token 1's state is not stored (invalid slot), token 2 goes on from it in fp32
    [13, -1, -1, -1],  # accepted 0: no starting slot; zero outputs, nothing written
    [14, 99, 15, 0],  # accepted 3: starts at 15, stores token 0 at 14; 99 >= P is not written
])
ACCEPTED = torch.tensor([2, 1, 4, 1, 0, 3])


def run_both(kind, t, state, idx, *, gates="pre", layout="kv", l2norm=True, lowest=0, accepted=None, epilogue=None,
             dense_T=None, scale=0.2):
    """(reference output, loop output, loop's pool) for the same step; the reference updates `state`."""
    loop_state = state.clone()
    gate = dict(g=t["g"], beta=t["beta"]) if gates == "pre" else dict(g=None, beta=None, a=t["a"], b=t["b"],
                                                                      A_log=t["A_log"], dt_bias=t["dt_bias"])
    raw = {} if gates == "pre" else dict(a=gate["a"], b=gate["b"], A_log=gate["A_log"], dt_bias=gate["dt_bias"])
    tensors = dict(q=t["q"], k=t["k"], v=t["v"], g=gate["g"], beta=gate["beta"], a=raw.get("a"), b=raw.get("b"))
    token_args = dict(cu_seqlens=t["cu_seqlens"])
    if dense_T is not None:  # [N, T, ...]: the same tokens, reshaped
        tensors = {n: None if x is None else x.reshape(-1, dense_T, *x.shape[1:]) for n, x in tensors.items()}
        token_args = {}
    ep = {} if epilogue is None else dict(output_gate=t["z"] if dense_T is None else t["z"].reshape(
        -1, dense_T, *t["z"].shape[1:]), norm_weight=t["w"], norm_eps=1e-5, gate_activation=epilogue)
    ref = kda_decode_reference if kind == "kda" else gdn_decode_reference
    out = ref(tensors["q"], tensors["k"], tensors["v"], tensors["g"], tensors["beta"], state, idx,
              a=tensors["a"], b=tensors["b"], A_log=raw.get("A_log"), dt_bias=raw.get("dt_bias"), scale=scale,
              use_qk_l2norm=l2norm, layout=layout, invalid_slot="negative" if lowest == 0 else "nonpositive",
              num_accepted_tokens=accepted, **token_args, **ep)
    expected = loop_reference(tensors["q"], tensors["k"], tensors["v"], tensors["g"], tensors["beta"], loop_state,
                              idx, scale, l2norm, layout, lowest, tensors["a"], tensors["b"], raw.get("A_log"),
                              raw.get("dt_bias"), cu_seqlens=token_args.get("cu_seqlens"), accepted=accepted,
                              z=ep.get("output_gate"), norm_weight=t["w"], eps=1e-5, act=epilogue or "silu")
    return out, expected, loop_state


def written_slots(idx, lens, accepted, lowest=0):
    """The slots a step may write: the checkpoints of requests that have a starting slot and tokens."""
    slots = set()
    for n, T in enumerate(lens):
        acc = int(accepted[n])
        if T and 1 <= acc <= idx.shape[1] and lowest <= int(idx[n, acc - 1]) < P:
            slots |= {int(s) for s in idx[n, :T] if lowest <= int(s) < P}
    return slots


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
@pytest.mark.parametrize("gates", ["pre", "raw"])
def test_tokens_checkpoints_and_accepted_start_match_the_loop(kind, layout, state_dtype, gates):
    t = token_inputs(LENS, kda=kind == "kda")
    state = random_pool(P, 4, 64, 64, layout, state_dtype)
    before = state.clone()
    out, expected, expected_state = run_both(kind, t, state, IDX, gates=gates, layout=layout, accepted=ACCEPTED)
    # fp32 state: the same fp32 math against fp64; bf16 state: the same bf16 pool read, and each
    # checkpoint one bf16 rounding of the same value (or its neighbour where fp32 and fp64 straddle a tie)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    tol = dict(rtol=1e-5, atol=1e-5) if state_dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(state.float(), expected_state.float(), **tol)
    cu = t["cu_seqlens"]
    assert torch.all(out[cu[4]:cu[5]] == 0)  # request 4 accepted 0 tokens: no starting slot
    written = written_slots(IDX, LENS, ACCEPTED)
    assert written == {1, 2, 3, 4, 10, 11, 12, 14}  # 15: request 5 starts there, stores at 14 (and 99: no)
    for s in set(range(P)) - written:
        assert torch.equal(state[s], before[s]), f"slot {s} is named by no stored checkpoint but changed"


def test_a_rejected_draft_rolls_back_to_the_accepted_token_s_checkpoint():
    # Step 1: three tokens, a checkpoint after each (slots 1, 2, 3). The verifier accepts 2 of them:
    # step 2 (one token, same slot row) starts from slot 2, the state after the second token.
    t = token_inputs([3], seed=5)
    state = random_pool(P, 4, 64, 64)
    idx = torch.tensor([[1, 2, 3]])
    gdn_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], state, idx, cu_seqlens=t["cu_seqlens"])
    after_two, rejected = state[2].clone(), state[3].clone()
    t2 = token_inputs([1], seed=6)
    out = gdn_decode_reference(t2["q"], t2["k"], t2["v"], t2["g"], t2["beta"], state, idx,
                               cu_seqlens=t2["cu_seqlens"], num_accepted_tokens=torch.tensor([2]))
    alone = torch.zeros_like(state[:1])
    alone[0] = after_two  # the same token, one step from that checkpoint on its own
    expected = gdn_decode_reference(t2["q"], t2["k"], t2["v"], t2["g"], t2["beta"], alone, torch.tensor([0]))
    assert torch.equal(out, expected)
    assert torch.equal(state[1], alone[0])  # its state stored at idx[0, 0]
    assert torch.equal(state[3], rejected)  # the rejected token's checkpoint: left for the engine to overwrite


def test_checkpoints_are_the_states_of_successive_single_token_steps():
    # T tokens with a checkpoint per token = T one-token steps chained through an fp32 pool.
    t = token_inputs([4], seed=7)
    state = random_pool(P, 4, 64, 64)
    chained = state.clone()
    out = gdn_decode_reference(t["q"][None], t["k"][None], t["v"][None], t["g"][None], t["beta"][None], state,
                               torch.tensor([[5, 6, 7, 8]]))
    for i in range(4):  # token i: one step from the previous checkpoint (token 0: from slot 5, idx[0, 0])
        if i:
            chained[5 + i] = chained[4 + i]
        o = gdn_decode_reference(t["q"][i:i + 1], t["k"][i:i + 1], t["v"][i:i + 1], t["g"][i:i + 1],
                                 t["beta"][i:i + 1], chained, torch.tensor([5 + i]))
        torch.testing.assert_close(out[0, i:i + 1], o, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state[5 + i], chained[5 + i], rtol=1e-6, atol=1e-6)
    # idx[n, 0] = 5 was both the start (acc 1) and token 0's checkpoint
    assert out.shape == (1, 4, 4, 64)


def test_bf16_state_is_carried_in_fp32_between_tokens_not_reread():
    # The state read once (bf16), carried in fp32 across 4 tokens, stored as bf16 at each checkpoint.
    # A step that re-read its own bf16 checkpoint between tokens would be about 2^-9 off per token.
    t = token_inputs([4], seed=8)
    state = random_pool(P, 4, 64, 64, state_dtype=torch.bfloat16)
    reread = state.clone()
    out, expected, _ = run_both("gdn", t, state, torch.tensor([[1, 2, 3, 4]]))
    tol = dict(rtol=1e-4, atol=2e-6)  # outputs are about 0.05: fp32 against fp64 is far inside this
    torch.testing.assert_close(out, expected, **tol)
    chained = []
    for i in range(4):  # carrying through the bf16 pool instead: four one-token steps in place on slot 1
        chained.append(gdn_decode_reference(t["q"][i:i + 1], t["k"][i:i + 1], t["v"][i:i + 1], t["g"][i:i + 1],
                                            t["beta"][i:i + 1], reread, torch.tensor([1]), scale=0.2,
                                            use_qk_l2norm=True))
    chained = torch.cat(chained)
    torch.testing.assert_close(chained[:1], expected[:1], **tol)  # token 0 reads the pool either way
    assert not torch.allclose(chained[1:], expected[1:], **tol)  # the tolerance above catches a re-read


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("T", [3, 8])
def test_dense_n_t_form_is_the_flat_form_with_equal_lengths(kind, layout, T):
    t = token_inputs([T] * 4, kda=kind == "kda", seed=9)
    # slots 1..4T in rows of T (one -1 among them)
    idx = torch.arange(1, 4 * T + 1).reshape(4, T)
    idx[1, 1] = -1
    acc = torch.tensor([1, T, 2, 0])
    state = random_pool(4 * T + 2, 4, 64, 64, layout)
    flat_state = state.clone()
    out, expected, expected_state = run_both(kind, t, state, idx, layout=layout, accepted=acc, dense_T=T)
    assert out.shape == (4, T, 4, 64)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
    flat, _, _ = run_both(kind, t, flat_state, idx, layout=layout, accepted=acc)
    assert torch.equal(flat.reshape(4, T, 4, 64), out) and torch.equal(flat_state, state)


def test_idx_n_with_several_tokens_writes_only_the_last_state_in_place():
    t = token_inputs([2, 3, 1], seed=10)
    state = random_pool(P, 4, 64, 64)
    before = state.clone()
    idx = torch.tensor([3, -1, 7])
    out, expected, expected_state = run_both("gdn", t, state, idx)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
    assert torch.all(out[2:5] == 0)  # request 1: slot -1
    changed = {s for s in range(P) if not torch.equal(state[s], before[s])}
    assert changed == {3, 7}


def test_nonpositive_rule_at_the_start_and_at_checkpoints():
    t = token_inputs([2, 2], seed=11)
    state = random_pool(P, 4, 64, 64, "vk")
    before = state.clone()
    idx = torch.tensor([[0, 5], [6, 0]])  # request 0 starts at the null block; request 1 stores no token 1
    out, expected, expected_state = run_both("gdn", t, state, idx, layout="vk", lowest=1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
    assert torch.all(out[0:2] == 0)
    assert torch.equal(state[0], before[0]) and torch.equal(state[5], before[5])
    assert not torch.equal(state[6], before[6])


def test_tokens_after_the_last_request_get_zero_outputs():
    t = token_inputs([2, 1, 2], seed=12)  # 5 tokens; cu_seqlens covers the first 3 (two requests)
    state = random_pool(P, 4, 64, 64)
    out = gdn_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], state, torch.tensor([[1, 2], [3, 4]]),
                               cu_seqlens=torch.tensor([0, 2, 3]), output_gate=t["z"], norm_weight=t["w"])
    assert torch.all(out[3:] == 0) and torch.all(out[:3] != 0)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_epilogue_matches_the_loop(kind, activation, dtype):
    t = token_inputs(LENS, kda=kind == "kda", dtype=dtype, seed=13)
    state = random_pool(P, 4, 64, 64, "vk", torch.bfloat16)
    out, expected, expected_state = run_both(kind, t, state, IDX, gates="raw", layout="vk", accepted=ACCEPTED,
                                             epilogue=activation)
    assert out.dtype == dtype
    # bf16: the output is rounded twice (before and after the norm), each a bf16 ulp apart at most
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(state.float(), expected_state.float(), rtol=8e-3, atol=1e-5)
    cu = t["cu_seqlens"]
    assert torch.all(out[cu[4]:cu[5]] == 0)  # no starting slot: zero, whatever the gate


def test_epilogue_normalises_the_output_already_rounded_to_its_dtype():
    # vLLM's op stores the output (bf16), then normalises what it stored, in fp32, in this order:
    # o * rsqrt(mean(o^2) + eps) * w * act(z). The same formula written out gives the same bits.
    t = token_inputs([2, 3], dtype=torch.bfloat16, seed=14)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    state = random_pool(P, 4, 64, 64)
    plain = gdn_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], state.clone(), idx,
                                 cu_seqlens=t["cu_seqlens"])
    for act in ("silu", "sigmoid"):
        fused = gdn_decode_reference(t["q"], t["k"], t["v"], t["g"], t["beta"], state.clone(), idx,
                                     cu_seqlens=t["cu_seqlens"], output_gate=t["z"], norm_weight=t["w"],
                                     norm_eps=1e-6, gate_activation=act)
        x, z = plain.float(), t["z"].float()
        gate = torch.sigmoid(z) if act == "sigmoid" else z * torch.sigmoid(z)
        by_hand = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * t["w"] * gate).to(torch.bfloat16)
        assert torch.equal(fused, by_hand)
        assert torch.equal(gated_rms_norm(plain, t["z"], t["w"], 1e-6, act), by_hand)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
def test_vllm_s_padded_pool_is_updated_in_place_and_nothing_else_changes(layout, state_dtype):
    pages, state = vllm_pool(P, 4, 64, 64, layout, state_dtype)
    assert not state.is_contiguous() and state.stride(0) > state[0].numel()
    pages_before = pages.clone()
    contiguous = state.clone()
    t = token_inputs(LENS, seed=15)
    out, expected, expected_state = run_both("gdn", t, state, IDX, gates="raw", layout=layout, accepted=ACCEPTED,
                                             epilogue="silu")
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    tol = dict(rtol=1e-5, atol=1e-5) if state_dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(state.float(), expected_state.float(), **tol)
    # the same step on a contiguous copy of the pool: the same bits
    out2, _, _ = run_both("gdn", t, contiguous, IDX, gates="raw", layout=layout, accepted=ACCEPTED, epilogue="silu")
    assert torch.equal(out, out2) and torch.equal(state, contiguous)
    # every byte outside the written slots' state blocks: the conv states, the padding, other slots
    nbytes = state[0].numel() * state.element_size()
    written = written_slots(IDX, LENS, ACCEPTED)
    for s in range(P):
        conv, block, pad = (pages[s, :4096], pages[s, 4096:4096 + nbytes], pages[s, 4096 + nbytes:])
        assert torch.equal(conv, pages_before[s, :4096]) and torch.equal(pad, pages_before[s, 4096 + nbytes:])
        assert torch.equal(block, pages_before[s, 4096:4096 + nbytes]) == (s not in written)


def test_kda_on_the_padded_pool_with_the_epilogue():
    pages, state = vllm_pool(P, 4, 64, 64, "vk", torch.bfloat16, conv_bytes=1024, pad_bytes=64)
    t = token_inputs(LENS, kda=True, seed=16)
    out, expected, expected_state = run_both("kda", t, state, IDX, gates="raw", layout="vk", accepted=ACCEPTED,
                                             epilogue="sigmoid", lowest=1)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.float(), expected_state.float(), rtol=8e-3, atol=1e-5)


def test_the_public_api_on_cpu_runs_the_reference_with_every_new_option():
    t = token_inputs(LENS, seed=17)
    state = random_pool(P, 4, 64, 64, "vk", torch.bfloat16)
    ref_state = state.clone()
    buf = torch.full_like(t["v"], float("nan"))
    options = dict(a=t["a"], b=t["b"], A_log=t["A_log"], dt_bias=t["dt_bias"], layout="vk", cu_seqlens=t["cu_seqlens"],
                   num_accepted_tokens=ACCEPTED, output_gate=t["z"], norm_weight=t["w"], gate_activation="sigmoid")
    out = cudelta.gdn_decode(t["q"], t["k"], t["v"], None, None, state, IDX, out=buf, **options)
    ref = gdn_decode_reference(t["q"], t["k"], t["v"], None, None, ref_state, IDX, **options)
    assert out is buf and torch.equal(out, ref) and torch.equal(state, ref_state)
