"""On a real GPU (marker `gpu`): cudelta.vllm_compat.gdn_decode_with_conv, vLLM's GDN layer step with
the conv's outputs computed inside the one-token step (kernels/conv_in_step.cuh) and the conv
state shifted by the conv kernel's state-only pass after it, against the pair of kernels
(conv_then_gdn_decode_post_conv_mtp, its conv outputs into a buffer of their own) bit for bit: the
step's outputs and every byte of vLLM's pages (each page's conv state, recurrent state and
padding). mixed_qkv must come back as it was. A step that read a window after the state-only pass
had shifted it, or a pass that started before every window was read, would differ.

Cases: vLLM's call at one token a request (state_indices [N, 1]; tests/mtp_cases.py's varlen1: a
request without tokens among them, rows with no starting slot), both state dtypes, small and
engine-sized grids, with and without the conv's bias and SiLU, both epilogue gates; three steps in
a row on the pages they leave; a CUDA graph; torch.compile(fullgraph=True). A call the step cannot
take with the conv in it (two columns) takes the pair and still leaves mixed_qkv as it was."""

from unittest import mock

import pytest

torch = pytest.importorskip("torch")

from test_conv_pair_gpu import Layer, assert_same, both, case_with_conv  # noqa: E402  (puts tests/ on the path)
import mtp_cases as mc  # noqa: E402
from test_gdn_decode_gpu import native_loaded  # noqa: E402, F401  (autouse, per module)

from cudelta import vllm_compat  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

@pytest.fixture(autouse=True)
def conv_in_step(monkeypatch):
    """The step with the conv in it, opted into (vllm_compat.CONV_IN_STEP: not yet run on a GPU)."""
    monkeypatch.setattr(vllm_compat, "CONV_IN_STEP", True)


FUSED_CASES = [
    case_with_conv(tokens="varlen1", seed=800),
    case_with_conv(tokens="varlen1", state="fp32", H=16, N=64, seed=801),
    case_with_conv(tokens="varlen1", H=16, N=256, seed=802),
    case_with_conv(tokens="varlen1", state="fp32", H=4, N=8, epilogue="sigmoid", seed=803),
]


def fused(layer: Layer, activation="silu"):
    """The step with the conv in it: the pair must not be called (mock below), and mixed_qkv is x."""
    return vllm_compat.gdn_decode_with_conv(layer.x, layer.conv_state, layer.weight, layer.bias,
                                            activation=activation, **layer.step_args())


def pair(layer: Layer, activation="silu"):
    """The pair of kernels, its conv outputs into `mixed` (the fused call's conv slots are the step's
    first column: the pair's Layer names the same windows, or the null block where the conv cannot
    hold a request, and the conv kernel skips those either way)."""
    return vllm_compat.conv_then_gdn_decode_post_conv_mtp(
        layer.x, layer.conv_state, layer.weight, layer.bias, activation=activation,
        conv_state_indices=layer.conv_slots, conv_out=layer.mixed, **layer.step_args())


def no_pair():
    return mock.patch.object(vllm_compat, "conv_then_gdn_decode_post_conv_mtp",
                             side_effect=AssertionError("took the pair, not the step with the conv in it"))


def assert_fused_same(got: Layer, out_got, want: Layer, out_want, x_before) -> None:
    torch.cuda.synchronize()
    assert torch.equal(got.x, x_before), "mixed_qkv was written"
    got.mixed.copy_(want.mixed)  # the fused call stores no conv outputs: compare the rest
    assert_same(got, out_got, want, out_want)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "no-act"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=mc.case_id)
def test_the_step_with_the_conv_in_it_equals_the_pair_bit_for_bit(case, activation, bias):
    got, want = both(case)
    if not bias:
        got.bias = want.bias = None
    x_before, pages_before = got.x.clone(), got.step.storage.clone()
    with no_pair():
        out_got = fused(got, activation)
    out_want = pair(want, activation)
    assert_fused_same(got, out_got, want, out_want, x_before)
    assert not torch.equal(got.step.storage, pages_before)  # windows and states were written


@pytest.mark.parametrize("case", FUSED_CASES[:2], ids=mc.case_id)
def test_three_steps_in_a_row_equal_the_pair(case):
    # Each step reads the windows the previous state-only pass left: a pass still running, or a step
    # that started early, would drift from the pair.
    got, want = both(case)
    x_before = got.x.clone()
    with no_pair():
        for _ in range(3):
            out_got, out_want = fused(got), pair(want)
    assert_fused_same(got, out_got, want, out_want, x_before)


def test_the_step_with_the_conv_in_it_replays_in_a_cuda_graph():
    case = FUSED_CASES[2]
    static, eager = both(case)
    warm = Layer(mc.build(case, "cuda"), case.seed)
    x_before = static.x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with no_pair():
        with torch.cuda.stream(side):  # warm-up outside the capture, on pages of its own
            fused(warm)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(static)
        graph.replay()
        graph.replay()
        fused(eager)
        out_eager = fused(eager)
    torch.cuda.synchronize()
    assert torch.equal(static.x, x_before)
    assert torch.equal(out, out_eager) and torch.equal(static.step.storage, eager.step.storage)


def test_the_step_with_the_conv_in_it_traces_under_compile_fullgraph():
    case = FUSED_CASES[0]
    traced, eager = both(case)
    state = traced.step.state
    P = state.shape[0]
    pages = traced.step.storage.view(state.dtype).view(P, -1)
    es = state.element_size()
    conv_len, state_len = case.conv_bytes // es, state[0].numel()
    step_args = {k: v for k, v in traced.step_args().items() if k != "state"}

    def layer_step(pages, mixed, weight, bias, step_args):
        conv_state = pages[:, :conv_len].view(torch.bfloat16).view(P, traced.state_len, traced.dim).transpose(1, 2)
        pool = pages[:, conv_len:conv_len + state_len].view(state.shape)
        return vllm_compat.gdn_decode_with_conv(mixed, conv_state, weight, bias, state=pool, **step_args)

    with no_pair():
        out = torch.compile(layer_step, fullgraph=True)(pages, traced.x, traced.weight, traced.bias, step_args)
        want = fused(eager)
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(traced.step.storage, eager.step.storage)


def test_two_columns_take_the_pair_and_leave_mixed_qkv():
    case = case_with_conv(tokens="varlen2", seed=804)
    got, want = both(case)
    x_before = got.x.clone()
    out_got = vllm_compat.gdn_decode_with_conv(got.x, got.conv_state, got.weight, got.bias, **got.step_args())
    out_want = pair(want)
    assert_fused_same(got, out_got, want, out_want, x_before)


def test_without_the_opt_in_the_call_takes_the_pair(monkeypatch):
    monkeypatch.setattr(vllm_compat, "CONV_IN_STEP", False)
    got, want = both(FUSED_CASES[0])
    x_before = got.x.clone()
    with mock.patch.object(vllm_compat, "conv_then_gdn_decode_post_conv_mtp",
                           wraps=vllm_compat.conv_then_gdn_decode_post_conv_mtp) as taken:
        out_got = fused(got)
    assert taken.call_count == 1
    assert_fused_same(got, out_got, want, pair(want), x_before)
