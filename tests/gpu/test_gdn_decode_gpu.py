"""The CUDA kernels against the PyTorch reference, on a real GPU (marker `gpu`), for every option."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import cudelta  # noqa: E402
from cudelta import _native  # noqa: E402
from cudelta._call import DecodeCall  # noqa: E402
from cudelta.ops import run_kernel  # noqa: E402
from cudelta.reference import gdn_decode_reference, kda_decode_reference, resolve_gates  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/step_tolerance.py
from step_tolerance import assert_each_element_close, step_magnitudes  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

VARIANTS = list(_native.variants().items())  # the library's own table (cudelta::variants)
LAYOUTS = {"kv": 0, "vk": 1}
RULES = {"negative": 0, "nonpositive": 1}


def source_tree_problem(package_dir, has_library):
    """Why these tests must not run against `package_dir`, or None: `python -m pytest` from the root
    puts the root first on sys.path, so `import cudelta` finds ./cudelta, which has no library."""
    if has_library or Path(package_dir).resolve() != Path(__file__).resolve().parents[2] / "cudelta":
        return None
    return (f"tests/gpu imported cudelta from the source folder {package_dir}, which has no native library "
            "(`python -m pytest` puts the current folder first on sys.path). Install cudelta "
            "(pip install . or the wheel), then run the installed one: `pytest -m gpu tests/gpu`, or "
            "`python -P -m pytest -m gpu tests/gpu` (-P: no current folder on sys.path), or "
            "scripts/gpu_tests.sh.")


@pytest.fixture(scope="module", autouse=True)
def native_loaded():
    problem = source_tree_problem(Path(cudelta.__file__).parent, _native.library_path() is not None)
    if problem:
        pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)
    st = _native.status()
    assert st.loaded, f"native library not loaded on a GPU machine: {st.reason}"


def make(N, H, HV, K, V, P, dtype=torch.bfloat16, kda=False, layout="kv", state_dtype=torch.float32,
         idx_dtype=torch.int32, seed=0, invalid=()):
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda"
    t = dict(
        q=torch.randn(N, H, K, generator=gen).to(dev, dtype),
        k=torch.randn(N, H, K, generator=gen).to(dev, dtype),
        v=torch.randn(N, HV, V, generator=gen).to(dev, dtype),
        g=(-torch.rand(*((N, HV, K) if kda else (N, HV)), generator=gen) * 2).to(dev),
        beta=torch.rand(N, HV, generator=gen).to(dev),
        # raw gates as engines hold them: a, b in the activation dtype, A_log, dt_bias in float32
        a=(torch.randn(*((N, HV, K) if kda else (N, HV)), generator=gen) * 3).to(dev, dtype),
        b=(torch.randn(N, HV, generator=gen) * 2).to(dev, dtype),
        A_log=(torch.randn(HV, generator=gen) * 0.5).to(dev),
        dt_bias=torch.randn(*((HV, K) if kda else (HV,)), generator=gen).to(dev),
    )
    # past softplus' threshold of 20, at scattered requests, heads and (KDA) key channels, so that
    # lanes of one warp take both sides of it
    t["a"].view(-1)[::37] = 25.0
    shape = (P, HV, K, V) if layout == "kv" else (P, HV, V, K)
    t["state"] = (torch.randn(*shape, generator=gen) * 0.1).to(dev, state_dtype)
    slots = torch.randperm(P, generator=gen)[:N]
    for i in invalid:
        slots[i] = -1 if i % 2 == 0 else P + 3  # negative and past-the-end both mean "skip"
    t["idx"] = slots.to(dev, idx_dtype)
    return t


def gate_args(t, gates):
    if gates == "raw":
        return dict(g=None, beta=None, a=t["a"], b=t["b"], A_log=t["A_log"], dt_bias=t["dt_bias"])
    return dict(g=t["g"], beta=t["beta"], a=None, b=None, A_log=None, dt_bias=None)


def run_op(kind, variant, t, gates="pre", layout="kv", rule="negative", l2norm=True, out=None):
    """The raw op with a forced variant; the output buffer is poisoned so unwritten elements show."""
    ga = gate_args(t, gates)
    out = torch.full_like(t["v"], float("nan")) if out is None else out
    run_kernel(DecodeCall(kind, t["q"], t["k"], t["v"], state=t["state"], idx=t["idx"], use_qk_l2norm=l2norm,
                          layout=layout, invalid_slot=rule, **ga), out, variant)
    return out


def run_reference(kind, t, state, gates="pre", layout="kv", rule="negative", l2norm=True):
    ref = kda_decode_reference if kind == "kda" else gdn_decode_reference
    ga = gate_args(t, gates)
    g, beta = ga.pop("g"), ga.pop("beta")
    return ref(t["q"], t["k"], t["v"], g, beta, state, t["idx"], use_qk_l2norm=l2norm, layout=layout,
               invalid_slot=rule, **ga)


def magnitudes(kind, t, before, gates, layout, rule, l2norm):
    """Each element's error scale for the step from `before` (tests/step_tolerance.py)."""
    N, _, K = t["q"].shape
    ga = gate_args(t, gates)
    log_decay, beta = resolve_gates(kind, N, t["v"].shape[1], K, **ga)
    return step_magnitudes(t["q"], t["k"], t["v"], log_decay, beta, before, t["idx"], use_qk_l2norm=l2norm,
                           layout=layout, lowest=RULES[rule])


def check_step(kind, t, before, out, *, gates="pre", layout="kv", rule="negative", l2norm=True):
    """The step the kernel took from the pool `before` to t["state"], with output `out`, against the
    reference: each element within its own tolerance, the slots idx does not name bit-identical,
    requests with an invalid slot an output of exact zeros."""
    state = t["state"]
    ref_state = before.clone()
    ref_out = run_reference(kind, t, ref_state, gates, layout, rule, l2norm)
    assert not out.isnan().any(), "an output element was never written"
    mags = magnitudes(kind, t, before, gates, layout, rule, l2norm)
    assert_each_element_close(state, ref_state, mags.state, "state")
    assert_each_element_close(out, ref_out, mags.out, "output")
    lowest = RULES[rule]
    named = {int(s) for s in t["idx"].tolist() if lowest <= s < state.shape[0]}
    untouched = [s for s in range(state.shape[0]) if s not in named]
    assert untouched, "the test needs a slot idx does not name"
    assert torch.equal(state[untouched], before[untouched]), "a slot not named by idx changed"
    for n, s in enumerate(t["idx"].tolist()):
        if not lowest <= s < state.shape[0]:
            assert torch.all(out[n] == 0), f"request {n} with invalid slot {s} got a non-zero output"
    return out


def assert_step_matches(kind, variant, t, *, gates="pre", layout="kv", rule="negative", l2norm=True):
    before = t["state"].clone()
    out = run_op(kind, variant, t, gates, layout, rule, l2norm)
    torch.cuda.synchronize()
    return check_step(kind, t, before, out, gates=gates, layout=layout, rule=rule, l2norm=l2norm)


@pytest.mark.parametrize("name,variant", VARIANTS)
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
@pytest.mark.parametrize("gates", ["pre", "raw"])
@pytest.mark.parametrize("rule", ["negative", "nonpositive"])
def test_every_option_matches_the_reference(name, variant, kind, layout, state_dtype, gates, rule):
    t = make(N=7, H=2, HV=4, K=128, V=128, P=11, kda=kind == "kda", layout=layout, state_dtype=state_dtype,
             invalid=(1, 4))
    if rule == "nonpositive":
        t["idx"][2] = 0  # the null block: skipped, slot 0 untouched
    out = assert_step_matches(kind, variant, t, gates=gates, layout=layout, rule=rule)
    if rule == "nonpositive":
        assert torch.all(out[2] == 0)


@pytest.mark.parametrize("name,variant", VARIANTS)
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V", [(64, 64), (64, 256), (128, 64), (256, 128), (256, 256)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
def test_head_dims_64_128_256(name, variant, layout, K, V, state_dtype):
    t = make(N=5, H=2, HV=4, K=K, V=V, P=9, layout=layout, state_dtype=state_dtype, invalid=(3,))
    assert_step_matches("gdn", variant, t, layout=layout)


@pytest.mark.parametrize("name,variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("H,HV", [(16, 32), (4, 4), (2, 8)])
@pytest.mark.parametrize("l2norm", [True, False])
def test_io_dtypes_and_head_groups(name, variant, dtype, H, HV, l2norm):
    t = make(N=7, H=H, HV=HV, K=128, V=128, P=11, dtype=dtype, idx_dtype=torch.int64, invalid=(1, 4))
    # the output is held to one ulp of its own dtype at each element (plus the fp32 step's share)
    out = assert_step_matches("gdn", variant, t, gates="raw", l2norm=l2norm)
    assert out.dtype == dtype


# Batches at Qwen3-Next's head counts that reach every build of the warp variant for K = V = 128
# (kernels/launch_rules.cuh launch_vk_warp and launch_kv_warp, up to 132 SMs), with and without the
# evict-first state. vk fp32: 4-row tiles (N=2), two 8-row tiles per warp (12, 37 evict-first),
# 8-row tiles (100, 300); bf16: 8-row (2), 16-row (12, 37, 100 evict-first; 300). kv fp32: 4 column
# chunks (2), 8 chunks in 2-warp blocks (12, 37 evict-first; 100, 300); bf16: 4 chunks (2; 12
# evict-first), in 4-warp blocks (37, 100, 300). Programmatic dependent launch on and off in
# between. Other head dims have one build; kv with K = 256 runs the block kernel, K = 128 with V = 64 no
# 4-warp blocks.
WARP_BUILD_BATCHES = [(128, 128, 2), (128, 128, 12), (128, 128, 37), (128, 128, 100), (128, 128, 300),
                      (256, 128, 37), (64, 256, 37), (256, 64, 37), (128, 64, 100), (64, 64, 5)]


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("K,V,N", WARP_BUILD_BATCHES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
def test_warp_build_over_an_engine_batch_and_several_steps(kind, layout, K, V, N, state_dtype):
    # The warp builds at Qwen3-Next's head counts (one warp per tile, many tiles), raw gates, the
    # null block and both invalid slots, three steps in a row on the same pool.
    t = make(N=N, H=16, HV=32, K=K, V=V, P=N + 8, kda=kind == "kda", layout=layout, state_dtype=state_dtype,
             invalid=(0, 1) if N < 8 else (3, 8))
    t["idx"][N // 2] = 0
    for _ in range(3):
        assert_step_matches(kind, _native.variants()["warp"], t, gates="raw", layout=layout, rule="nonpositive")


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_a_batch_past_the_grid_limit_of_65535_requests(layout):
    # The warp kernel puts requests on the grid's z dimension (at most 65535): a larger batch is
    # launched in chunks, each with its per-request pointers advanced.
    N = 65535 + 7
    t = make(N=N, H=1, HV=1, K=64, V=64, P=N + 3, layout=layout, invalid=(65535, 65536))
    assert_step_matches("gdn", -1, t, gates="raw", layout=layout)


@pytest.mark.parametrize("layout,N", [("vk", 5), ("kv", 2)])
def test_programmatic_dependent_launch_changes_no_bit(tmp_path, layout, N):
    # CUDELTA_PDL=0 launches without programmatic dependent launch (read once per process): the
    # same steps, captured in a CUDA graph and replayed, give the same bits either way. (kv: the
    # 4-chunk build launches with it only up to 4 warps per SM, so a small batch.)
    script = tmp_path / "steps.py"
    script.write_text(
        "import sys, torch, cudelta\n"
        "g = torch.Generator().manual_seed(3)\n"
        "N, H, HV, K = int(sys.argv[4]), 16, 32, 128\n"
        "q, k = (torch.randn(N, H, K, generator=g).cuda().bfloat16() for _ in range(2))\n"
        "v = torch.randn(N, HV, K, generator=g).cuda().bfloat16()\n"
        "a, b = (torch.randn(N, HV, generator=g).cuda().bfloat16() for _ in range(2))\n"
        "A_log, dt = torch.randn(HV, generator=g).cuda(), torch.randn(HV, generator=g).cuda()\n"
        "pool = (torch.randn(N + 2, HV, K, K, generator=g) * 0.1).cuda().to(getattr(torch, sys.argv[2]))\n"
        "idx = torch.arange(1, N + 1, dtype=torch.int32).cuda()\n"
        "out = torch.empty(N, HV, K, device='cuda', dtype=torch.bfloat16)\n"
        "step = lambda: cudelta.gdn_decode(q, k, v, None, None, pool, idx, a=a, b=b, A_log=A_log, dt_bias=dt,\n"
        "                                  use_qk_l2norm=True, layout=sys.argv[3], invalid_slot='nonpositive', out=out)\n"
        "step()\n"
        "graph = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(graph):\n"
        "    for _ in range(4): step()\n"
        "graph.replay()\n"
        "torch.save({'pool': pool.cpu(), 'out': out.cpu()}, sys.argv[1])\n")
    import os
    import subprocess
    import sys

    for dtype in ("float32", "bfloat16"):
        results = []
        for pdl in ("0", "1"):
            path = tmp_path / f"{dtype}-{pdl}.pt"
            env = dict(os.environ, CUDELTA_PDL=pdl)
            subprocess.run([sys.executable, "-P", str(script), str(path), dtype, layout, str(N)], env=env, check=True)
            results.append(torch.load(path))
        assert torch.equal(results[0]["pool"], results[1]["pool"])
        assert torch.equal(results[0]["out"], results[1]["out"])
    bad = subprocess.run([sys.executable, "-P", str(script), str(tmp_path / "bad.pt"), "float32", layout, str(N)],
                         env=dict(os.environ, CUDELTA_PDL="yes"), capture_output=True, text=True)
    assert bad.returncode != 0
    # read once in Python at load (cudelta._native.requested_pdl), refused naming the value
    assert "CUDELTA_PDL='yes' is not accepted; expected 0 (off) or 1 (on, the default)" in bad.stderr


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_auto_takes_the_warp_build(layout):
    assert torch.ops.cudelta.select_variant(0, -1, 1) == _native.variants()["warp"]
    t = make(N=3, H=2, HV=4, K=128, V=128, P=6, layout=layout)
    assert_step_matches("gdn", -1, t, gates="raw", layout=layout)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("shift", [0, 1], ids=["aligned", "odd-offset"])
def test_strided_views_out_of_a_packed_projection(layout, shift):
    # vLLM slices q, k, v out of one mixed_qkv row and a, b out of one projection: views, not copies.
    # At an odd element offset the vk warp kernel cannot read q and k as 16-byte vectors and takes
    # its one-load-per-element path.
    N, H, HV, K, V, P = 6, 2, 4, 128, 128, 10
    dev = "cuda"
    mixed = torch.randn(N, 2 * H * K + HV * V + 64, device=dev, dtype=torch.bfloat16)[:, shift:]
    ab = torch.randn(N, 2 * HV + 3, device=dev, dtype=torch.bfloat16)
    t = make(N=N, H=H, HV=HV, K=K, V=V, P=P, layout=layout)
    t["q"] = mixed[:, : H * K].view(N, H, K)
    t["k"] = mixed[:, H * K: 2 * H * K].view(N, H, K)
    t["v"] = mixed[:, 2 * H * K: 2 * H * K + HV * V].view(N, HV, V)
    assert (t["q"].data_ptr() % 16 == 0) == (shift == 0)
    t["a"], t["b"] = ab[:, :HV], ab[:, HV: 2 * HV]
    assert not t["q"].is_contiguous() and not t["a"].is_contiguous()
    assert_step_matches("gdn", -1, t, gates="raw", layout=layout)


def test_the_out_buffer_may_be_a_view_of_a_larger_one():
    t = make(N=4, H=2, HV=4, K=128, V=128, P=8)
    big = torch.full((4, 6, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = big[:, 1:5]
    before = t["state"].clone()
    run_op("gdn", -1, t, out=out)
    torch.cuda.synchronize()
    check_step("gdn", t, before, out)
    assert big[:, 0].isnan().all() and big[:, 5].isnan().all()  # nothing written outside the view


def test_public_api_raw_gates_vk_bf16_state_into_out_buffer():
    t = make(N=5, H=2, HV=4, K=128, V=128, P=9, layout="vk", state_dtype=torch.bfloat16, invalid=(0,))
    t["idx"][1] = 0
    before = t["state"].clone()
    buf = torch.empty_like(t["v"])
    out = cudelta.gdn_decode(t["q"], t["k"], t["v"], None, None, t["state"], t["idx"], a=t["a"], b=t["b"],
                             A_log=t["A_log"], dt_bias=t["dt_bias"], layout="vk", invalid_slot="nonpositive", out=buf)
    torch.cuda.synchronize()
    assert out is buf
    check_step("gdn", t, before, out, gates="raw", layout="vk", rule="nonpositive", l2norm=False)


ERROR_CASES = {
    "variant 7": ("run_op('gdn', 7, t)", "accepted: warp"),
    "beta shape": ("run_op('gdn', -1, dict(t, beta=t['beta'][:, :1]))", "beta must be [N, HV] = [2, 2]"),
    "fp16 state": ("run_op('gdn', -1, dict(t, state=t['state'].half()))",
                   "state has dtype float16; accepted: float32, bfloat16"),
    "K=96": ("run_op('gdn', -1, make(N=2, H=2, HV=2, K=96, V=128, P=4))",
             "K=96 is not supported; accepted: 64, 128, 256"),
}
ERROR_SCRIPT = """
import sys; sys.path.insert(0, {here!r})
import cudelta; cudelta._native.status()
from test_gdn_decode_gpu import make, run_op
t = make(N=2, H=2, HV=2, K=128, V=128, P=4)
try:
    {call}
except RuntimeError as e:
    print(e)
"""


# Each case in its own process: an error raised inside the op once killed the process (SIGSEGV
# while streaming a number into the message, csrc/ops.cpp says more) instead of raising.
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_kernel_errors_name_the_value_and_the_accepted_ones(case):
    import subprocess
    import sys
    from pathlib import Path

    call, message = ERROR_CASES[case]
    script = ERROR_SCRIPT.format(here=str(Path(__file__).parent), call=call)
    proc = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and message in proc.stdout, proc.stderr[-500:]


def test_the_public_api_names_bad_arguments_before_the_kernel():
    t = make(N=2, H=2, HV=2, K=96, V=128, P=4)
    with pytest.raises(ValueError, match="K=96 is not supported; accepted: 64, 128, 256"):
        cudelta.gdn_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], t["state"], t["idx"])
    t = make(N=2, H=2, HV=2, K=128, V=128, P=4)
    with pytest.raises(ValueError, match=r"beta must be \[2, 2\]"):
        cudelta.gdn_decode(t["q"], t["k"], t["v"], t["g"], t["beta"][:, :1], t["state"], t["idx"])
    with pytest.raises(ValueError, match="state dtype torch.float16 is not accepted"):
        cudelta.gdn_decode(t["q"], t["k"], t["v"], t["g"], t["beta"], t["state"].half(), t["idx"])
    with pytest.raises(ValueError, match="per-channel gates are KDA"):
        cudelta.gdn_decode(t["q"], t["k"], t["v"], -torch.rand(2, 2, 128, device="cuda"), t["beta"], t["state"],
                           t["idx"])


def test_public_api_traces_under_compile_fullgraph():
    t = make(N=3, H=2, HV=4, K=128, V=128, P=6, layout="vk", state_dtype=torch.bfloat16)
    before = t["state"].clone()

    def step(q, k, v, state, idx, a, b, A_log, dt_bias, out):
        return cudelta.gdn_decode(q, k, v, None, None, state, idx, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                                  use_qk_l2norm=True, layout="vk", out=out)

    compiled = torch.compile(step, fullgraph=True)
    out = torch.empty_like(t["v"])
    compiled(t["q"], t["k"], t["v"], t["state"], t["idx"], t["a"], t["b"], t["A_log"], t["dt_bias"], out)
    torch.cuda.synchronize()
    check_step("gdn", t, before, out, gates="raw", layout="vk", l2norm=True)


def test_cuda_graph_replay_updates_state():
    t = make(N=4, H=2, HV=4, K=128, V=128, P=8, layout="vk")
    out = torch.empty_like(t["v"])
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        run_op("gdn", -1, dict(t, state=t["state"].clone()), gates="raw", layout="vk", out=out)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_op("gdn", -1, t, gates="raw", layout="vk", out=out)
    for _ in range(3):  # each replay is one step on the pool the previous one left
        before = t["state"].clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_step("gdn", t, before, out, gates="raw", layout="vk")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_the_fla_drop_in_on_the_gpu(kind):
    t = make(N=6, H=2, HV=4, K=128, V=128, P=10, layout="vk", kda=kind == "kda")
    t["idx"][3] = 0  # vLLM's null block
    before = t["state"].clone()
    o, final = cudelta.fused_recurrent_gated_delta_rule(
        t["q"][:, None], t["k"][:, None], t["v"][:, None], g=t["g"][:, None], beta=t["beta"][:, None],
        initial_state=t["state"], inplace_final_state=True, ssm_state_indices=t["idx"],
        use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    assert final is t["state"] and o.shape == (6, 1, 4, 128)
    check_step(kind, t, before, o[:, 0], layout="vk", rule="nonpositive")


def test_probe_reports_the_image_that_ran():
    cc, arch, arch_specific, family, chosen = torch.ops.cudelta.probe(0)
    major, minor = torch.cuda.get_device_capability(0)
    assert cc == major * 10 + minor
    assert arch // 10 <= cc and arch > 0
    if (major, minor) == (9, 0):
        assert arch == 900 and arch_specific == 1  # the sm_90a cubin, not PTX or sm_80
        warp = _native.variants()["warp"]
        assert torch.ops.cudelta.select_variant(0, warp, 32) == warp
