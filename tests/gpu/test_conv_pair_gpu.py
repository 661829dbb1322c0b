"""On a real GPU (marker `gpu`): cudelta.vllm_compat.conv_then_gdn_decode_post_conv_mtp, vLLM's GDN
layer step with speculative decoding in one call (cudelta's conv update, then the MTP step, whose
state loads start before the conv ends: kernels/launch.h, early_state), against the same two calls
made apart, bit for bit: the step's outputs, every byte of vLLM's pages (the conv state ahead of the
recurrent state in each page, the padding after it) and the conv's outputs. A step that read q, k or
v before the conv had written them would differ. The calls apart are tested against the references
elsewhere (tests/gpu/test_conv_gpu.py, test_mtp_gpu.py); here the conv's part of the pair is also
held to cudelta.conv_reference on CPU copies.

Cases: vLLM's call at T = 1, 2, 4 and 8 and T varying per request (tests/mtp_cases.py's varlen
forms: requests without tokens, rejected drafts, rows without a starting slot, invalid checkpoint
columns), both state dtypes, in small grids and engine-sized ones, so that each multi-token kernel
the launch rule picks for vLLM's call runs at least once (one-token, few-token, streaming); in place
on mixed_qkv as vLLM's layer calls it, or into conv_out; repeated on the pool it leaves; and
captured in a CUDA graph and traced by torch.compile(fullgraph=True)."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/mtp_cases.py
import mtp_cases as mc  # noqa: E402
from test_gdn_decode_gpu import native_loaded  # noqa: E402, F401  (autouse, per module)

from cudelta import vllm_compat  # noqa: E402
from cudelta.conv_reference import causal_conv1d_update_reference  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

DEVICE = "cuda"
WIDTH = 4


def case_with_conv(**kw) -> mc.Case:
    """A vLLM call whose pages hold the conv state vLLM sizes for it: [width - 1 + C - 1, dim] bf16."""
    case = mc.Case(**kw)
    C = max(mc.token_lens(case))
    dim = 128 * (2 * case.H + case.H * case.group)
    return replace(case, conv_bytes=(WIDTH - 1 + C - 1) * dim * 2)


CASES = [
    case_with_conv(tokens="varlen1", seed=700),  # one token: the one-token kernels
    case_with_conv(tokens="varlen1", state="fp32", H=16, N=64, seed=701),
    case_with_conv(tokens="varlen2", seed=702),  # one draft token: the few-token kernel
    case_with_conv(tokens="varlen4", state="fp32", seed=703),
    case_with_conv(tokens="varlen4", seed=704),  # bf16, three drafts: streaming
    case_with_conv(tokens="varlen", state="fp32", seed=705),  # up to 8 tokens
    case_with_conv(tokens="varlen", H=16, N=48, seed=706),
    case_with_conv(tokens="varlen2", H=16, N=128, epilogue="sigmoid", seed=707),
]


class Layer:
    """One layer step's tensors on a built case: the pre-conv rows x, the conv weight and bias, the
    conv state (each page's first conv_bytes as vLLM binds it: [state_len, dim], passed transposed),
    and the slots the conv takes (state_indices[:, 0] where it names a window the pool holds, else
    the null block: a request the conv cannot hold makes the reference raise)."""

    def __init__(self, step: mc.Step, seed: int):
        t = step.t
        self.step = step
        L, HV, V = t["v"].shape
        H, K = t["q"].shape[1:]
        self.dim = 2 * H * K + HV * V
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(L, self.dim, generator=gen).to(torch.bfloat16).to(DEVICE)
        self.weight = (torch.randn(self.dim, WIDTH, generator=gen) / WIDTH).to(torch.bfloat16).to(DEVICE)
        self.bias = (torch.randn(self.dim, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
        pages = step.storage.view(step.state.shape[0], -1)
        self.state_len = step.case.conv_bytes // (2 * self.dim)
        self.conv_state = pages[:, :step.case.conv_bytes].view(torch.bfloat16).view(
            pages.shape[0], self.state_len, self.dim).transpose(1, 2)
        self.conv_state.copy_(torch.randn(self.conv_state.shape, generator=gen).to(torch.bfloat16))  # no NaN bytes
        idx, acc, P = t["idx"], t["accepted"], step.state.shape[0]
        C = idx.shape[1]
        first = idx[:, 0].long()
        bad = (first >= P) | (acc.long() < 1) | (acc.long() > C)
        self.conv_slots = torch.where(bad, torch.zeros_like(first), first).to(idx.dtype)
        self.z = t["z"]
        self.mixed = self.x.clone()  # rows the conv skips keep x's values, as in place

    def step_args(self) -> dict:
        t, step = self.step.t, self.step
        return dict(a=t["a"], b=t["b"], A_log=t["A_log"], dt_bias=t["dt_bias"], state_indices=t["idx"],
                    cu_seqlens=t["cu_seqlens"], num_accepted_tokens=t["accepted"], state=step.state,
                    output_gate=self.z, norm_weight=t["w"], out=step.out, norm_eps=step.case.eps,
                    output_gate_activation=step.case.epilogue)

    def apart(self, in_place: bool):
        """vLLM's layer: its conv call, then its step call."""
        t = self.step.t
        if in_place:
            self.mixed.copy_(self.x)
        vllm_compat.causal_conv1d_update(self.mixed if in_place else self.x, self.conv_state, self.weight, self.bias,
                                         "silu", conv_state_indices=self.conv_slots,
                                         num_accepted_tokens=t["accepted"], query_start_loc=t["cu_seqlens"],
                                         out=None if in_place else self.mixed)
        return vllm_compat.fused_gdn_decode_post_conv_mtp(self.mixed, **self.step_args())

    def pair(self, in_place: bool):
        if in_place:
            self.mixed.copy_(self.x)
        return vllm_compat.conv_then_gdn_decode_post_conv_mtp(
            self.mixed if in_place else self.x, self.conv_state, self.weight, self.bias,
            conv_state_indices=self.conv_slots, conv_out=None if in_place else self.mixed, **self.step_args())


def both(case: mc.Case) -> tuple[Layer, Layer]:
    return Layer(mc.build(case, DEVICE), case.seed), Layer(mc.build(case, DEVICE), case.seed)


def assert_same(got: Layer, out_got, want: Layer, out_want) -> None:
    torch.cuda.synchronize()
    assert torch.equal(out_got, out_want), "the step's outputs differ from the two calls apart"
    assert torch.equal(got.mixed, want.mixed), "the conv's outputs differ from the two calls apart"
    assert torch.equal(got.step.storage, want.step.storage), "a page byte differs from the two calls apart"


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "conv_out"])
@pytest.mark.parametrize("case", CASES, ids=mc.case_id)
def test_the_pair_equals_the_two_calls_apart_bit_for_bit(case, in_place):
    pair, apart = both(case)
    before = pair.step.storage.clone()
    assert_same(pair, pair.pair(in_place), apart, apart.apart(in_place))
    assert not torch.equal(pair.step.storage, before)  # the call did write: conv windows and checkpoints


@pytest.mark.parametrize("case", CASES[::3], ids=mc.case_id)
def test_the_pair_s_conv_is_the_reference_s(case):
    layer = Layer(mc.build(case, DEVICE), case.seed)
    t = layer.step.t
    conv_state = layer.conv_state.cpu().clone()
    x = layer.x.cpu()
    want = causal_conv1d_update_reference(x, conv_state, layer.weight.cpu(), layer.bias.cpu(), "silu",
                                          layer.conv_slots.cpu(), t["cu_seqlens"].cpu(), t["accepted"].cpu(),
                                          out=x.clone())
    layer.pair(in_place=False)
    torch.cuda.synchronize()
    torch.testing.assert_close(layer.mixed.cpu().float(), want.float(), rtol=2 ** -7, atol=1e-5)
    assert torch.equal(layer.conv_state.cpu(), conv_state)  # the window moves bytes, no arithmetic


@pytest.mark.parametrize("case", [CASES[2], CASES[6]], ids=mc.case_id)
def test_three_steps_in_a_row_equal_the_calls_apart(case):
    # Each step starts from the pool and the conv windows the one before left: a step whose state
    # loads raced the previous step's stores, or the conv's, would drift from the calls apart.
    pair, apart = both(case)
    for _ in range(3):
        out_pair, out_apart = pair.pair(in_place=True), apart.apart(in_place=True)
    assert_same(pair, out_pair, apart, out_apart)


def test_the_pair_captured_in_a_cuda_graph_replays_the_eager_result():
    case = CASES[4]
    static, eager = both(case)
    warm = Layer(mc.build(case, DEVICE), case.seed)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, on pages of its own
        warm.pair(in_place=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static.pair(in_place=True)
    graph.replay()
    graph.replay()
    out_eager = eager.pair(in_place=True)
    out_eager = eager.pair(in_place=True)
    assert_same(static, out, eager, out_eager)


@pytest.mark.parametrize("entry", ["one-call", "apart"])
def test_vllm_s_layer_step_traces_under_compile_fullgraph_and_equals_eager(entry):
    # An engine compiling its layer step: the argument checks trace once and both ops stay in the
    # graph (a check reading an address or a value would break the trace). vLLM's pages go in as one
    # tensor of the states' dtype (bf16 here), the conv state and the state viewed from it inside:
    # aot_autograd refuses two mutated graph inputs viewing one allocation, and inductor writes back
    # wrong bytes through a mutated view at another dtype than its input's (README, "torch.compile").
    case = CASES[4]
    traced, eager = both(case)
    state = traced.step.state
    assert state.dtype == torch.bfloat16
    P = state.shape[0]
    pages = traced.step.storage.view(torch.bfloat16).view(P, -1)
    conv_len, state_len = case.conv_bytes // 2, state[0].numel()
    conv_shape = (P, traced.state_len, traced.dim)
    step_args = {k: v for k, v in traced.step_args().items() if k != "state"}

    def layer_step(pages, mixed, weight, bias, conv_slots, step_args):
        conv_state = pages[:, :conv_len].view(conv_shape).transpose(1, 2)
        pool = pages[:, conv_len:conv_len + state_len].view(state.shape)
        if entry == "one-call":
            return vllm_compat.conv_then_gdn_decode_post_conv_mtp(mixed, conv_state, weight, bias,
                                                                   conv_state_indices=conv_slots, state=pool,
                                                                   **step_args)
        vllm_compat.causal_conv1d_update(mixed, conv_state, weight, bias, "silu", conv_state_indices=conv_slots,
                                         num_accepted_tokens=step_args["num_accepted_tokens"],
                                         query_start_loc=step_args["cu_seqlens"])
        return vllm_compat.fused_gdn_decode_post_conv_mtp(mixed, state=pool, **step_args)

    out = torch.compile(layer_step, fullgraph=True)(pages, traced.mixed, traced.weight, traced.bias,
                                                    traced.conv_slots, step_args)
    want = eager.pair(in_place=True) if entry == "one-call" else eager.apart(in_place=True)
    assert_same(traced, out, eager, want)
