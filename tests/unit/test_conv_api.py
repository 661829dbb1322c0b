"""cudelta.conv.causal_conv1d_update and its vLLM drop-in without a GPU: on CPU tensors both are the
reference, with vLLM's argument forms (activation as a bool, in place on x, indices defaulting to
the rows) and a named refusal for each form they do not take."""

import pytest

torch = pytest.importorskip("torch")

from cudelta import conv, vllm_compat  # noqa: E402
from cudelta.conv_reference import causal_conv1d_update_reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the CPU notice


def case(rows=3, dim=16, width=4, state_len=3, slots=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, dim, generator=gen), torch.randn(slots, dim, state_len, generator=gen),
            torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen))


def test_the_cpu_path_is_the_reference_and_leaves_x_alone_without_out():
    x, state, w, b = case()
    idx = torch.tensor([1, 0, 4])
    want_state = state.clone()
    want = causal_conv1d_update_reference(x, want_state, w, b, "silu", idx)
    x_before = x.clone()
    got = conv.causal_conv1d_update(x, state, w, b, "silu", idx)
    assert torch.equal(got, want) and torch.equal(state, want_state) and torch.equal(x, x_before)
    assert torch.equal(got[1], x[1])  # the null slot's row keeps x's values


def test_the_vllm_drop_in_takes_a_bool_activation_and_writes_x_in_place():
    x, state, w, b = case()
    idx = torch.tensor([2, 3, 4])
    want_state = state.clone()
    want = causal_conv1d_update_reference(x.clone(), want_state, w, b, "silu", idx)
    got = vllm_compat.causal_conv1d_update(x, state, w, b, True, idx)
    assert got is x and torch.equal(x, want) and torch.equal(state, want_state)


def test_the_vllm_drop_in_defaults_the_slots_to_the_rows_and_takes_the_speculative_form():
    x, state, w, b = case(rows=5, state_len=5)
    cu, acc = torch.tensor([0, 2, 5]), torch.tensor([1, 3])
    want_state = state.clone()
    want = causal_conv1d_update_reference(x.clone(), want_state, w, None, None, torch.arange(2), cu, acc,
                                          null_block_id=-1)
    got = vllm_compat.causal_conv1d_update(x, state, w, None, False, None, num_accepted_tokens=acc, query_start_loc=cu,
                                           max_query_len=3, null_block_id=-1)
    assert torch.equal(got, want) and torch.equal(state, want_state)


@pytest.mark.parametrize("kwargs,message", [
    (dict(activation="gelu"), "activation must be True, False, None, 'silu' or 'swish'; got 'gelu'"),
    (dict(x3=True), r"x must be \[batch, dim\] or, with query_start_loc, \[num_tokens, dim\]; got shape \(3, 16, 1\)"),
    (dict(query_start_loc=torch.tensor([0, 1, 2, 3])), "query_start_loc and num_accepted_tokens go together"),
])
def test_forms_the_drop_in_does_not_take_are_refused_by_name(kwargs, message):
    x, state, w, b = case()
    if kwargs.pop("x3", False):
        x = x[:, :, None]
    with pytest.raises(ValueError, match=message):
        vllm_compat.causal_conv1d_update(x, state, w, b, **{"activation": "silu", **kwargs})


def test_a_wrong_shape_is_named_before_anything_is_written():
    x, state, w, b = case()
    before = state.clone()
    with pytest.raises(ValueError, match=r"weight must be \[dim=16, width >= 2\]"):
        conv.causal_conv1d_update(x, state, w[:8], b, "silu", torch.tensor([1, 2, 3]))
    assert torch.equal(state, before)


@pytest.mark.parametrize("width,taken", [(7, True), (8, False)])
def test_the_drop_in_takes_vllm_0_34_s_widths_and_refuses_wider(width, taken):
    # vLLM 0.34's causal_conv1d_update takes widths 2 to 7 and refuses others; cudelta.conv takes any.
    x, state, w, b = case(width=width, state_len=width - 1)
    before = state.clone()
    if taken:
        want = causal_conv1d_update_reference(x.clone(), state.clone(), w, b, "silu", torch.tensor([1, 2, 3]))
        assert torch.equal(vllm_compat.causal_conv1d_update(x, state, w, b, True, torch.tensor([1, 2, 3])), want)
        return
    with pytest.raises(ValueError, match="causal_conv1d_update supports widths 2 to 7 \\(vLLM 0.34's rule\\), got 8"):
        vllm_compat.causal_conv1d_update(x, state, w, b, True, torch.tensor([1, 2, 3]))
    assert torch.equal(state, before)
    assert conv.causal_conv1d_update(x, state, w, b, "silu", torch.tensor([1, 2, 3])).shape == x.shape
