"""What a decode call writes (out, the pool's slots) may share no byte with what it reads: the kernels
read z, the tokens and the gates after out is written, so an aliased call would compute from
overwritten values. Such a call is refused by name, on the reference path and the kernel path alike,
before anything is written; the padding between vLLM's slots (its conv state) is not the pool's, and
buffers that merely touch are accepted."""

import pytest

torch = pytest.importorskip("torch")

import cudelta  # noqa: E402
from cudelta._contract import _byte_span, _meets_slots  # noqa: E402
from cudelta.reference import gdn_decode_reference  # noqa: E402
from decode_loop import random_pool, token_inputs, vllm_pool  # noqa: E402

DECODES = [pytest.param(gdn_decode_reference, id="reference"), pytest.param(cudelta.gdn_decode, id="public")]
HV, K, V = 4, 64, 64


def epilogue_call(decode, t, state, idx, **options):
    return decode(t["q"], t["k"], t["v"], t["g"], t["beta"], state, idx, cu_seqlens=t["cu_seqlens"],
                  output_gate=t["z"], norm_weight=t["w"], **options)


def refused(decode, t, state, message, **options):
    before = state.clone()
    with pytest.raises(ValueError, match=message):
        epilogue_call(decode, t, state, torch.tensor([1, 2]), **options)
    assert torch.equal(state, before)


@pytest.mark.parametrize("decode", DECODES)
def test_an_out_that_aliases_an_input_is_named(decode):
    t = token_inputs([1, 1], seed=40)
    state = random_pool(4, HV, K, V)
    for name in ("v", "z"):
        refused(decode, t, state, rf"out shares memory with {'output_gate' if name == 'z' else name}; accepted: "
                r"buffers that share no byte with each other", out=t[name])
    # Part of a row is enough: z's second token shifted half a head down.
    wide = torch.randn(4 * HV * V)
    t["z"] = wide[:2 * HV * V].view(2, HV, V)
    shifted = wide[HV * V + V // 2:][:2 * HV * V].view(2, HV, V)
    refused(decode, t, state, r"out shares memory with output_gate", out=shifted)


@pytest.mark.parametrize("decode", DECODES)
def test_a_gate_that_aliases_out_is_named(decode):
    t = token_inputs([1, 1], seed=41)
    out = torch.empty(2, HV, V)
    t["beta"] = out.view(-1)[:2 * HV].view(2, HV)
    refused(decode, t, random_pool(4, HV, K, V), r"out shares memory with beta", out=out)


@pytest.mark.parametrize("decode", DECODES)
def test_out_or_an_input_inside_a_slot_is_named(decode):
    t = token_inputs([1, 1], seed=42)
    state = random_pool(4, HV, K, V)
    slot3 = state[3].view(-1)
    refused(decode, t, state, r"out shares memory with the state pool; accepted: buffers that share no byte",
            out=slot3[:2 * HV * V].view(2, HV, V))
    t["q"] = slot3[100:100 + 2 * 2 * K].view(2, 2, K)
    refused(decode, t, state, r"q shares memory with the state pool's slots; accepted: buffers that share no byte")


@pytest.mark.parametrize("decode", DECODES)
def test_the_padding_between_vllm_slots_is_not_the_pool(decode):
    # out written into a page's conv-state bytes, which the step never touches: accepted, and the
    # result is the same call's with an out of its own.
    t = token_inputs([2, 1], seed=43)
    pages, state = vllm_pool(4, HV, K, V, "kv", conv_bytes=4 * 3 * HV * V)
    expected_state = state.clone()
    expected = epilogue_call(gdn_decode_reference, t, expected_state, torch.tensor([1, 2]))
    in_padding = pages[3, :4 * 3 * HV * V].view(torch.float32).view(3, HV, V)
    got = epilogue_call(decode, t, state, torch.tensor([1, 2]), out=in_padding)
    assert got.data_ptr() == in_padding.data_ptr()
    assert torch.equal(got, expected) and torch.equal(state, expected_state)


@pytest.mark.parametrize("decode", DECODES)
def test_buffers_that_only_touch_are_accepted(decode):
    t = token_inputs([1, 1], seed=44)
    one = torch.randn(4 * HV * V)
    t["v"], out = one[:2 * HV * V].view(2, HV, V), one[2 * HV * V:].view(2, HV, V)  # out starts where v ends
    got = epilogue_call(decode, t, random_pool(4, HV, K, V), torch.tensor([1, 2]), out=out)
    assert got.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("stride_extra", [0, 16, 528])
def test_meets_slots_agrees_with_the_bytes_themselves(stride_extra):
    # Every span of a small padded pool's buffer against the bytes its slot blocks cover.
    P, inner, block = 3, (1, 2, 4), 8 * 4
    stride = block + stride_extra
    raw = torch.zeros((P * stride + 64) // 4, dtype=torch.float32)
    state = raw[4:].as_strided((P, *inner), (stride // 4, 8, 4, 1))
    first = raw.data_ptr()
    start = state.data_ptr() - first
    covered = [0] * (raw.numel() * 4 + 1)  # covered[i]: slot bytes among the first i
    for i in range(raw.numel() * 4):
        in_slot = i >= start and (i - start) % stride < block and (i - start) // stride < P
        covered[i + 1] = covered[i] + in_slot
    for lo in range(0, raw.numel() * 4, 4):
        for hi in range(lo + 4, raw.numel() * 4 + 1, 4):
            assert _meets_slots(state, (first + lo, first + hi)) == (covered[hi] > covered[lo]), (lo, hi)


def test_byte_span_covers_a_strided_view_first_to_last_element():
    x = torch.zeros(10, 8)[1:, ::2]  # rows 1..9, every other column
    lo, hi = _byte_span(x)
    assert lo == x.data_ptr() and hi == x.data_ptr() + ((8 * 8 + 6) + 1) * 4
    assert _byte_span(torch.zeros(0, 3)) == (0, 0)
