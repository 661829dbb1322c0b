"""cudelta.vllm_compat on CPU tensors, with inputs laid out as vLLM 0.33's GDN layer hands them over
(packed mixed_qkv rows of a wider projection, output_gate split from the same rows, the padded state
pool of its mamba cache, slot 0 the null block): against the float64 loop, and vLLM's argument rules."""

import pytest

torch = pytest.importorskip("torch")

from cudelta import vllm_compat  # noqa: E402
from decode_loop import loop_reference, raw_gates, vllm_pool  # noqa: E402


def packed(L, H, HV, K, V, seed, gate=True):
    """mixed_qkv [L, 2HK + HV V] and output_gate [L, HV, V]: views of one mixed_qkvz projection, as
    vLLM's _forward_core_fused_norm_packed splits it; raw a, b as bf16 views of one ba projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = 2 * H * K + HV * V
    mixed_qkvz = torch.randn(L, qkv + HV * V, generator=gen).to(torch.bfloat16)
    mixed_qkv, z = mixed_qkvz.split([qkv, HV * V], dim=-1)
    ba = (torch.randn(L, 2 * HV, generator=gen) * 2).to(torch.bfloat16)
    b, a = ba[:, :HV], ba[:, HV:]
    _, _, A_log, dt_bias = raw_gates(L, HV, K, False, seed=seed + 1)
    return dict(mixed_qkv=mixed_qkv, output_gate=z.reshape(L, HV, V), a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                w=(1 + torch.randn(V, generator=gen) * 0.2))


def unpack(mixed_qkv, H, HV, K, V):
    q, k, v = mixed_qkv.split([H * K, H * K, HV * V], dim=-1)
    return q.reshape(-1, H, K), k.reshape(-1, H, K), v.reshape(-1, HV, V)


def loop(x, state, idx, H, K, V, scale, l2norm, **tokens):
    q, k, v = unpack(x["mixed_qkv"], H, x["a"].shape[1], K, V)
    return loop_reference(q, k, v, None, None, state, idx, scale, l2norm, "vk", 1, a=x["a"], b=x["b"],
                          A_log=x["A_log"], dt_bias=x["dt_bias"], **tokens)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
@pytest.mark.parametrize("l2norm", [True, False])
def test_packed_decode_matches_the_loop_on_vllm_s_pool(state_dtype, l2norm):
    B, H, HV, K, V, P = 6, 2, 4, 64, 128, 9
    x = packed(B, H, HV, K, V, seed=30)
    pages, state = vllm_pool(P, HV, K, V, "vk", state_dtype)
    before, expected_state = pages.clone(), state.clone()
    idx = torch.tensor([3, 0, 5, 8, 9, 1], dtype=torch.int32)  # 0: the null block; 9 >= P: no slot either
    out = torch.full((B, 1, HV, V), float("nan"), dtype=torch.bfloat16)
    expected = loop(x, expected_state, idx, H, K, V, 0.1, l2norm)
    o, final = vllm_compat.fused_recurrent_gated_delta_rule_packed_decode(
        x["mixed_qkv"], x["a"], x["b"], x["A_log"], x["dt_bias"], 0.1, state, out, idx,
        use_qk_l2norm_in_kernel=l2norm)
    assert o is out and final is state
    torch.testing.assert_close(out[:, 0], expected, rtol=1.6e-2, atol=1e-4)  # bf16 outputs
    tol = dict(rtol=1e-5, atol=1e-5) if state_dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(state.float(), expected_state.float(), **tol)
    assert torch.all(out[1] == 0) and torch.all(out[4] == 0)
    for s in (0, 2, 4, 6, 7):  # not named (0: the null block): every byte of the page as it was
        assert torch.equal(pages[s], before[s])


def test_packed_decode_reads_q_k_v_in_place(monkeypatch):
    seen = {}
    real = vllm_compat.gdn_decode

    def spy(q, k, v, *args, **kwargs):
        seen.update(q=q, k=k, v=v)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(vllm_compat, "gdn_decode", spy)
    x = packed(3, 1, 2, 64, 64, seed=31)
    _, state = vllm_pool(4, 2, 64, 64)
    vllm_compat.fused_recurrent_gated_delta_rule_packed_decode(
        x["mixed_qkv"], x["a"], x["b"], x["A_log"], x["dt_bias"], 0.125, state,
        torch.empty(3, 1, 2, 64, dtype=torch.bfloat16), torch.tensor([1, 2, 3]))
    base = x["mixed_qkv"].untyped_storage().data_ptr()
    for name, offset in (("q", 0), ("k", 64), ("v", 128)):
        t = seen[name]
        assert t.untyped_storage().data_ptr() == base, f"{name} was copied"
        assert t.data_ptr() == x["mixed_qkv"].data_ptr() + offset * 2
        assert t.stride(0) == x["mixed_qkv"].stride(0)  # the rows of the wider projection


MTP_LENS = [3, 1, 4, 0, 2]
MTP_IDX = [[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 7, 0], [8, 9, 10, 11], [12, 13, 0, 0]]
MTP_ACC = [2, 1, 3, 1, 0]  # request 4 accepted nothing: no starting slot


def mtp_inputs(state_dtype, seed=32, norm_dtype=torch.float32):
    L, H, HV, D = sum(MTP_LENS), 2, 4, 128
    x = packed(L, H, HV, D, D, seed)
    pages, state = vllm_pool(14, HV, D, D, "vk", state_dtype, conv_bytes=3 * 2048, pad_bytes=256)
    cu = torch.tensor([0, 3, 4, 8, 8, 10], dtype=torch.int32)
    return x, pages, state, dict(state_indices=torch.tensor(MTP_IDX, dtype=torch.int32), cu_seqlens=cu,
                                 num_accepted_tokens=torch.tensor(MTP_ACC, dtype=torch.int32),
                                 norm_weight=x["w"].to(norm_dtype))


def mtp(x, state, t, **options):
    return vllm_compat.fused_gdn_decode_post_conv_mtp(
        x["mixed_qkv"], x["a"], x["b"], x["A_log"], x["dt_bias"], t["state_indices"], t["cu_seqlens"],
        t["num_accepted_tokens"], state, x["output_gate"], t["norm_weight"], **options)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32state", "bf16state"])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
def test_mtp_matches_the_loop_on_vllm_s_pool(state_dtype, activation, norm_dtype):
    x, pages, state, t = mtp_inputs(state_dtype, norm_dtype=norm_dtype)
    before, expected_state = pages.clone(), state.clone()
    expected = loop(x, expected_state, t["state_indices"], 2, 128, 128, 128 ** -0.5, True,
                    cu_seqlens=t["cu_seqlens"].tolist(), accepted=t["num_accepted_tokens"], z=x["output_gate"],
                    norm_weight=t["norm_weight"], eps=1e-6, act=activation)
    out = mtp(x, state, t, norm_eps=1e-6, output_gate_activation=activation)
    assert out.shape == (10, 4, 128) and out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)  # rounded to bf16 twice
    tol = dict(rtol=1e-5, atol=1e-5) if state_dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(state.float(), expected_state.float(), **tol)
    assert torch.all(out[8:10] == 0)  # request 4: no starting slot
    written = {1, 2, 3, 4, 5, 6, 7}  # checkpoints of requests 0-2 (request 3 has no tokens, 4 no start)
    for s in range(14):
        assert torch.equal(pages[s], before[s]) == (s not in written), s


def test_mtp_takes_nine_tokens_a_request_as_vllm_0_34_s_op_does():
    # vLLM 0.34 raised its op's limit to S = 9 columns (eight draft tokens and the bonus token).
    lens, H, HV, D = [9, 2, 9], 2, 4, 128
    x = packed(sum(lens), H, HV, D, D, seed=35)
    pages, state = vllm_pool(24, HV, D, D, "vk", torch.bfloat16, conv_bytes=3 * 2048, pad_bytes=256)
    idx = torch.tensor([list(range(1, 10)), [10, 11] + [0] * 7, list(range(12, 21))], dtype=torch.int32)
    t = dict(state_indices=idx, cu_seqlens=torch.tensor([0, 9, 11, 20], dtype=torch.int32),
             num_accepted_tokens=torch.tensor([9, 1, 4], dtype=torch.int32), norm_weight=x["w"])
    before, expected_state = pages.clone(), state.clone()
    expected = loop(x, expected_state, idx, H, D, D, D ** -0.5, True, cu_seqlens=t["cu_seqlens"].tolist(),
                    accepted=t["num_accepted_tokens"], z=x["output_gate"], norm_weight=x["w"], eps=1e-6, act="silu")
    out = mtp(x, state, t, norm_eps=1e-6)
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(state.float(), expected_state.float(), rtol=8e-3, atol=1e-5)
    for s in range(24):  # every named slot gets its token's state; 0 (the null block) and 21-23 none
        assert torch.equal(pages[s], before[s]) == (s == 0 or s > 20), s


def test_mtp_writes_into_the_given_out_and_returns_it():
    x, _, state, t = mtp_inputs(torch.bfloat16, seed=33)
    buf = torch.full((10, 4, 128), float("nan"), dtype=torch.bfloat16)
    expected = mtp(x, state.clone(), t)
    assert mtp(x, state, t, out=buf) is buf and torch.equal(buf, expected)


def good_packed(B=3, H=1, HV=2, K=64, V=64):
    x = packed(B, H, HV, K, V, seed=34)
    _, state = vllm_pool(4, HV, K, V)
    return dict(mixed_qkv=x["mixed_qkv"], a=x["a"], b=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"], scale=0.125,
                initial_state=state, out=torch.empty(B, 1, HV, V, dtype=torch.bfloat16),
                ssm_state_indices=torch.tensor([1, 2, 3]))


PACKED_CASES = [
    ("mixed_qkv", "mixed_qkv[None]", r"mixed_qkv must be a 2D tensor \[B, 2\*H\*K \+ HV\*V\]; got shape \(1, 3, 256\)"),
    ("mixed_qkv", "mixed_qkv[:, ::2]", r"mixed_qkv must be contiguous in the last dim; got strides \(384, 2\)"),
    ("a", "a[0]", r"a and b must be 2D tensors \[B, HV\]; got a \(2,\), b \(3, 2\)"),
    ("b", "b.t().contiguous().t()", r"a and b must be contiguous in the last dim; got strides a \(4, 1\), b \(1, 3\)"),
    ("A_log", "A_log[None]", r"A_log and dt_bias must be 1D tensors \[HV\]; got A_log \(1, 2\), dt_bias \(2,\)"),
    ("dt_bias", "torch.randn(4)[::2]",
     r"A_log and dt_bias must be contiguous; got strides A_log \(1,\), dt_bias \(2,\)"),
    ("ssm_state_indices", "ssm_state_indices[:, None]",
     r"ssm_state_indices must be 1D \[B\] for packed decode; got shape \(3, 1\)"),
    ("out", "torch.empty(3, 1, 64, 2, dtype=torch.bfloat16).transpose(2, 3)",
     r"out must be contiguous; got strides \(128, 128, 1, 2\) for shape \(3, 1, 2, 64\)"),
    ("a", "a[:2]", r"a and b must have mixed_qkv's batch size B=3; got a.shape\[0\]=2, b.shape\[0\]=3"),
    ("ssm_state_indices", "ssm_state_indices[:2]", r"ssm_state_indices must have shape \(3,\); got \(2,\)"),
    ("initial_state", "initial_state[0]", r"initial_state must be a 4D tensor \[slots, HV, V, K\]; got shape "
     r"\(2, 64, 64\)"),
    ("initial_state", "initial_state.transpose(2, 3)", r"initial_state must be contiguous in the last dim"),
    ("a", "torch.randn(3, 4)", r"a and b must be \[B, HV\] with HV=2 \(initial_state\); got a \(3, 4\), b \(3, 2\)"),
    ("A_log", "torch.randn(3)", r"A_log and dt_bias must have HV=2 elements; got 3 and 2"),
    ("out", "torch.empty(3, 2, 64, dtype=torch.bfloat16)", r"out must have shape \(3, 1, 2, 64\); got \(3, 2, 64\)"),
    ("mixed_qkv", "mixed_qkv[:, :129]", r"mixed_qkv's last dim 129 is not 2\*H\*K \+ HV\*V for HV=2, V=64, K=64 "
     r"and any H >= 1"),
    ("mixed_qkv", "torch.randn(3, 224)", r"the packed q size 48 \(from mixed_qkv's last dim 224\) must be a "
     r"multiple of K=64"),
    ("mixed_qkv", "torch.randn(3, 512)", r"HV=2 \(initial_state\) must be a multiple of H=3 \(inferred from "
     r"mixed_qkv\)"),
    ("initial_state", "initial_state.to(torch.float16)", r"state dtype torch.float16 is not accepted; expected one "
     r"of: float32, bfloat16"),
    ("ssm_state_indices", "torch.tensor([1.0, 2.0, 3.0])", r"idx must be an int32/int64 tensor of shape \[3\]"),
    ("initial_state", "torch.zeros(4, 2, 64, 32)", r"head dim K=32 is not supported; accepted: 64, 128, 256"),
]


@pytest.mark.parametrize("name,expr,message", PACKED_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(PACKED_CASES)])
def test_packed_decode_refuses_what_vllm_refuses_naming_the_value(name, expr, message):
    args = good_packed()
    args[name] = eval(expr, dict(args, torch=torch))  # noqa: S307
    state_before = args["initial_state"].clone()
    with pytest.raises(ValueError, match=message):
        vllm_compat.fused_recurrent_gated_delta_rule_packed_decode(**args)
    assert torch.equal(args["initial_state"], state_before) or name == "initial_state"


def good_mtp():
    x, _, state, t = mtp_inputs(torch.float32, seed=35)
    return dict(mixed_qkv=x["mixed_qkv"], a=x["a"], b=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                state_indices=t["state_indices"], cu_seqlens=t["cu_seqlens"],
                num_accepted_tokens=t["num_accepted_tokens"], state=state, output_gate=x["output_gate"],
                norm_weight=t["norm_weight"], out=torch.empty(10, 4, 128, dtype=torch.bfloat16))


MTP_CASES = [
    ("mixed_qkv", "mixed_qkv.float()", r"mixed_qkv must be a bfloat16 tensor; got torch.float32"),
    ("a", "a.half()", r"a must be a bfloat16 tensor; got torch.float16"),
    ("A_log", "A_log.bfloat16()", r"A_log must be a float32 tensor; got torch.bfloat16"),
    ("dt_bias", "dt_bias.double()", r"dt_bias must be a float32, bfloat16 or float16 tensor; got torch.float64"),
    ("cu_seqlens", "cu_seqlens.long()", r"cu_seqlens must be an int32 tensor; got torch.int64"),
    ("num_accepted_tokens", "num_accepted_tokens.long()", r"num_accepted_tokens must be an int32 tensor"),
    ("state_indices", "state_indices.long()", r"state_indices must be an int32 tensor; got torch.int64"),
    ("state", "state.half()", r"state must be a float32 or bfloat16 tensor; got torch.float16"),
    ("norm_weight", "norm_weight.half()", r"norm_weight must be a float32 or bfloat16 tensor; got torch.float16"),
    ("output_gate", "output_gate.float()", r"output_gate must be a bfloat16 tensor; got torch.float32"),
    ("out", "out.float()", r"out must be a bfloat16 tensor; got torch.float32"),
    ("output_gate_activation", "'swish'", r"output_gate_activation must be 'silu' or 'sigmoid'; got 'swish'"),
    ("mixed_qkv", "mixed_qkv[:0]", r"the MTP step requires at least one token; mixed_qkv has 0 rows"),
    ("state", "torch.zeros(4, 4, 64, 64)", r"state must have shape \[slots, HV, 128, 128\]; got \(4, 4, 64, 64\)"),
    ("mixed_qkv", "mixed_qkv[:, :-128]", r"mixed_qkv width 896 is inconsistent with state: it must be 2 \* H \* 128 \+ "
     r"HV \* 128 with HV=4 and H >= 1"),
    ("state", "torch.zeros(4, 6, 128, 128)", r"HV/H must be one of \(1, 2, 3, 4, 8\); got HV=6, H=1"),
    ("state_indices", "torch.ones(5, 10, dtype=torch.int32)", r"state_indices must have shape \[N, S\] with 1 <= S "
     r"<= 9; got \(5, 10\)"),
    ("cu_seqlens", "cu_seqlens[:5]", r"cu_seqlens must have N \+ 1 = 6 elements; got 5"),
    ("num_accepted_tokens", "num_accepted_tokens[:4]", r"num_accepted_tokens must have N = 5 elements; got 4"),
    ("A_log", "torch.randn(8)[::2]", r"A_log must be contiguous with HV=4 elements; got 4 elements, strides \(2,\)"),
    ("dt_bias", "torch.randn(5)", r"dt_bias must be contiguous with HV=4 elements; got 5 elements"),
    ("state_indices", "torch.ones(4, 5, dtype=torch.int32).t()", r"state_indices must be contiguous; got strides "
     r"\(1, 5\)"),
    ("output_gate", "output_gate[:9]",
     r"output_gate must have shape \[L, HV, 128\] = \[10, 4, 128\]; got \(9, 4, 128\)"),
    ("out", "out[:, :2]", r"out must have shape \[L, HV, 128\] = \[10, 4, 128\]; got \(10, 2, 128\)"),
    ("b", "b[:, None, 0].expand(10, 4)", r"a and b heads must be contiguous; got strides a \(8, 1\), b \(8, 0\)"),
    ("state", "state.transpose(2, 3)", r"state must have contiguous \[HV, 128, 128\] slot contents"),
    ("state", "torch.zeros(2 * 4 * 128 * 128 + 1)[1:].view(2, 4, 128, 128)",
     r"state slots must preserve 16-byte alignment; got a slot stride of 262144 bytes at address offset 4"),
    ("output_gate", "output_gate.transpose(0, 1).contiguous().transpose(0, 1)",
     r"output_gate head rows must be contiguous; got strides \(128, 1280, 1\)"),
    ("out", "torch.empty(4, 10, 128, dtype=torch.bfloat16).transpose(0, 1)", r"out must be contiguous"),
    ("norm_weight", "torch.ones(256)[::2]", r"norm_weight must be contiguous with 128 elements; got 128 elements"),
    ("cu_seqlens", "torch.tensor([0, 5, 6, 8, 8, 10], dtype=torch.int32)",
     r"request 0 has 5 tokens \(cu_seqlens\) but idx has 4 columns"),
    # what the step writes sharing memory with what it reads (vLLM's engine passes its own buffer)
    ("output_gate", "out", r"out shares memory with output_gate; accepted: buffers that share no byte with each other"),
    ("out", "mixed_qkv.as_strided((10, 4, 128), (512, 128, 1), 512)",
     r"out shares memory with q; accepted: buffers that share no byte"),  # q's rows span the packed rows
]


@pytest.mark.parametrize("name,expr,message", MTP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(MTP_CASES)])
def test_mtp_refuses_what_vllm_s_op_refuses_naming_the_value(name, expr, message):
    args = good_mtp()
    state_before = args["state"].clone()
    args[name] = eval(expr, dict(args, torch=torch))  # noqa: S307
    with pytest.raises(ValueError, match=message):
        vllm_compat.fused_gdn_decode_post_conv_mtp(**args)
    if name != "state":
        assert torch.equal(args["state"], state_before)


def test_mtp_checks_leave_the_pool_s_address_to_the_op_while_traced(monkeypatch):
    # torch.compile(fullgraph=True) cannot trace data_ptr(): traced, the checks skip the address and
    # the op checks it when it runs (tests/gpu/test_conv_pair_gpu.py compiles vLLM's layer step).
    args = good_mtp()
    args["state"] = torch.zeros(2 * 4 * 128 * 128 + 1)[1:].view(2, 4, 128, 128)  # 4 bytes off 16
    with pytest.raises(ValueError, match="at address offset 4"):
        vllm_compat._mtp_checks(**args, output_gate_activation="silu")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert vllm_compat._mtp_checks(**args, output_gate_activation="silu") == 2  # H
    slot = 4 * 128 * 128
    args["state"] = torch.zeros(2 * slot + 1).as_strided((2, 4, 128, 128), (slot + 1, 128 * 128, 128, 1))
    with pytest.raises(ValueError, match="state slots must preserve 16-byte alignment; got a slot stride of 262148"):
        vllm_compat._mtp_checks(**args, output_gate_activation="silu")  # the stride is still checked


class OnCUDA(torch.Tensor):
    @property
    def is_cuda(self):
        return True


def test_mtp_on_cuda_tensors_is_taken_not_refused():
    # No native library here: the CUDA path falls back to the reference, so the result must be the
    # CPU call's (tests/gpu/test_mtp_gpu.py runs the kernels on a real GPU).
    args = good_mtp()
    cpu = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in args.items()}
    vllm_compat.fused_gdn_decode_post_conv_mtp(**cpu)
    args["mixed_qkv"] = args["mixed_qkv"].as_subclass(OnCUDA)
    vllm_compat.fused_gdn_decode_post_conv_mtp(**args)
    assert args["state"].stride(0) > args["state"][0].numel()  # vLLM's padded pool, which the kernels take
    assert all(torch.equal(args[n], cpu[n]) for n, x in args.items() if isinstance(x, torch.Tensor))


def pair_args(seed=37):
    """conv_then_gdn_decode_post_conv_mtp's arguments: good_mtp's step on pre-conv rows, a conv state
    of vLLM's spec-decode length [slots, dim, 3 + 3] (its pages transposed), and the conv's slots
    (request 4 accepted nothing: the conv skips its null slot, the step its missing start)."""
    args = good_mtp()
    gen = torch.Generator().manual_seed(seed)
    dim = args["mixed_qkv"].shape[1]
    args.update(conv_state=torch.randn(14, 6, dim, generator=gen).to(torch.bfloat16).transpose(1, 2),
                conv_weight=(torch.randn(dim, 4, generator=gen) / 4).to(torch.bfloat16),
                conv_bias=(torch.randn(dim, generator=gen) * 0.1).to(torch.bfloat16),
                conv_state_indices=torch.tensor([1, 4, 5, 8, 0], dtype=torch.int32))
    return args


def test_the_pair_is_the_conv_then_the_step():
    pair = pair_args()
    apart = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in pair.items()}
    conv = {n: apart.pop(n) for n in ("conv_state", "conv_weight", "conv_bias", "conv_state_indices")}
    vllm_compat.causal_conv1d_update(apart["mixed_qkv"], conv["conv_state"], conv["conv_weight"], conv["conv_bias"],
                                     "silu", conv_state_indices=conv["conv_state_indices"],
                                     num_accepted_tokens=apart["num_accepted_tokens"],
                                     query_start_loc=apart["cu_seqlens"])
    expected = vllm_compat.fused_gdn_decode_post_conv_mtp(**apart)
    before = pair["mixed_qkv"].clone()
    out = vllm_compat.conv_then_gdn_decode_post_conv_mtp(**pair)
    assert out is pair["out"] and torch.equal(out, expected)
    assert torch.equal(pair["mixed_qkv"], apart["mixed_qkv"]) and not torch.equal(pair["mixed_qkv"], before)
    assert torch.equal(pair["conv_state"], conv["conv_state"]) and torch.equal(pair["state"], apart["state"])


def test_the_pair_writes_the_conv_into_conv_out_and_leaves_mixed_qkv():
    pair = pair_args()
    in_place = {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in pair.items()}
    x = pair["mixed_qkv"].clone()
    conv_out = torch.full_like(x, float("nan"))
    conv_out[-2:] = x[-2:]  # rows after cu_seqlens[N]: no request's, the conv leaves them
    out = vllm_compat.conv_then_gdn_decode_post_conv_mtp(**pair, conv_out=conv_out)
    expected = vllm_compat.conv_then_gdn_decode_post_conv_mtp(**in_place)
    assert torch.equal(pair["mixed_qkv"], x) and torch.equal(conv_out, in_place["mixed_qkv"])
    assert torch.equal(out, expected)


PAIR_CASES = [
    # the step's rules refuse before the conv has written anything
    ("out", "out.float()", r"out must be a bfloat16 tensor; got torch.float32"),
    ("state_indices", "state_indices[:, :0]", r"state_indices must have shape \[N, S\] with 1 <= S <= 9"),
    ("num_accepted_tokens", "num_accepted_tokens[:4]", r"num_accepted_tokens"),
    # and the conv's before the step
    ("conv_weight", "conv_weight[:, :1]",
     r"weight must be \[dim=1024, width >= 2\], or \[segments, width, dim / segments\].*; got shape \(1024, 1\)"),
    ("conv_state", "conv_state[:, :, :2]", r"conv_state must be \[slots, dim=1024, state_len >= width - 1 = 3\]"),
    ("activation", "'relu'", r"activation must be True, False, None, 'silu' or 'swish'; got 'relu'"),
    ("conv_weight", "torch.randn(1024, 8, dtype=torch.bfloat16)",
     r"causal_conv1d_update supports widths 2 to 7 \(vLLM 0.34's rule\), got 8"),
    ("conv_state_indices", "conv_state_indices[:3]", r"cu_seqlens must be \[N \+ 1 = 4\]; got shape \(6,\)"),
]


@pytest.mark.parametrize("name,expr,message", PAIR_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(PAIR_CASES)])
def test_the_pair_refuses_a_bad_argument_before_writing_anything(name, expr, message):
    args = pair_args()
    args[name] = eval(expr, dict(args, torch=torch))  # noqa: S307
    kept = {n: args[n].clone() for n in ("mixed_qkv", "conv_state", "state")}
    with pytest.raises(ValueError, match=message):
        vllm_compat.conv_then_gdn_decode_post_conv_mtp(**args)
    for n, x in kept.items():
        assert torch.equal(args[n], x), f"{n} was written before the refusal"
