"""On a real GPU (marker `gpu`): several tokens per request (speculative decoding, vLLM's MTP) and the
fused gated-RMSNorm epilogue in the CUDA kernels, against the float64 loop of
tests/unit/decode_loop.py.

Each call is built, run and checked by tests/mtp_cases.py, which tests/unit/test_mtp_cases.py runs
on CPU tensors (the reference) so that the builder and the checker are tested without a GPU. A call
is checked for: its output (v's shape and dtype, into out= when given, every element written) each
element within its own tolerance of the loop's (tests/step_tolerance.py: one ulp of the dtype plus
(t + 1) fp32 steps' worth of the element's magnitude for token t; after the epilogue, what the
output's tolerance does to the norm); exact zeros for the tokens of requests without a starting slot
and for tokens after cu_seqlens[N]; each stored state (the state after the last token at idx[n]
with idx [N], after token t at idx[n, t] with idx [N, C]) within its tolerance; and every other
byte of the pool's allocation (slots not named, named slots that must not be written: invalid
columns, columns past a request's tokens, rows without a start or without tokens; vLLM's conv
states and padding) bit-identical.

Every call of six requests or more has rows with an invalid starting slot (negative, past the pool, or the null block 0
under invalid_slot="nonpositive"; under "negative" slot 0 is an ordinary slot and named), with
checkpoints a row with invalid columns (not written, the state carried on) and a column past the
pool, with num_accepted_tokens rows with acc = 0 and acc = C + 1 (no starting column) and rejected
drafts (acc < C: the start is a slot this call overwrites), with cu_seqlens a request with no token
and tokens after cu_seqlens[N].

The case matrix. The options: token form (q [N, H, K]; [N, T, H, K] for T = 1..8; flat with
cu_seqlens), slots (idx [N]; idx [N, C]; and num_accepted_tokens), epilogue (none, silu, sigmoid;
norm_eps 1e-3, not the default), HV = H, 2H, 4H, q/k/v dtype (bf16, fp16, fp32), GDN or KDA, layout,
state dtype, gate form, invalid-slot rule, pool (contiguous, vLLM's pages), out= or not, C = T or
T + 1, l2 norm (with the default scale) or not (scale passed), int32 or int64 indices. Their full
product is about 830,000 calls; MATRIX holds every pair of values of every two options at least
once (greedy pairwise, mtp_cases.pairwise; the unit test checks the coverage): 33 calls at
K = V = 128. Then: HEAD_DIMS, 10 calls with K, V of 64 and 256 (both layouts and state dtypes
each, and K != V twice); ENGINE, 6 engine batches (1 to 128 requests at Qwen3-Next's heads 16/32,
its TP=4 split and HV = 64); VLLM_CALLS, vLLM's own call at T = 1, 2, 4, 8, varying T, and up to 9
tokens a request (vLLM 0.34's most) (7). Beyond those: T = 1 with the epilogue only (12), vLLM's T =
1 call in every range of the one-token launch rule (16), the streaming kernel's row groups on small
grids (5), its staging-first build with vLLM's profile and off it (10), the few-token kernel in each
range of its launch rule (14), in clusters of 4 and 2 blocks a head (5) and in each of its builds
with vLLM's profile and off it (13), the epilogue against the reference's epilogue of the
unfused output, vLLM's padded pool with other paddings and against a contiguous pool bit for bit
(4), cudelta.vllm_compat.fused_gdn_decode_post_conv_mtp on CUDA against the same call on CPU tensors
(6, one with nine tokens a request), 9-16 checkpoint columns on the streaming kernel's long-pass
build and 17 on the resident kernel (11), which build the columns pick (4, from the kernel names the
profiler records), torch.compile(fullgraph=True) and CUDA-graph capture and replay with new inputs.
189 tests in all: a few seconds of GPU time; the host's share (drawing the pools,
the float64 loop) is most of the rest, a few seconds for the largest engine batch.
"""

import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/mtp_cases.py, tests/step_tolerance.py
import mtp_cases as mc  # noqa: E402
from test_gdn_decode_gpu import native_loaded  # noqa: E402, F401  (autouse, per module)

import cudelta  # noqa: E402
from cudelta import vllm_compat  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
DEVICE = "cuda"


@pytest.mark.parametrize("case", mc.MATRIX, ids=mc.case_id)
def test_every_pair_of_options_matches_the_float64_loop(case):
    mc.run_and_check(case, DEVICE)


@pytest.mark.parametrize("case", mc.HEAD_DIMS, ids=mc.case_id)
def test_head_dims_64_and_256(case):
    mc.run_and_check(case, DEVICE)


@pytest.mark.parametrize("case", mc.ENGINE, ids=mc.case_id)
def test_engine_batches(case):
    mc.run_and_check(case, DEVICE)


@pytest.mark.parametrize("case", mc.VLLM_CALLS, ids=mc.case_id)
def test_vllm_s_mtp_call(case):
    mc.run_and_check(case, DEVICE)


# T = 1, idx [N], the epilogue and nothing else: what an engine without speculative decoding calls.
ONE_TOKEN = [
    mc.Case(tokens="single", slots="final", layout=layout, state=state, epilogue=act, eps=eps, kind=kind, gates=gates,
            pool=pool, seed=500 + i)
    for i, (layout, state, act, eps, kind, gates, pool) in enumerate([
        ("kv", "fp32", "silu", 1e-3, "gdn", "raw", "pages"),
        ("kv", "fp32", "sigmoid", 1e-3, "kda", "pre", "contiguous"),
        ("kv", "fp32", "silu", None, "gdn", "pre", "contiguous"),
        ("kv", "bf16", "silu", 1e-3, "kda", "raw", "contiguous"),
        ("kv", "bf16", "sigmoid", 1e-3, "gdn", "pre", "pages"),
        ("kv", "bf16", "silu", None, "kda", "raw", "pages"),
        ("vk", "fp32", "silu", 1e-3, "kda", "pre", "pages"),
        ("vk", "fp32", "sigmoid", 1e-3, "gdn", "raw", "contiguous"),
        ("vk", "fp32", "silu", None, "kda", "raw", "contiguous"),
        ("vk", "bf16", "silu", 1e-3, "gdn", "pre", "contiguous"),
        ("vk", "bf16", "sigmoid", 1e-3, "kda", "raw", "pages"),
        ("vk", "bf16", "silu", None, "gdn", "raw", "pages"),
    ])
]


@pytest.mark.parametrize("case", ONE_TOKEN, ids=mc.case_id)
def test_one_token_with_the_epilogue_only(case):
    if case.eps is None:  # the defaults, not passed: norm_eps 1e-5, gate_activation "silu"
        step = mc.build(case, DEVICE)
        before = mc.snapshot(step)
        args, kw = mc.call_args(case, step.t, step.out)
        del kw["norm_eps"], kw["gate_activation"]
        fn = cudelta.kda_decode if case.kind == "kda" else cudelta.gdn_decode
        out = fn(*args, step.state, step.t["idx"], **kw)
        mc.synchronize(DEVICE)
        mc.check(case, step, before, out)
    else:
        mc.check_fused_epilogue(case, DEVICE)


# vLLM's T = 1 call (idx [N, 1], num_accepted_tokens) at Qwen3-Next's heads (HV = 32) with N chosen
# from this GPU's SM count so that the (request, value head) pairs land inside each range of the
# one-token launch rule (kernels/mtp_one.cuh, launch_vk_one: <= sms/2, <= sms, <= 2, 8, 16, 32, 64
# sms, more; with the epilogue the first is the clustered one-warp grid on sm_90+): each range runs
# another kernel or build, and each must compute the same step. KDA's (Kimi-Linear's 32 heads, an
# fp32 state and the epilogue, as vLLM's Kimi layers call it) has ranges of its own: its staged
# build from 2 to 8 sms, with plain loads past that.
PAIRS_PER_SM = (0.4, 0.9, 3, 10, 40, 70)
ONE_TOKEN_RANGES = ([("gdn", state, x, "silu") for state in ("bf16", "fp32") for x in PAIRS_PER_SM]
                    + [("gdn", state, x, "none") for state in ("bf16", "fp32") for x in (0.9, 3)]
                    + [("kda", "fp32", x, "sigmoid") for x in (0.4, 0.9, 1.5, 3, 10, 20, 70)])


@pytest.mark.parametrize("kind,state,pairs_per_sm,epilogue", ONE_TOKEN_RANGES)
def test_one_token_calls_in_every_range_of_the_launch_rule(kind, state, pairs_per_sm, epilogue):
    case = mc.Case(kind=kind, H=16 if kind == "gdn" else 32, group=2 if kind == "gdn" else 1, tokens="single",
                   state=state, epilogue=epilogue, seed=530)
    mc.run_and_check(mc.sized_for(pairs_per_sm, case, torch.cuda.get_device_properties(0).multi_processor_count), DEVICE)


# The streaming kernel's row groups (kernels/mtp_stream.cuh, launch_mtp_stream): while a block a head would
# fill at most half the SMs, the head's rows split over several blocks, a cluster of them with the
# epilogue. One value head and N from this GPU's SM count (sms / 3 requests), or vLLM's call at 8
# value heads: two groups of 8 chunks (up to SMs / 4 pairs the short-chunk build takes GDN's calls in
# layout vk instead: SHORT_CHUNKS below). With idx [N] and an fp32 state, 12 tokens a request take two
# passes of the staged tokens, the cluster's barrier between them; a bf16 state is carried in fp32 by
# the resident kernel instead.
ROW_GROUPS = [
    mc.Case(H=8, group=1, seed=540),  # vLLM's call
    mc.Case(H=1, group=1, tokens="T12", slots="final", state="fp32", seed=544),
    mc.Case(H=1, group=1, tokens="T12", slots="final", layout="kv", state="fp32", kind="kda", epilogue="sigmoid",
            gates="pre", seed=542),
    mc.Case(H=1, group=1, tokens="T12", slots="final", seed=541),  # bf16: the resident kernel
    mc.Case(H=1, group=1, tokens="T3", slots="ckpt", epilogue="none", state="fp32", seed=543),  # no cluster
]


@pytest.mark.parametrize("case", ROW_GROUPS, ids=mc.case_id)
def test_a_head_split_in_row_groups_computes_the_same_step(case):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = len(mc.VARLEN) if case.tokens == "varlen" else max(6, sms // 3)
    assert case.kind == "kda" or case.layout == "kv" or n * case.H * case.group * 4 > sms  # not the short-chunk build
    mc.run_and_check(replace(case, N=n), DEVICE)


# The streaming kernel's staging-first build (kernels/mtp_stream.cuh, kStreamStageFirstBuild): GDN,
# a bf16 state in layout vk and one block a head, which vLLM's call takes at Qwen3-Next's heads
# (HV = 32) when the (request, value head) pairs number between half the SMs and twice the SMs: a warp
# a chunk up to the SMs (share 0.9), 8-warp blocks of two chunks a warp past them (share 1.9). N from
# this GPU's SM count; 3-8 tokens (with 2 the few-token kernel takes these grids). vLLM's call takes
# the build of its profile (vllm_profile: the kernel's last template argument true), a call off it
# (fp16 io, int64 indices) the generic one.
STAGE_FIRST = [(0.9, mc.Case(H=16, tokens="T3", seed=560), True), (0.9, mc.Case(H=16, tokens="T4", seed=561), True),
               (0.9, mc.Case(H=16, tokens="T8", seed=562), True),
               (0.9, mc.Case(H=16, tokens="T3", slots="ckpt", epilogue="none", seed=563), True),
               (0.9, mc.Case(H=16, tokens="T4", slots="final", pool="contiguous", seed=564), True),
               (1.9, mc.Case(H=16, tokens="T3", seed=565), True), (1.9, mc.Case(H=16, tokens="T8", seed=566), True),
               (1.9, mc.Case(H=16, tokens="T4", slots="ckpt", epilogue="none", seed=567), True),
               (0.9, mc.Case(H=16, tokens="T4", io="fp16", seed=568), False),
               (1.9, mc.Case(H=16, tokens="T8", index="int64", epilogue="sigmoid", seed=569), False)]


@pytest.mark.parametrize("share, case, profile", STAGE_FIRST,
                         ids=lambda x: f"{x}sms" if isinstance(x, float) else mc.case_id(x) if isinstance(x, mc.Case) else str(x))
def test_the_staging_first_build_computes_the_same_step(share, case, profile):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    case = mc.sized_for(share, case, sms)
    pairs = case.N * case.H * case.group
    assert sms / 2 < pairs <= 2 * sms  # inside the build's range of the launch rule
    assert (pairs <= sms) == (share < 1)  # a warp a chunk, or 8-warp blocks past the SMs
    names = _kernels_launched(case)
    assert len(names) == 1 and re.search(rf"decode_mtp_stream_kernel<.*,\s*false,\s*true,\s*8,\s*8,\s*{str(profile).lower()},\s*false>", names[0]), names
    mc.run_and_check(case, DEVICE)


# The streaming kernel's long-pass build (kernels/mtp_stream.cuh, kStreamLongTokens): idx [N, C] with
# 9-16 columns (vLLM 0.34's call takes 9) in layout vk at K = 128, all tokens staged in one pass.
# Its options: both states, KDA's per-channel decay, checkpoints without num_accepted_tokens, C = T +
# 1, fp32 io; row groups in a cluster (one value head, N from the SM count) and 4- or 8-warp blocks
# past 16 warps an SM (Qwen3-Next's heads, 8 requests); and what stays on the resident kernel: 17
# columns, and layout kv.
LONG_PASS = [(None, mc.Case(tokens="varlen9", state="fp32", seed=800)),
             (None, mc.Case(tokens="varlen9", kind="kda", gates="pre", epilogue="sigmoid", seed=801)),
             (None, mc.Case(tokens="T9", slots="ckpt", epilogue="none", state="fp32", kind="kda", seed=802)),
             (None, mc.Case(tokens="T16", seed=803)),
             (None, mc.Case(tokens="T12", columns="T+1", io="fp32", rule="negative", seed=804)),
             ("groups", mc.Case(H=1, group=1, tokens="T9", seed=805)),
             ("groups", mc.Case(H=1, group=1, tokens="T9", state="fp32", epilogue="none", seed=806)),
             (8, mc.Case(H=16, tokens="T9", seed=807)),
             (8, mc.Case(H=16, tokens="varlen9", state="fp32", seed=808)),
             (None, mc.Case(tokens="T17", slots="ckpt", seed=809)),
             (None, mc.Case(tokens="T9", layout="kv", state="fp32", seed=810))]


@pytest.mark.parametrize("n, case", LONG_PASS, ids=lambda x: x.id if isinstance(x, mc.Case) else {None: "N6", "groups": "row-groups"}.get(x, f"N{x}"))
def test_nine_to_sixteen_columns_compute_the_same_step(n, case):
    if n == "groups":
        n = max(6, torch.cuda.get_device_properties(0).multi_processor_count // 16)
    mc.run_and_check(case if n is None else replace(case, N=n), DEVICE)


# The streaming kernel's short-chunk build (kernels/mtp_stream.cuh, short_chunk_launch): 4 rows a
# chunk in 8-warp blocks, a head's rows in four row groups, where requests x value heads <= SMs / 4
# (GDN, layout vk, K = 128, up to 8 tokens a pass). N: 1, or ("fill") as many requests as the rule
# takes on this GPU; varlen at two value heads. Its options: both states, no epilogue (no cluster),
# sigmoid, checkpoints without num_accepted_tokens, idx [N] with an fp32 state over two passes,
# C = T + 1 with fp32 io and int64 indices, precomputed gates in a contiguous pool, Qwen3-Next's heads.
SHORT_CHUNKS = [(1, mc.Case(H=4, tokens="T8", seed=820)),
                ("fill", mc.Case(H=4, tokens="T4", state="fp32", seed=821)),
                (None, mc.Case(H=1, tokens="varlen", epilogue="sigmoid", rule="negative", seed=822)),
                (1, mc.Case(H=4, tokens="T8", slots="ckpt", epilogue="none", seed=823)),
                (1, mc.Case(H=4, tokens="T12", slots="final", state="fp32", seed=824)),
                (1, mc.Case(H=16, tokens="T8", state="fp32", seed=825)),
                (1, mc.Case(H=4, tokens="T5", columns="T+1", io="fp32", index="int64", seed=826)),
                ("fill", mc.Case(H=4, tokens="T3", pool="contiguous", gates="pre", seed=827))]


@pytest.mark.parametrize("n, case", SHORT_CHUNKS, ids=lambda x: x.id if isinstance(x, mc.Case) else f"N{x}")
def test_the_short_chunk_build_computes_the_same_step(n, case):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pairs = case.H * case.group
    if n == "fill":
        n = max(1, sms // (4 * pairs))
    elif n is None:
        n = len(mc.VARLEN)
    assert n * pairs * 4 <= sms  # inside the rule
    mc.run_and_check(replace(case, N=n), DEVICE)


def _kernels_launched(case) -> list[str]:
    step = mc.build(case, DEVICE)
    return mc.kernels_launched(lambda: mc.call(case, step))


# Which build the columns pick (kernels/mtp.cuh), from the kernel's name as the profiler records it:
# the tokens a pass stages and the rows a chunk (the streaming kernel's template arguments after the
# staging order), or the resident kernel.
@pytest.mark.parametrize("tokens, staged", [("T8", 8), ("T9", 16), ("T16", 16), ("T17", None)])
def test_the_checkpoint_columns_pick_the_build(tokens, staged):
    names = _kernels_launched(mc.Case(H=16, N=32, tokens=tokens, slots="ckpt", seed=811))
    assert len(names) == 1, names
    if staged is None:
        assert "decode_mtp_kernel<" in names[0], names
    else:
        assert re.search(rf"decode_mtp_stream_kernel<.*,\s*{staged},\s*8,\s*false,\s*false>", names[0]), names


# The short-chunk build where requests x value heads <= SMs / 4, the 8-row build past that.
@pytest.mark.parametrize("share, rows", [(0.25, 4), (1.0, 8)])
def test_the_grid_picks_the_rows_a_chunk(share, rows):
    case = mc.sized_for(share, mc.Case(H=4, tokens="T8", seed=812), torch.cuda.get_device_properties(0).multi_processor_count)
    names = _kernels_launched(case)
    assert len(names) == 1, names
    assert re.search(rf"decode_mtp_stream_kernel<.*,\s*8,\s*{rows},\s*(true|false),\s*(true|false)>", names[0]), names


# The short-chunk build's vLLM profile (vllm_profile, kernels/mtp_stream.cuh): vLLM's call (bf16 q, k,
# v, z, a, b and out, int32 indices, l2-normalised q and k, V = 128) takes the build that holds those as
# constants, with either state; a call off the profile in any one of them takes the generic build.
# Both compute the same step.
PROFILE = [(mc.Case(H=4, tokens="T8", seed=830), True),
           (mc.Case(H=4, tokens="T4", state="fp32", slots="ckpt", epilogue="sigmoid", seed=831), True),
           (mc.Case(H=4, tokens="varlen", epilogue="none", pool="contiguous", rule="negative", seed=832), True),
           (mc.Case(H=4, tokens="T8", io="fp16", seed=833), False),
           (mc.Case(H=4, tokens="T4", io="fp32", state="fp32", seed=834), False),
           (mc.Case(H=4, tokens="T8", index="int64", seed=835), False),
           (mc.Case(H=4, tokens="T8", gates="pre", seed=836), False),
           (mc.Case(H=4, tokens="T8", l2norm=False, seed=837), False),
           (mc.Case(H=4, tokens="T8", V=64, seed=839), False)]


@pytest.mark.parametrize("case, fixed", PROFILE, ids=lambda x: mc.case_id(x) if isinstance(x, mc.Case) else str(x))
def test_vllms_call_takes_the_short_chunk_build_of_its_profile(case, fixed):
    case = mc.sized_for(0.25, case, torch.cuda.get_device_properties(0).multi_processor_count)
    names = _kernels_launched(case)
    assert len(names) == 1 and re.search(rf"decode_mtp_stream_kernel<.*,\s*8,\s*4,\s*{str(fixed).lower()},\s*(true|false)>", names[0]), names
    mc.run_and_check(case, DEVICE)


def test_an_fp8_output_takes_the_generic_short_chunk_build():
    case = mc.sized_for(0.25, mc.Case(H=4, tokens="T8", seed=838), torch.cuda.get_device_properties(0).multi_processor_count)
    mc.check_fp8_output(case, DEVICE)
    step, scale = mc.build(case, DEVICE), torch.tensor([0.02], device=DEVICE)
    names = mc.kernels_launched(lambda: mc.fp8_call(case, step.t, step.state, scale, None))
    assert len(names) == 1 and re.search(r"decode_mtp_stream_kernel<.*,\s*8,\s*4,\s*false,\s*(true|false)>", names[0]), names


# The streaming kernel's sends build (kernels/mtp_stream.cuh, stream_sends_launch): where a head's row
# groups make a cluster for the epilogue and the call has checkpoint columns (one pass), the blocks
# send their sums with st.async; the same grids without the epilogue (no cluster) or with idx [N]
# (an fp32 state over two passes) keep the build with the cluster barrier. The short-chunk grid
# (vLLM's call, and off its profile) and the 8-row grid's row groups; from the kernel's last
# template argument, on a GPU with clusters (sm_90+). Each computes the same step.
SENDS = [("short", mc.Case(H=4, tokens="T8", seed=850), True),
         ("short", mc.Case(H=4, tokens="T4", state="fp32", io="fp32", epilogue="sigmoid", seed=851), True),
         ("short", mc.Case(H=4, tokens="T8", slots="ckpt", epilogue="none", seed=852), False),
         ("groups", mc.Case(H=8, group=1, seed=853), True),
         ("groups", mc.Case(H=1, group=1, tokens="T3", state="fp32", slots="ckpt", index="int64", seed=854), True),
         ("groups", mc.Case(H=1, group=1, tokens="T12", slots="final", state="fp32", seed=855), False)]


@pytest.mark.parametrize("grid, case, sends", SENDS, ids=lambda x: mc.case_id(x) if isinstance(x, mc.Case) else str(x))
def test_clustered_epilogues_with_checkpoint_columns_take_the_sends_build(grid, case, sends):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if grid == "short":
        case = mc.sized_for(0.25, case, sms)
        assert case.N * case.H * case.group * 4 <= sms  # the short-chunk rule
    else:
        case = replace(case, N=len(mc.VARLEN) if case.tokens == "varlen" else max(6, sms // 3))
        assert case.N * case.H * case.group * 4 > sms  # past it: the 8-row grid, in row groups
    names = _kernels_launched(case)
    clusters = torch.cuda.get_device_capability(0)[0] >= 9
    rows = 4 if grid == "short" else 8
    assert len(names) == 1 and re.search(rf"decode_mtp_stream_kernel<.*,\s*8,\s*{rows},\s*(true|false),\s*{str(sends and clusters).lower()}>",
                                         names[0]), names
    mc.run_and_check(case, DEVICE)


def _profile_on_sm90(case) -> bool:
    """vLLM's exact call on a GPU that loads the sm_90 image (mc.takes_the_few_token_kernel)."""
    return mc.in_vllm_profile(case) and torch.cuda.get_device_capability(0) == (9, 0)


# The few-token kernel (kernels/mtp_few.cuh): GDN, layout vk, K = 128. vLLM's call with one draft
# token (idx [N, 2]) in grids of at most two (request, value head) pairs an SM (8 rows a warp where a
# bf16 state's pairs fit the SMs once: share 0.9; 16 past them: 1.9) and, with an fp32 state, in
# waves of its blocks at least 90% full (3.9: two waves); with an fp32 state also idx [N, 3] and
# [N, 4] from 90% of the SMs (0.98) in the same waves. N from this GPU's SM count; "varlen2" and
# "varlen4": cu_seqlens with requests of 0-2 and 0-4 tokens; C=T+1: three tokens, four columns; T3
# with C=T: idx [N, 3], which the four-column build takes, its fourth token never computed.
FEW_TOKENS = [(0.9, mc.Case(H=16, tokens="T2", seed=570)), (0.9, mc.Case(H=16, tokens="varlen2", seed=571)),
              (1.9, mc.Case(H=16, tokens="T2", seed=572)),
              (1.9, mc.Case(H=16, tokens="varlen2", epilogue="sigmoid", index="int64", rule="negative", seed=573)),
              (0.9, mc.Case(H=16, tokens="T2", state="fp32", epilogue="none", pool="contiguous", seed=574)),
              (1.9, mc.Case(H=16, tokens="varlen2", state="fp32", gates="pre", io="fp32", seed=575)),
              (3.9, mc.Case(H=16, tokens="T2", state="fp32", seed=576)),
              (3.9, mc.Case(H=16, tokens="T2", slots="ckpt", state="fp32", l2norm=False, seed=577)),
              (0.98, mc.Case(H=4, tokens="T4", state="fp32", seed=578)),
              (0.98, mc.Case(H=4, tokens="T4", slots="ckpt", state="fp32", epilogue="none", pool="contiguous", seed=579)),
              (1.9, mc.Case(H=16, tokens="T3", columns="T+1", state="fp32", epilogue="sigmoid", rule="negative", seed=580)),
              (3.9, mc.Case(H=16, tokens="varlen4", state="fp32", gates="pre", index="int64", seed=581)),
              (1.9, mc.Case(H=16, tokens="T3", state="fp32", seed=582)),
              (3.9, mc.Case(H=4, tokens="T3", slots="ckpt", state="fp32", epilogue="none", index="int64", seed=583))]


@pytest.mark.parametrize("share, case", FEW_TOKENS, ids=lambda x: f"{x}sms" if isinstance(x, float) else mc.case_id(x))
def test_the_few_token_kernel_computes_the_same_step(share, case):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    case = mc.sized_for(share, case, sms)
    pairs = case.N * case.H * case.group
    columns = max(mc.token_lens(case)) + (1 if case.columns == "T+1" else 0)
    assert columns in (2, 3, 4)  # idx [N, 2], [N, 3] or [N, 4]
    assert mc.takes_the_few_token_kernel(pairs, sms, case.state == "fp32", columns, _profile_on_sm90(case))
    assert (pairs <= sms) == (share < 1) and (pairs > 2 * sms) == (share > 2)
    mc.run_and_check(case, DEVICE)


# The few-token kernel's clusters (few_cluster_blocks): vLLM's call with one draft token and the
# epilogue, 4 blocks a head where that many a pair fit the SMs once (share 0.25), 2 where only two
# do (0.5); sm_90+ images only (elsewhere these run one block a pair, and are still checked).
FEW_CLUSTERS = [(0.25, 4, mc.Case(H=16, tokens="T2", seed=590)),
                (0.5, 2, mc.Case(H=16, tokens="varlen2", epilogue="sigmoid", index="int64", rule="negative", seed=591)),
                (0.25, 4, mc.Case(H=16, tokens="T2", state="fp32", gates="pre", io="fp32", seed=592)),
                (0.5, 2, mc.Case(H=4, tokens="varlen2", state="fp32", slots="ckpt", seed=593)),
                (0.25, 4, mc.Case(H=4, tokens="T2", pool="contiguous", seed=594))]


@pytest.mark.parametrize("share, blocks, case", FEW_CLUSTERS,
                         ids=lambda x: mc.case_id(x) if isinstance(x, mc.Case) else str(x))
def test_the_few_token_kernel_in_clusters_computes_the_same_step(share, blocks, case):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    case = mc.sized_for(share, case, sms)
    pairs = case.N * case.H * case.group
    assert mc.takes_the_few_token_kernel(pairs, sms, case.state == "fp32", 2, _profile_on_sm90(case))
    if mc.few_cluster_blocks(pairs, sms, case.state == "fp32", 2, epilogue=True) != blocks:
        pytest.skip(f"{blocks} blocks a pair of {pairs} pairs do not fit this GPU's {sms} SMs")
    mc.run_and_check(case, DEVICE)


# The few-token kernel's builds of vLLM's profile (vllm_profile, kernels/mtp_common.cuh): vLLM's call
# takes, in each of that kernel's builds, the one that holds its dtypes, index widths and V = 128 as
# constants (the kernel's last template argument true); a call off the profile in any of them the
# generic one. The build: a warp's rows, the columns it takes and the blocks of a cluster (BW, TT,
# CL). Both compute the same step. On an sm_90 image vLLM's call with a bf16 state takes the kernel
# past two (request, value head) pairs an SM too (share 3.9), and at three or four tokens in 16-warp
# blocks of 8 rows a warp (its only build: share 0.98, and 2.95, three waves of one block an SM);
# elsewhere the streaming kernel.
FEW_PROFILE = [(0.25, "8, 2, 4", mc.Case(H=16, tokens="T2", seed=840), True),
               (3.9, "16, 2, 1", mc.Case(H=16, tokens="T2", seed=850), True),
               (0.5, "8, 2, 2", mc.Case(H=16, tokens="varlen2", epilogue="sigmoid", seed=841), True),
               (0.9, "8, 2, 1", mc.Case(H=16, tokens="T2", epilogue="none", pool="contiguous", seed=842), True),
               (1.9, "16, 2, 1", mc.Case(H=16, tokens="T2", slots="ckpt", seed=843), True),
               (0.25, "4, 2, 4", mc.Case(H=4, tokens="T2", state="fp32", seed=844), True),
               (0.98, "16, 4, 1", mc.Case(H=4, tokens="T4", state="fp32", seed=845), True),
               (0.98, "8, 4, 1", mc.Case(H=4, tokens="T4", seed=851), True),
               (2.95, "8, 4, 1", mc.Case(H=16, tokens="varlen4", slots="ckpt", seed=852), True),
               (0.25, "8, 2, 4", mc.Case(H=16, tokens="T2", io="fp16", seed=846), False),
               (0.9, "8, 2, 1", mc.Case(H=16, tokens="T2", epilogue="none", index="int64", seed=847), False),
               (0.98, "16, 4, 1", mc.Case(H=4, tokens="T4", state="fp32", gates="pre", seed=848), False),
               (0.25, "4, 2, 4", mc.Case(H=4, tokens="T2", state="fp32", V=64, seed=849), False)]


@pytest.mark.parametrize("share, build, case, profile", FEW_PROFILE,
                         ids=lambda x: f"{x}sms" if isinstance(x, float) else mc.case_id(x) if isinstance(x, mc.Case) else str(x))
def test_vllms_call_takes_the_few_token_build_of_its_profile(share, build, case, profile):
    if not build.endswith(", 1") and torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("the few-token kernel's clusters are built for sm_90+ images")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    case = mc.sized_for(share, case, sms)
    pairs, columns, fp32 = case.N * case.H * case.group, max(mc.token_lens(case)), case.state == "fp32"
    if not mc.takes_the_few_token_kernel(pairs, sms, fp32, columns, _profile_on_sm90(case)):
        pytest.skip("vLLM's call with a bf16 state takes the few-token kernel past two pairs an SM, and at three or "
                    "four tokens, on sm_90 images only")
    blocks = mc.few_cluster_blocks(pairs, sms, fp32, columns, epilogue=case.epilogue != "none", V=case.V)
    if int(build.split(", ")[2]) != blocks:
        pytest.skip(f"{pairs} pairs take clusters of {blocks} blocks on this GPU's {sms} SMs")
    names = _kernels_launched(case)
    assert len(names) == 1 and re.search(rf"decode_vk_few_kernel<128,\s*\w+,\s*{build},\s*false,\s*{str(profile).lower()}>", names[0]), names
    mc.run_and_check(case, DEVICE)


# The one-token kernels' builds of vLLM's profile (kernels/mtp_one.cuh, the last template argument
# VP): vLLM's call at T = 1 (idx [N, 1], num_accepted_tokens) takes the build that holds its dtypes,
# index widths and V = 128 as constants in the one-warp grid's clusters (below half a (request,
# value head) pair an SM) and the block kernel's one-tile builds (bf16 16 rows a warp to two pairs
# an SM, 8 rows from four to eight; fp32 8 rows to one pair an SM, two 8-row tiles past it); bf16's
# two-tile build (from two and a half to four pairs an SM, and past eight) has no twin; a call off
# the profile takes the generic build. Both compute the same step.
ONE_PROFILE = [(0.25, "one_warp", "__nv_bfloat16, 16, false, 1, true, true, 1", mc.Case(H=16, tokens="T1", seed=860), True),
               (0.9, "one", "__nv_bfloat16, 16, false, true, 1", mc.Case(H=16, tokens="T1", seed=861), True),
               (3, "one", "__nv_bfloat16, 16, false, true, 2", mc.Case(H=16, tokens="T1", seed=870), False),
               (6, "one", "__nv_bfloat16, 8, false, true, 1", mc.Case(H=16, tokens="T1", seed=862), True),
               (10, "one", "__nv_bfloat16, 16, false, true, 2", mc.Case(H=16, tokens="T1", seed=863), False),
               (0.25, "one_warp", "float, 8, false, 1, true, true, 2", mc.Case(H=16, tokens="T1", state="fp32", seed=864), True),
               (0.9, "one", "float, 8, false, true, 1", mc.Case(H=16, tokens="T1", state="fp32", seed=865), True),
               (3, "one", "float, 8, false, true, 2", mc.Case(H=16, tokens="T1", state="fp32", slots="ckpt", seed=866), True),
               (0.25, "one_warp", "__nv_bfloat16, 16, false, 1, true, true, 1", mc.Case(H=16, tokens="T1", io="fp16", seed=867), False),
               (0.9, "one", "__nv_bfloat16, 16, false, true, 1", mc.Case(H=16, tokens="T1", index="int64", seed=868), False),
               (3, "one", "float, 8, false, true, 2", mc.Case(H=16, tokens="T1", state="fp32", gates="pre", seed=869), False)]


@pytest.mark.parametrize("share, kernel, build, case, profile", ONE_PROFILE,
                         ids=lambda x: (str(x) if isinstance(x, bool) else f"{x}sms" if isinstance(x, (int, float))
                                        else mc.case_id(x) if isinstance(x, mc.Case) else str(x)))
def test_vllms_call_takes_the_one_token_build_of_its_profile(share, kernel, build, case, profile):
    if kernel == "one_warp" and torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("the one-token kernel's clusters are built for sm_90+ images")
    case = mc.sized_for(share, case, torch.cuda.get_device_properties(0).multi_processor_count)
    names = _kernels_launched(case)
    assert len(names) == 1 and re.search(rf"decode_vk_{kernel}_kernel<128,\s*{build},\s*{str(profile).lower()}>", names[0]), names
    mc.run_and_check(case, DEVICE)


# vLLM's call, and dense tokens with checkpoints in KDA on the other layout
FUSED = [mc.Case(seed=510),
         mc.Case(kind="kda", tokens="T4", slots="ckpt", layout="kv", state="fp32", epilogue="sigmoid", seed=511)]


@pytest.mark.parametrize("case", FUSED, ids=mc.case_id)
def test_the_fused_epilogue_is_the_reference_s_epilogue_of_the_unfused_output(case):
    mc.check_fused_epilogue(case, DEVICE)


# vLLM's pages with other conv state and padding sizes, at Qwen3-Next's heads.
PAGES = [mc.Case(H=16, N=12, tokens="T4", layout=layout, state=state, conv_bytes=conv, pad_bytes=pad,
                 kind=kind, seed=520 + i)
         for i, (layout, state, conv, pad, kind) in enumerate([
             ("kv", "fp32", 4096, 16, "gdn"), ("vk", "bf16", 4096, 528, "gdn"),
             ("vk", "fp32", 1024, 4096 + 16, "kda"), ("kv", "bf16", 6144, 256, "kda")])]


@pytest.mark.parametrize("case", PAGES, ids=mc.case_id)
def test_vllm_s_padded_pool_equals_a_contiguous_pool_bit_for_bit(case):
    # check() compares every byte of the pages outside the written state blocks: the conv states, the
    # padding, the slots not written
    pages = mc.build(case, DEVICE)
    before = mc.snapshot(pages)
    assert pages.state.stride(0) > pages.state[0].numel()
    out = mc.call(case, pages)
    dense = mc.build(replace(case, pool="contiguous"), DEVICE)  # the same values: the pages are drawn after them
    assert torch.equal(dense.state, before.state.to(DEVICE))
    dense_out = mc.call(case, dense)
    mc.synchronize(DEVICE)
    mc.check(case, pages, before, out)
    assert torch.equal(out, dense_out) and torch.equal(pages.state, dense.state)


def packed_mtp_args(step: mc.Step) -> dict:
    """vllm_compat.fused_gdn_decode_post_conv_mtp's arguments from a built varlen call: q, k, v and
    the output gate as views of one mixed_qkvz projection, as vLLM's GDN layer hands them over."""
    t = step.t
    L, HV, D = t["v"].shape
    q, k, v, z = (t[n].flatten(1) for n in ("q", "k", "v", "z"))
    mixed_qkvz = torch.cat([q, k, v, z], dim=1)
    qkv = q.shape[1] + k.shape[1] + v.shape[1]
    return dict(mixed_qkv=mixed_qkvz[:, :qkv], a=t["a"], b=t["b"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                state_indices=t["idx"], cu_seqlens=t["cu_seqlens"], num_accepted_tokens=t["accepted"],
                state=step.state, output_gate=mixed_qkvz[:, qkv:].view(L, HV, D), norm_weight=t["w"], out=step.out,
                norm_eps=step.case.eps, output_gate_activation=step.case.epilogue)


# (state dtype, activation, HV / H, token counts, seed): vLLM's op takes HV / H in {1, 2, 3, 4, 8},
# and from 0.34 up to 9 tokens a request
VLLM_DROP_IN = [("bf16", "silu", 2, "varlen", 532), ("fp32", "sigmoid", 3, "varlen", 533),
                ("bf16", "sigmoid", 8, "varlen", 538), ("fp32", "silu", 1, "varlen", 531),
                ("bf16", "silu", 4, "varlen", 534), ("fp32", "silu", 2, "varlen9", 542)]


@pytest.mark.parametrize("state,activation,group,tokens,seed", VLLM_DROP_IN)
def test_vllm_mtp_drop_in_on_cuda_equals_the_same_call_on_cpu(state, activation, group, tokens, seed):
    case = mc.Case(state=state, epilogue=activation, group=group, out="buffer" if group % 2 else "new",
                   tokens=tokens, seed=seed)
    gpu, cpu = mc.build(case, DEVICE), mc.build(case, "cpu")
    before = mc.snapshot(gpu)
    out = vllm_compat.fused_gdn_decode_post_conv_mtp(**packed_mtp_args(gpu))
    out_cpu = vllm_compat.fused_gdn_decode_post_conv_mtp(**packed_mtp_args(cpu))
    mc.synchronize(DEVICE)
    mc.check(case, gpu, before, out)
    mc.compare(case, gpu, out, cpu, out_cpu, before)


def test_compile_fullgraph_of_a_multi_token_call_equals_eager():
    case = mc.Case(seed=540)  # flat tokens, checkpoints, accepted tokens, the epilogue, vLLM's pages
    eager, compiled = mc.build(case, DEVICE), mc.build(case, DEVICE)
    before = mc.snapshot(eager)
    fn = cudelta.kda_decode if case.kind == "kda" else cudelta.gdn_decode

    def step(t, state, out):
        args, kw = mc.call_args(case, t, out)
        return fn(*args, state, t["idx"], **kw)

    out = torch.compile(step, fullgraph=True)(compiled.t, compiled.state, compiled.out)
    expected = step(eager.t, eager.state, eager.out)
    torch.cuda.synchronize()
    assert torch.equal(compiled.out, expected) and torch.equal(out, expected)  # written into out=, and returned
    assert torch.equal(compiled.storage, eager.storage)
    mc.check(case, eager, before, expected)


# vLLM's call (token counts change between the two inputs), and dense tokens in KDA on the other layout
GRAPHED = [mc.Case(seed=550), mc.Case(kind="kda", tokens="T3", layout="kv", state="fp32", pool="contiguous",
                                      epilogue="sigmoid", gates="pre", seed=552)]


@pytest.mark.parametrize("case", GRAPHED, ids=mc.case_id)
def test_cuda_graph_replay_with_new_inputs_copied_in_gives_the_new_result(case):
    static = mc.build(case, DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, on a pool of its own
        mc.call(case, mc.build(case, DEVICE))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mc.call(case, static)
    # the inputs it was captured with
    eager = mc.build(case, DEVICE)
    expected = mc.call(case, eager)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and torch.equal(static.storage, eager.storage)
    # new values of every input (slots, accepted tokens and token counts included) and a new pool, copied into
    # the captured buffers
    new = replace(case, seed=case.seed + 1)
    fresh = mc.build(new, DEVICE)
    for name, x in static.t.items():
        if x is not None:
            x.copy_(fresh.t[name])
    static.storage.copy_(fresh.storage)
    before = mc.snapshot(static)
    assert not torch.equal(fresh.t["idx"], eager.t["idx"])
    expected = mc.call(new, fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and torch.equal(static.storage, fresh.storage)
    mc.check(new, static, before, out)


# More requests than a grid's y or z dimension holds (65535): the one-token launch rule's one-warp
# grid holds requests on z, so such a call takes the block kernel (kernels/mtp_one.cuh,
# launch_vk_one), and multi-token calls are not split (kernels/dispatch.cu). Requests are
# independent: the call must compute what the same requests compute in two calls that fit (those
# take the one-warp grid and the separate epilogue: another summation order, so bf16 rounding apart).
def test_a_one_token_call_with_more_requests_than_a_grid_dimension_holds():
    N, K = 65535 + 65, 128
    gen = torch.Generator(device=DEVICE).manual_seed(560)
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)
    q, k, v, z = (torch.randn(N, 1, K, generator=gen, **bf16) for _ in range(4))
    g = -0.5 * torch.rand(N, 1, generator=gen, device=DEVICE)
    beta = torch.sigmoid(torch.randn(N, 1, generator=gen, device=DEVICE))
    w = 1 + 0.1 * torch.randn(K, generator=gen, **bf16)
    idx = torch.arange(1, N + 1, device=DEVICE, dtype=torch.int32).unsqueeze(1)  # [N, 1], slot 0 the null block
    acc = torch.ones(N, device=DEVICE, dtype=torch.int32)
    before = (0.1 * torch.randn(N + 1, 1, K, K, generator=gen, device=DEVICE)).to(torch.bfloat16)

    def step(rows: slice, state: torch.Tensor) -> torch.Tensor:
        return cudelta.gdn_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], state, idx[rows], layout="vk",
                                  invalid_slot="nonpositive", use_qk_l2norm=True, num_accepted_tokens=acc[rows],
                                  output_gate=z[rows], norm_weight=w, norm_eps=1e-5, gate_activation="silu")

    whole = before.clone()
    out = step(slice(0, N), whole)
    halves = before.clone()
    out_halves = torch.cat([step(slice(0, N // 2), halves), step(slice(N // 2, N), halves)])
    torch.cuda.synchronize()
    assert not torch.equal(whole[1:], before[1:])  # every slot written
    assert torch.equal(whole[0], before[0])  # the null block untouched
    torch.testing.assert_close(out.float(), out_halves.float(), rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(whole.float(), halves.float(), rtol=1e-2, atol=2e-3)
