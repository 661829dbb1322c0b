"""cudelta.conv_reference: the causal-conv1d update vLLM runs before the GDN step, against a
float64 model written from vLLM's own description of the rolling window, and hand-checked cases."""

import pytest
import torch

from cudelta.conv_reference import causal_conv1d_update_reference

DIM, WIDTH = 12, 4


def rolling_model(x, state, weight, bias, silu, indices, spans, accepted):
    """float64, a token at a time: the window is a list of columns; each token is pushed onto it
    and the last `width` columns convolved; after the step the columns from the second on are
    stored from column 0 ("[history2, ..., historyM, draft1, ..., draftN]")."""
    x, weight = x.double(), weight.double()
    bias = bias.double() if bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
    state64 = state.double().clone()
    out = x.clone()
    width = weight.shape[1]
    for slot, (bos, eos), acc in zip(indices, spans, accepted):
        if slot == 0 or eos == bos:
            continue
        window = [state64[slot, :, acc - 1 + j].clone() for j in range(width - 1)]
        for t in range(bos, eos):
            window.append(x[t])
            y = bias.clone()
            for j in range(width):
                y += weight[:, j] * window[len(window) - width + j]
            out[t] = y * torch.sigmoid(y) if silu else y
        for c, column in enumerate(window[1:]):
            state64[slot, :, c] = column
    return out, state64


def make(state_len, slots=6, tokens=5, dtype=torch.float32, seed=0, sd_layout=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, DIM, generator=g).to(dtype)
    if sd_layout:  # vLLM's default: each page [state_len, dim], handed over transposed
        state = torch.randn(slots, state_len, DIM, generator=g).to(dtype).transpose(1, 2)
    else:
        state = torch.randn(slots, DIM, state_len, generator=g).to(dtype)
    weight = torch.randn(DIM, WIDTH, generator=g).to(dtype)
    bias = torch.randn(DIM, generator=g).to(dtype)
    return x, state, weight, bias


@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("sd_layout", [False, True])
def test_speculative_varlen_matches_the_rolling_model(silu, with_bias, sd_layout):
    # Three requests of 3, 0 and 2 tokens (the empty one skipped), one on the null block.
    x, state, weight, bias = make(state_len=WIDTH - 1 + 2, tokens=7, sd_layout=sd_layout)
    bias = bias if with_bias else None
    indices = torch.tensor([3, 1, 5, 0])
    cu = torch.tensor([0, 3, 3, 5, 7])
    acc = torch.tensor([2, 1, 3, 1])
    before = state.clone()
    out = causal_conv1d_update_reference(x, state, weight, bias, "silu" if silu else None, indices, cu, acc)
    want_out, want_state = rolling_model(x, before, weight, bias, silu, [3, 1, 5, 0],
                                         [(0, 3), (3, 3), (3, 5), (5, 7)], [2, 1, 3, 1])
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    # Slot 3 wrote width - 2 + 3 = 5 columns (all of them), slot 5 wrote 4 (column 4 keeps its bytes).
    torch.testing.assert_close(state.double(), want_state, rtol=1e-6, atol=1e-6)
    assert torch.equal(state[5, :, 4], before[5, :, 4])
    for untouched in (0, 1, 2, 4):
        assert torch.equal(state[untouched], before[untouched])
    assert torch.equal(out[5:7], x[5:7])  # the null block's rows: as they were


def test_one_token_a_row_is_the_classic_shift():
    x, state, weight, bias = make(state_len=WIDTH - 1, tokens=3)
    before = state.clone()
    out = causal_conv1d_update_reference(x, state, weight, bias, "silu", torch.tensor([4, 0, 2]))
    want_out, want_state = rolling_model(x, before, weight, bias, True, [4, 0, 2], [(0, 1), (1, 2), (2, 3)],
                                         [1, 1, 1])
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want_state, rtol=1e-6, atol=1e-6)
    assert torch.equal(state[4], torch.cat([before[4, :, 1:], x[0:1].T], dim=1))
    assert torch.equal(out[1], x[1])


def test_a_hand_checked_window():
    # One channel, width 3, weights picking each position: the output is the sum of the window.
    x = torch.tensor([[10.0], [100.0]])
    state = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]]).repeat(2, 1, 1)
    weight = torch.tensor([[1.0, 1.0, 1.0]])
    out = causal_conv1d_update_reference(x, state, weight, None, None, torch.tensor([1]), torch.tensor([0, 2]),
                                         torch.tensor([2]))
    # acc 2: the window starts at column 1 ([2, 3]); tokens 10, 100: 2+3+10, 3+10+100.
    assert out.flatten().tolist() == [15.0, 113.0]
    # seq = [2, 3, 10, 100]; seq[1:] -> columns 0..2; column 3 keeps 4.
    assert state[1, 0].tolist() == [3.0, 10.0, 100.0, 4.0]
    assert state[0, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_bf16_rounds_like_vllm_and_writes_into_out():
    x, state, weight, bias = make(state_len=WIDTH - 1 + 1, tokens=2, dtype=torch.bfloat16)
    before = state.clone()
    out = torch.full_like(x, 7.0)
    got = causal_conv1d_update_reference(x, state, weight, bias, "silu", torch.tensor([2]), torch.tensor([0, 2]),
                                         torch.tensor([1]), out=out)
    assert got is out and out.dtype == torch.bfloat16
    want_out, _ = rolling_model(x, before, weight, bias, True, [2], [(0, 2)], [1])
    torch.testing.assert_close(out.double(), want_out, rtol=1 / 128, atol=1e-2)


@pytest.mark.parametrize("change, message", [
    (dict(acc=torch.tensor([4])), "num_accepted_tokens 4 with 2 tokens"),
    (dict(acc=torch.tensor([0])), "num_accepted_tokens 0"),
    (dict(indices=torch.tensor([9])), "conv_state_indices[0] = 9 is outside the pool's slots 0..5"),
    (dict(activation="gelu"), "activation must be one of (None, 'silu', 'swish'); got 'gelu'"),
    (dict(acc=None), "cu_seqlens and num_accepted_tokens go together"),
    (dict(weight=torch.zeros(DIM, 1)), "weight must be [dim=12, width >= 2]"),
])
def test_bad_input_is_named_and_nothing_is_written(change, message):
    x, state, weight, bias = make(state_len=WIDTH - 1 + 1, tokens=2)
    before = state.clone()
    args = dict(indices=torch.tensor([2]), acc=torch.tensor([1]), activation="silu", weight=weight)
    args.update(change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        causal_conv1d_update_reference(x, state, args["weight"], bias, args["activation"], args["indices"],
                                       torch.tensor([0, 2]), args["acc"])
    assert torch.equal(state, before)


def test_a_bad_later_request_leaves_earlier_ones_unwritten():
    x, state, weight, bias = make(state_len=WIDTH - 1 + 1, tokens=4)
    before = state.clone()
    with pytest.raises(ValueError, match="request 1: num_accepted_tokens 3"):
        causal_conv1d_update_reference(x, state, weight, bias, "silu", torch.tensor([2, 3]), torch.tensor([0, 2, 4]),
                                       torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="name a slot twice"):
        causal_conv1d_update_reference(x, state, weight, bias, "silu", torch.tensor([2, 2]), torch.tensor([0, 2, 4]),
                                       torch.tensor([1, 1]))
    assert torch.equal(state, before)


def test_products_rounded_as_vllm_s_triton_kernel_rounds_them():
    x, state, weight, bias = make(state_len=WIDTH - 1, tokens=1, dtype=torch.bfloat16, seed=3)
    exact, rounded = (causal_conv1d_update_reference(x, state.clone(), weight, None, None, torch.tensor([1]),
                                                     round_products_to=r) for r in (None, torch.bfloat16))
    assert not torch.equal(exact, rounded)  # bf16 products lose bits the fp32 ones keep
    seq = torch.cat([state[1], x.T], dim=1)
    by_hand = sum((weight[:, j].float() * seq[:, j].float()).to(torch.bfloat16).float() for j in range(WIDTH))
    assert torch.equal(rounded[0], by_hand.to(torch.bfloat16))
