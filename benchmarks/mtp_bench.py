"""The speculative (MTP) GDN decode step, as vLLM's Qwen3.5 layers run it: cudelta beside vLLM's CUDA
op and its Triton port, with a device copy of the same bytes as the yardstick (issue 17, section 5).

    python benchmarks/fetch_vllm_ops.py --cache /tmp/vllm-wheel   # once, where PyPI is reachable
    # on the GPU machine (carry [".peers/cuda_op", ".peers/vllm_fla"]), cudelta built there:
    python -P benchmarks/mtp_bench.py --quick --out $OUT/mtp.md     # B 1 8 128, T 1 4: meant for < 2 min
    python -P benchmarks/mtp_bench.py --out $OUT/mtp.md             # B 1 4 8 32 128 512, T 1 2 4 8
    python -P benchmarks/mtp_bench.py --heads 4/8 --tokens 1 2 4 8 --out $OUT/mtp-4-8.md   # another shape
    #   [--batches ...] [--tokens ...] [--states bfloat16 float32] [--procs 3] [--impls ...]

Shapes: Qwen3.5-class heads H=16, HV=32 (--heads H/HV for another), K=V=128; bf16 q/k/v/z/out; state fp32 and bf16. One
table per state dtype, rows B, columns T; each cell: cudelta / vLLM CUDA / vLLM Triton in µs, vLLM
CUDA ÷ cudelta, and % of copy; beside it cudelta's T=1 decode without the epilogue (cudelta.gdn_decode),
so that "T=1 + epilogue within 5% of T=1 decode alone" reads off the T=1 column. The summary line
checks the targets. The tables go to --out too, the merged and per-process numbers to --out's .json.

Implementations (the first three take the same call, the same tensors):
- cudelta: cudelta.vllm_compat.fused_gdn_decode_post_conv_mtp (vLLM's signature): the multi-token
  kernels (kernels/mtp.cuh). A NotSupportedOnCUDAError (older releases) shows as a skip, not a crash.
- vLLM CUDA: torch.ops._C.fused_gdn_decode_post_conv_mtp from vLLM's wheel
  (.peers/cuda_op/*.so.xz, decompressed with lzma into a temporary folder, torch.ops.load_library).
- vLLM Triton: fused_gdn_decode_post_conv_mtp_triton (.peers/vllm_fla), what vLLM runs on ROCm.
- cudelta T=1 decode alone: cudelta.gdn_decode, raw gates, vk layout, no epilogue, T=1 cells.
A peer that cannot load, or raises, is listed under the table with its reason.

Method (honest: no L2 hits on the state, no overlap of a call with itself that an engine would not
see, no number without a check):
- The pool is vLLM's padded page layout, built as its mamba state cache binds it
  (MambaBase.bind_kv_cache): one int8 page per slot holding the conv state (3 x 8192 bf16, 48 KiB),
  then this layer's [HV, V, K] state, the page padded to a multiple of 32 KiB (the hybrid models'
  attention page: 16 tokens x 2 KiB); the state is a strided view whose slot stride exceeds its
  block. Slot 0 is the null block (invalid_slot "nonpositive"): never named.
- State comes from DRAM: each call of the graph takes the next of `sets` disjoint sets of B*T slots,
  the sets covering >= 256 MiB together (L2 is 50 MB), and the graph holds max(50, sets) calls, so
  a slot comes back only after every other set has passed. Inputs (q/k/v/z, gates) are the same
  tensors every call, as the previous layer leaves them.
- Each request has T tokens (cu_seqlens = 0, T, 2T, ...), state_indices [B, T] (T distinct slots),
  num_accepted_tokens drawn in 1..T: the step starts from the state at state_indices[n, acc - 1]
  and writes the state after every token.
- Before timing, every implementation runs the cell's step on its own copy of a check pool (the
  cell's B*T slots, the null block and 8 spare slots) and is compared with cudelta's PyTorch
  reference (cudelta.reference, fp32 math) run on the GPU: the outputs (bf16: 1/64 relative + 1e-3
  of the largest), every slot's state (fp32: 1e-4; bf16: 1/100 relative, about one bf16 ulp, + 1e-4
  of the largest), and every byte outside the written state blocks bit-identical (the null block,
  spare slots, conv states, padding). Its largest differences are printed; one that disagrees is
  still timed but marked ✗ and counts as a miss.
- Time: a CUDA graph of the calls, best of 5 replays (kernel_bench.graph_us); where capture fails,
  eager launches timed with events (marked ᵉ). After each call a one-element kernel, whose own time
  (a graph of it alone) is subtracted: no call overlaps the one before it through programmatic
  dependent launch, as none can in a model, where other layers' kernels run in between
  (--back-to-back: without it, as kernel_bench times). The script re-runs itself in --procs
  processes (3) and prints per-cell medians and the largest spread.
- Copy: a device-to-device copy moving the bytes the step must move (mtp_report.step_bytes: state
  read once and written T times, q/k/v/z/out), i.e. copying half of them, capped at 256 MiB (beyond
  it the time is scaled by the bytes), cycling sets over >= 256 MiB as the step does.

vLLM's CUDA op, as 0.33.0's wheel defines and calls it (vllm/_custom_ops.py, the library's
registered schema and check messages, vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py;
0.34.0's wrapper and call are the same; its kernel takes S <= 9 columns and a third template
parameter, the blocks a head's value rows are split over (1, 2 or 4: choose_split_v in its launcher
takes 4 when requests x heads <= SMs / 2, 2 up to the SM count, on sm_90+)):
- torch.ops._C.fused_gdn_decode_post_conv_mtp, registered for the CUDA dispatch key only by
  vllm/_C_stable_libtorch.abi3.so (LibTorch stable ABI; it links libtorch, libcudart.so.13 and the
  driver's libcuda.so.1; the library's fat binaries hold cubins for sm_75/80/86/89/90/100/120, PTX
  for 80/89/90; vLLM itself requires compute capability >= 8.0). Its kernels (symbol names):
  gdn_decode_post_conv_mtp_kernel<state type (float or bf16), HV/H (1, 2, 3, 4, 8), bool>, launched
  by launch_gdn_decode_post_conv_mtp. Returns nothing. Arguments, in order: mixed_qkv, a, b,
  A_log, dt_bias, state_indices, cu_seqlens, num_accepted_tokens, state (written in place,
  Tensor!), output_gate, norm_weight, out (written in place, Tensor!), scale: float, norm_eps: float
  = 1e-5, output_gate_activation: str = "silu" ("silu" or "sigmoid"). vLLM's Python wrapper
  (vllm._custom_ops) allocates out as empty_like(output_gate) when None and returns it.
- mixed_qkv [L, 2*H*128 + HV*128] bf16, the conv output with q, k, v side by side per token (L
  tokens of all requests; channels contiguous, the row stride free); a, b [L, HV] bf16 raw gates
  (heads contiguous), decay exp(-exp(A_log) * softplus(a + dt_bias)), beta sigmoid(b); A_log [HV]
  fp32, dt_bias [HV] fp32/bf16/fp16, both contiguous. K = V = 128 only; HV / H in {1, 2, 3, 4, 8}.
  q and k are L2-normalised in the kernel (vLLM's Triton port: x * rsqrt(sum x^2 + 1e-6)), q scaled
  by `scale` (128^-0.5 in vLLM).
- state [slots, HV, 128 (V), 128 (K)], fp32 or bf16; each slot's [HV, V, K] contiguous, the slot
  stride free (vLLM's padded pages) but a multiple of 16 bytes, the base 16-byte aligned.
- state_indices [N, S] int32, contiguous, 1 <= S <= 8 (vLLM: S = num_speculative_tokens + 1, a
  slice of its block table): request n's state after its token t is stored at
  state_indices[n, t]; a slot <= 0 is not written (0 is vLLM's NULL_BLOCK_ID; CUDA-graph padding
  rows are all 0).
- num_accepted_tokens [N] int32: request n starts from the state at
  state_indices[n, num_accepted_tokens[n] - 1]; a start slot <= 0 (or acc outside 1..S) gives zero
  outputs and writes nothing (vLLM fills padding rows with acc = 1).
- cu_seqlens [N+1] int32, contiguous: request n's tokens are rows cu_seqlens[n]..cu_seqlens[n+1]-1
  of mixed_qkv, a, b, output_gate and out; tokens after cu_seqlens[N] are left as they were.
- output_gate (z) [L, HV, 128] bf16 (head rows contiguous; vLLM passes a strided view of its
  qkvz projection), norm_weight [128] fp32 or bf16, out [L, HV, 128] bf16 contiguous: per token
  and head, o (rounded to bf16) * rsqrt(mean(o^2) + norm_eps) * norm_weight * act(z), act silu(z)
  or sigmoid(z) per output_gate_activation.
- vLLM calls it (VLLM_GDN_DECODE_KERNEL=cuda, the default) for batches of speculative decodes only,
  after causal_conv1d_update, with its GDN layer's A_log, dt_bias, kv_cache[1], norm.weight,
  layer_norm_epsilon and norm.activation, scale head_k_dim ** -0.5.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # mtp_report, kernel_bench (also under `python -P`)
sys.path.append(str(ROOT))  # cudelta from the source tree where it is not installed

import mtp_report as report  # noqa: E402
from fetch_vllm_ops import CUDA_OP_DIR, FLA_DIR, fetched_version  # noqa: E402

H, HV, K, V = 16, 32, 128, 128  # --heads sets H and HV for the whole process (set_heads)
CONV_BYTES = 3 * (2 * H * K + HV * V) * 2  # conv state of a page: (kernel 4 - 1) x conv channels, bf16
HEADS = {"16/32": "Qwen3.5-class", "4/8": "the same at TP=4", "16/64": "HV=64", "32/32": "Kimi-Linear-class"}
PAGE_ALIGN = 32 << 10
SPARE_SLOTS = 8  # in the check pool: slots no call names, which must stay bit-identical
DRAM_BYTES = 256 << 20  # slot sets cycle over at least this much state per graph (--dram-mib)
DEVICE = "cuda"  # "cpu" only for a dry run of the whole script on a machine without a GPU (--device)
MIN_CALLS = 50
NORM_EPS = 1e-6  # Qwen3.5's rms_norm_eps
SCALE = K ** -0.5
FULL = dict(batches=[1, 4, 8, 32, 128, 512], tokens=[1, 2, 4, 8])  # the sweep
QUICK = dict(batches=[1, 8, 128], tokens=[1, 4])
STATES = ["bfloat16", "float32"]
SLOT_ORDERS = ("random", "consecutive")  # Cell.slot_sets: drawn over the pool, or side by side
# (rtol, fraction of the largest |expected|): bf16 outputs pass through two roundings around the
# norm (two ulps of 1/128 each); states: fp32 math in another order, or one bf16 ulp.
TOL_OUT = (1 / 64, 1e-3)
TOL_STATE = {"float32": (1e-4, 1e-4), "bfloat16": (1 / 100, 1e-4)}


# ---------------------------------------------------------------- the parent: processes, medians, tables


def parse_heads(text: str) -> tuple[int, int]:
    """"H/HV" -> (H, HV): q/k heads and v heads, HV a multiple of H (vLLM's op also needs HV/H in 1, 2, 3, 4, 8)."""
    try:
        h, hv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: expected H/HV, e.g. 16/32") from None
    if h < 1 or hv < h or hv % h:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: HV must be a positive multiple of H")
    return h, hv


def set_heads(h: int, hv: int) -> None:
    """The shape every Cell of this process uses (one shape per process keeps Cell's arithmetic flat)."""
    global H, HV, CONV_BYTES
    H, HV = h, hv
    CONV_BYTES = 3 * (2 * H * K + HV * V) * 2


def cuda_op_archive(explicit: Path | None) -> Path | None:
    if explicit is not None:
        return explicit
    found = sorted((ROOT / ".peers" / "cuda_op").glob("*.so.xz"))
    return found[0] if found else None


def unpack_cuda_op(archive: Path | None, folder: Path) -> tuple[str, str]:
    """(path of the library to load, "") or ("", why there is none)."""
    if archive is None:
        return "", "no .peers/cuda_op/*.so.xz: run benchmarks/fetch_vllm_ops.py and carry .peers/cuda_op"
    if not archive.exists():
        return "", f"{archive} does not exist"
    if archive.suffix != ".xz":
        return str(archive), ""
    target = folder / archive.name[: -len(".xz")]
    try:
        with lzma.open(archive) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 24)
    except (lzma.LZMAError, OSError, EOFError) as exc:
        return "", f"cannot decompress {archive}: {exc}"
    return str(target), ""


def peer_versions() -> str:
    """Which vLLM the peers came from, as fetch_vllm_ops.py recorded it."""
    return f"Peers: vLLM's CUDA op ({fetched_version(CUDA_OP_DIR)}), Triton modules ({fetched_version(FLA_DIR)})."


def worker_command(args, so: str, so_reason: str, result: Path) -> list[str]:
    safe_path = ["-P"] if getattr(sys.flags, "safe_path", False) else []  # as the parent was started
    cmd = [sys.executable, *safe_path, str(Path(__file__).resolve()), "--worker", str(result)]
    cmd += ["--batches", *map(str, args.batches), "--tokens", *map(str, args.tokens), "--states", *args.states,
            "--impls", *args.impls, "--cuda-op-so", so, "--cuda-op-reason", so_reason, "--device", args.device,
            "--dram-mib", str(args.dram_mib), "--heads", f"{H}/{HV}"] + (["--back-to-back"] if args.back_to_back else [])
    return cmd


def run_processes(name: str, procs: int, command, tmp: Path) -> tuple[list[dict], list[str]]:
    """command(result) run in `procs` processes one after another, each writing its numbers to
    `result` (a .json in tmp): (the results, a line per process that failed). A process that died
    keeps the cells it finished; none at all is said on stderr."""
    runs, failures = [], []
    for p in range(procs):
        result = tmp / f"proc{p}.json"
        print(f"{name}: process {p + 1}/{procs}", file=sys.stderr, flush=True)
        done = subprocess.run(command(result))
        if result.exists():
            runs.append(json.loads(result.read_text()))
        if done.returncode != 0:
            failures.append(f"process {p + 1} exited with {done.returncode}{'' if result.exists() else ', no results'}")
    if not runs:
        print(f"{name}: no process produced results (" + "; ".join(failures) + ")", file=sys.stderr)
    return runs, failures


def run_parent(args) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mtp_bench-") as tmp:
        so, so_reason = ("", "not asked for (--impls)") if report.VLLM_CUDA not in args.impls else \
            unpack_cuda_op(cuda_op_archive(args.cuda_op), Path(tmp))
        runs, failures = run_processes("mtp_bench", args.procs,
                                       lambda result: worker_command(args, so, so_reason, result), Path(tmp))
    if not runs:
        return 1
    merged = report.merge_runs(runs)
    between = ("calls back to back (a call may overlap the previous one: PDL)" if args.back_to_back else
               "a one-element kernel after each call, its time subtracted (no call overlaps the previous one)")
    method = (f"Pool: vLLM's padded pages (conv state, state, padding; slot 0 the null block), slot sets "
              f"cycling over >= {args.dram_mib} MiB; CUDA graph of >= {MIN_CALLS} calls, best of 5 replays, "
              f"per process; {between}; num_accepted_tokens in 1..T; norm_eps {NORM_EPS}, silu gate. % of copy: a "
              f"device copy of the step's bytes (state read once + written T times + q/k/v/z/out). "
              f"{len(runs)} of {args.procs} processes, {time.monotonic() - started:.0f} s. {peer_versions()}")
    text = report.render_report(merged, args.states, args.batches, args.tokens, method, heads=(H, HV))
    if failures:
        text += "\n" + "; ".join(failures) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        dump = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "method": method,
                "median": [dict(zip(("state", "B", "T", "impl"), k), us=v, spread=merged.spread[k],
                                runs=merged.runs[k]) for k, v in merged.median.items()],
                "processes": runs}
        args.out.with_suffix(".json").write_text(json.dumps(dump, indent=1))
    return 0


# ---------------------------------------------------------------- a worker: one process on the GPU


def short(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_vllm_cuda(so: str, reason: str, op: str = "fused_gdn_decode_post_conv_mtp"):
    """torch.ops._C.<op> from vLLM's library (the GDN MTP step unless another is named), or the
    reason it is not there."""
    import torch

    if not so:
        return None, reason
    try:
        torch.ops.load_library(so)
    except OSError as exc:
        # Its libcudart.so.13 is torch's own (nvidia/cu13/lib), found once loaded globally.
        if not preload_cudart():
            return None, f"cannot load {so}: {short(exc)}"
        try:
            torch.ops.load_library(so)
        except OSError as again:
            return None, f"cannot load {so}: {short(again)}"
    if not hasattr(torch.ops._C, op):
        return None, f"{so} loaded but registers no torch.ops._C.{op}"
    return getattr(torch.ops._C, op), ""


def preload_cudart() -> bool:
    import ctypes
    import site

    for base in site.getsitepackages():
        for lib in sorted(Path(base).glob("nvidia/*/lib/libcudart.so.13")):
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    return False


def load_vllm_triton():
    sys.path.insert(0, str(ROOT / ".peers" / "vllm_fla"))
    try:
        from vllm.third_party.flash_linear_attention.ops.fused_gdn_decode_post_conv_mtp import (
            fused_gdn_decode_post_conv_mtp_triton,
        )
    except Exception as exc:  # noqa: BLE001  (any import failure is a skip line, never a crash)
        return None, f"cannot import vLLM's Triton port from .peers/vllm_fla ({short(exc)}); run " \
                     "benchmarks/fetch_vllm_ops.py"
    return fused_gdn_decode_post_conv_mtp_triton, ""


def load_cudelta():
    try:
        import cudelta
        from cudelta import _native, vllm_compat
    except Exception as exc:  # noqa: BLE001
        return None, None, f"cannot import cudelta: {short(exc)}"
    st = _native.status()
    if not st.loaded and DEVICE != "cpu":  # CUDA tensors would run the PyTorch reference: no kernel to time
        return None, None, f"cudelta's native library is not loaded: {st.reason}"
    return vllm_compat.fused_gdn_decode_post_conv_mtp, cudelta.gdn_decode, ""


class Cell:
    """One (state dtype, B, T): the inputs of the step, as vLLM's GDN layer holds them."""

    def __init__(self, state: str, B: int, T: int, seed: int):
        import torch

        self.torch = torch
        self.state_name, self.B, self.T = state, B, T
        self.dtype = getattr(torch, state)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.block = HV * V * K * self.itemsize
        self.page = -(-(CONV_BYTES + self.block) // PAGE_ALIGN) * PAGE_ALIGN
        dev, bf16 = DEVICE, torch.bfloat16
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        L, qkv = B * T, 2 * H * K + HV * V
        # The qkvz projection's row: mixed_qkv (what the conv updated in place) and z are views of it.
        qkvz = torch.randn(L, qkv + HV * V, device=dev, dtype=bf16, generator=self.gen)
        self.mixed_qkv = qkvz[:, :qkv]
        self.z = qkvz[:, qkv:].unflatten(1, (HV, V))
        ba = torch.randn(L, 2 * HV, device=dev, dtype=bf16, generator=self.gen)
        self.b, self.a = ba[:, :HV], ba[:, HV:]
        self.A_log = torch.randn(HV, device=dev, generator=self.gen) * 0.5
        self.dt_bias = torch.randn(HV, device=dev, generator=self.gen)
        self.norm_weight = (1 + 0.1 * torch.randn(V, device=dev, generator=self.gen)).to(bf16)
        self.cu_seqlens = (torch.arange(B + 1, device=dev, dtype=torch.int32) * T).contiguous()
        self.acc = torch.randint(1, T + 1, (B,), device=dev, dtype=torch.int32, generator=self.gen)
        self.out = torch.empty(L, HV, V, device=dev, dtype=bf16)
        self.q = self.mixed_qkv[:, : H * K].unflatten(1, (H, K))
        self.k = self.mixed_qkv[:, H * K: 2 * H * K].unflatten(1, (H, K))
        self.v = self.mixed_qkv[:, 2 * H * K:].unflatten(1, (HV, V))
        self.moved = report.step_bytes(B, T, self.itemsize, H=H, HV=HV, K=K, V=V)
        self.sets = max(2, math.ceil(DRAM_BYTES / (B * T * self.block)))

    def pool(self, slots: int, random_bytes: bool):
        """vLLM's pages [slots, page] int8 and the state view [slots, HV, V, K] into them."""
        torch = self.torch
        pages = torch.empty(slots, self.page, device=DEVICE, dtype=torch.int8)
        if random_bytes:
            pages.random_(-128, 128, generator=self.gen)
        state = self.state_of(pages)
        state.normal_(0.0, 0.1, generator=self.gen)
        return pages, state

    def state_of(self, pages):
        """The state view [slots, HV, V, K] into pages [slots, page] (pool's, or a copy's)."""
        return pages[:, CONV_BYTES:CONV_BYTES + self.block].view(self.dtype).view(pages.shape[0], HV, V, K)

    def slot_sets(self, sets: int, consecutive: bool = False):
        """sets index tensors [B, T] int32 over slots 1..sets*B*T (a permutation: no slot twice).
        consecutive: the same slots side by side, set i slots i*B*T+1 .. (i+1)*B*T in order, so a
        set's pages are adjacent in the pool where the permutation scatters them over all of it (what
        the one-token block kernel pays for the scatter: benchmarks/results-h100-t1-scatter.md)."""
        torch = self.torch
        n = self.B * self.T
        if consecutive:
            slots = torch.arange(1, sets * n + 1, device=DEVICE, dtype=torch.int32)
        else:
            slots = torch.randperm(sets * n, device=DEVICE, generator=self.gen).to(torch.int32) + 1
        return [slots[i * n:(i + 1) * n].view(self.B, self.T).contiguous() for i in range(sets)]

    def mtp_call(self, fn):
        """fn(...) with vLLM's argument order: call(state, idx) writes self.out."""
        return lambda state, idx: fn(self.mixed_qkv, self.a, self.b, self.A_log, self.dt_bias, idx, self.cu_seqlens,
                                     self.acc, state, self.z, self.norm_weight, self.out, SCALE, NORM_EPS, "silu")

    def t1_call(self, gdn_decode):
        """cudelta's one-token decode of the same tokens (T == 1), no epilogue, into self.out."""
        return lambda state, idx: gdn_decode(self.q, self.k, self.v, None, None, state, idx[:, 0], a=self.a, b=self.b,
                                             A_log=self.A_log, dt_bias=self.dt_bias, scale=SCALE, use_qk_l2norm=True,
                                             layout="vk", invalid_slot="nonpositive", out=self.out)

    def mtp_kwargs(self) -> dict:
        """gdn_decode's options (beyond q, k, v, no precomputed gates, the pool and idx [B, T]) for
        vLLM's MTP call with the epilogue: raw gates, its contract, the gated RMSNorm."""
        return dict(a=self.a, b=self.b, A_log=self.A_log, dt_bias=self.dt_bias, scale=SCALE, use_qk_l2norm=True,
                    layout="vk", invalid_slot="nonpositive", cu_seqlens=self.cu_seqlens, num_accepted_tokens=self.acc,
                    output_gate=self.z, norm_weight=self.norm_weight, norm_eps=NORM_EPS, gate_activation="silu")

    def reference(self, state, idx, epilogue: bool, **extra):
        """cudelta's PyTorch reference of the cell's step: vLLM's MTP call with the epilogue (and
        `extra` options), or without it the one-token decode in place at idx[:, 0]."""
        from cudelta.reference import gdn_decode_reference

        if not epilogue:
            return gdn_decode_reference(self.q, self.k, self.v, None, None, state, idx[:, 0], a=self.a, b=self.b,
                                        A_log=self.A_log, dt_bias=self.dt_bias, scale=SCALE, use_qk_l2norm=True,
                                        layout="vk", invalid_slot="nonpositive")
        return gdn_decode_reference(self.q, self.k, self.v, None, None, state, idx, **self.mtp_kwargs(), **extra)


def excess(actual, expected, tol: tuple[float, float]) -> tuple[float, float]:
    """(max |actual - expected|, max of |diff| / (rtol * |expected| + frac * max |expected|)); NaN
    anywhere counts as infinitely far."""
    import torch

    a, e = actual.float(), expected.float()
    d = (a - e).abs()
    if torch.isnan(d).any():
        return math.inf, math.inf
    bound = tol[0] * e.abs() + tol[1] * float(e.abs().max()) + 1e-30
    return float(d.max()), float((d / bound).max())


def compare_pools(cell: Cell, pages, state, ref_pages, ref_state, base_pages, written) -> tuple[float, float, str]:
    """(max |Δ state|, worst ratio, problem) over every slot, in chunks; and every byte outside the
    written state blocks equal to base_pages."""
    torch = cell.torch
    worst_abs, worst = 0.0, 0.0
    tol = TOL_STATE[cell.state_name]
    for s in range(0, state.shape[0], 128):
        d, r = excess(state[s:s + 128], ref_state[s:s + 128], tol)
        worst_abs, worst = max(worst_abs, d), max(worst, r)
    slots = torch.arange(pages.shape[0], device=DEVICE)
    is_written = torch.zeros(pages.shape[0], dtype=torch.bool, device=DEVICE)
    is_written[written] = True
    kept = slots[~is_written]
    problem = ""
    if not torch.equal(pages[kept], base_pages[kept]):
        problem = "a slot no call names (null block or spare) changed"
    else:
        w = slots[is_written]
        for lo, hi in ((0, CONV_BYTES), (CONV_BYTES + cell.block, cell.page)):
            if hi > lo and not torch.equal(pages[w, lo:hi], base_pages[w, lo:hi]):
                problem = "a byte of a written page outside its state block changed"
    return worst_abs, worst, problem


def check(cell: Cell, impl: str, call, idx, base_pages, ref_out, ref_pages, written, judge=None) -> dict:
    """impl's step on its own copy of the check pool against the reference's. The output: cell.out
    against ref_out within TOL_OUT, or judge(what the call returns) -> (max |Δ|, ratio to its
    allowance) where the call's output is not cell.out's (fp8_bench's FP8 outputs)."""
    pages = base_pages.clone()
    state, ref_state = cell.state_of(pages), cell.state_of(ref_pages)
    cell.out.fill_(float("nan"))
    got = call(state, idx)
    sync()
    out_abs, out_ratio = excess(cell.out, ref_out, TOL_OUT) if judge is None else judge(got)
    st_abs, st_ratio, problem = compare_pools(cell, pages, state, ref_pages, ref_state, base_pages, written)
    details = []
    if out_ratio > 1:
        details.append(f"out max |Δ| {out_abs:.3g} ({out_ratio:.3g}x its tolerance)")
    if st_ratio > 1:
        details.append(f"state max |Δ| {st_abs:.3g} ({st_ratio:.3g}x its tolerance)")
    if problem:
        details.append(problem)
    del pages
    return dict(state=cell.state_name, B=cell.B, T=cell.T, impl=impl, ok=not details, out_max_abs=out_abs,
                state_max_abs=st_abs, detail="; ".join(details))


def sync() -> None:
    import torch

    if DEVICE != "cpu":
        torch.cuda.synchronize()


def cpu_us(fn, sets: int) -> float:
    """The dry run's clock (--device cpu): wall time per call over one pass of the sets (the
    reference is slow: the dry run checks the plumbing, not the numbers)."""
    start = time.perf_counter()
    for i in range(sets):
        fn(i)
    return (time.perf_counter() - start) * 1e6 / sets


def time_call(fn, sets: int, calls: int) -> tuple[float, str]:
    """(µs per call, "graph"), or eagerly timed (µs, "eager") where the graph cannot be captured."""
    import torch
    from kernel_bench import REPLAYS, graph_us

    if DEVICE == "cpu":
        return cpu_us(fn, sets), "cpu"
    try:
        return graph_us(fn, sets, calls), "graph"
    except Exception as exc:  # noqa: BLE001
        print(f"mtp_bench: graph capture failed ({short(exc)}); timing eagerly", file=sys.stderr)
        torch.cuda.synchronize()
    for i in range(3):
        fn(i % sets)
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i % sets)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best, "eager"


class SeparatedClock:
    """Times calls that cycle over `sets` slot sets, max(MIN_CALLS, sets) calls a graph (time_call).
    separate: a one-element kernel after every call, its own time (a graph of it alone) subtracted, so
    that no call overlaps the one before it (programmatic dependent launch), as it cannot in a model
    where other layers' kernels run in between. The one place the benchmarks spell that method."""

    def __init__(self, sets: int, separate: bool = True):
        import torch

        self.sets, self.calls, self.separate = sets, max(MIN_CALLS, sets), separate
        self.between = torch.zeros(1, device=DEVICE)
        self.gap = time_call(lambda i: self.between.add_(1), sets, self.calls)[0] if separate else 0.0

    def time(self, call) -> tuple[float, str]:
        """(µs per call(i), the gap subtracted and never below 0; time_call's mode)."""
        def step(i):
            call(i)
            if self.separate:
                self.between.add_(1)

        us, mode = time_call(step, self.sets, self.calls)
        return max(us - self.gap, 0.0), mode

    def describe(self) -> str:
        return f"{self.sets} sets, {self.calls} calls" + (f", {self.gap:.1f} µs between subtracted" if self.separate else "")


def copy_us(cell_moved: int) -> float:
    """A device copy moving cell_moved bytes (half of them copied), capped and scaled; sets of
    source and destination cycling over >= 256 MiB."""
    import torch

    chunk = report.copy_chunk_bytes(cell_moved, cap=min(report.COPY_CAP_BYTES, DRAM_BYTES))
    sets = max(2, math.ceil(DRAM_BYTES / chunk))
    src = torch.empty(sets, chunk, device=DEVICE, dtype=torch.int8)
    dst = torch.empty_like(src)
    us, _ = time_call(lambda i: dst[i].copy_(src[i]), sets, max(MIN_CALLS, sets))
    return report.copy_equivalent_us(us, chunk, cell_moved)


TRACED: set[str] = set()  # implementations whose failure was printed in full already


def check_cell(cell: Cell, calls: dict, skip, result: dict) -> dict:
    """Each implementation against the reference on a pool of the cell's slots, the null block and
    spare slots (freed on return); returns those that ran, to be timed."""
    base_pages, _ = cell.pool(1 + cell.B * cell.T + SPARE_SLOTS, random_bytes=True)
    idx = cell.slot_sets(1)[0]
    refs = {}
    checked = {}
    where = f"{cell.state_name} B={cell.B} T={cell.T}"
    for name, call in calls.items():
        epilogue = name != report.T1_ALONE
        try:
            if epilogue not in refs:
                ref_pages = base_pages.clone()
                ref_state = cell.state_of(ref_pages)
                refs[epilogue] = (cell.reference(ref_state, idx, epilogue), ref_pages)
                del ref_pages, ref_state
            written = (idx if epilogue else idx[:, :1]).reshape(-1).long()
            c = check(cell, name, call, idx, base_pages, *refs[epilogue], written)
        except Exception as exc:  # noqa: BLE001  (NotSupportedOnCUDAError, a peer's own refusal, ...)
            skip(name, short(exc))
            if not isinstance(exc, (NotImplementedError, ValueError, TypeError)) and name not in TRACED:
                TRACED.add(name)  # the first one in full, for the log: the table has one line per reason
                traceback.print_exc()
            continue
        result["checks"].append(c)
        checked[name] = call
        print(f"mtp_bench: {where} {name}: max |Δ out| {c['out_max_abs']:.3g}, max |Δ state| "
              f"{c['state_max_abs']:.3g} against the reference", file=sys.stderr)
        if not c["ok"]:
            print(f"mtp_bench: {where} {name} DISAGREES with the reference: {c['detail']}", file=sys.stderr)
    return checked


def time_cell(cell: Cell, checked: dict, skip, result: dict, separate: bool) -> str:
    """Each checked implementation on a pool whose slot sets cycle over >= 256 MiB (freed on
    return), by SeparatedClock; returns the progress line."""
    pages, pool = cell.pool(1 + cell.sets * cell.B * cell.T, random_bytes=False)
    sets = cell.slot_sets(cell.sets)
    clock = SeparatedClock(cell.sets, separate)
    line = [clock.describe() + ":"]
    for name, call in checked.items():
        try:
            us, mode = clock.time(lambda i, call=call: call(pool, sets[i]))
        except Exception as exc:  # noqa: BLE001
            skip(name, short(exc))
            continue
        result["times"].append(dict(state=cell.state_name, B=cell.B, T=cell.T, impl=name, us=us, mode=mode))
        line.append(f"{name} {us:.1f}")
    return " ".join(line)


def run_cell(state: str, B: int, T: int, impls: dict, result: dict, separate: bool = True) -> None:
    cell = Cell(state, B, T, seed=1000 * B + T)
    calls = {name: (cell.t1_call(fn) if name == report.T1_ALONE else cell.mtp_call(fn))
             for name, fn in impls.items() if name != report.T1_ALONE or T == 1}

    def skip(impl, reason):
        result["skips"].append(dict(state=state, B=B, T=T, impl=impl, reason=reason))
        print(f"mtp_bench: {state} B={B} T={T} {impl}: not timed: {reason}", file=sys.stderr)

    checked = check_cell(cell, calls, skip, result)
    empty_cache()
    line = time_cell(cell, checked, skip, result, separate)
    empty_cache()
    us = copy_us(cell.moved)
    result["times"].append(dict(state=state, B=B, T=T, impl=report.COPY, us=us, mode="graph"))
    print(f"mtp_bench: {state} B={B} T={T} ({line} µs), copy {us:.1f} µs", file=sys.stderr, flush=True)


def empty_cache() -> None:
    import torch

    if DEVICE != "cpu":
        torch.cuda.empty_cache()


def run_worker(args) -> int:
    import torch

    global DEVICE, DRAM_BYTES
    DEVICE, DRAM_BYTES = args.device, args.dram_mib << 20
    if DEVICE != "cpu" and not torch.cuda.is_available():
        print("mtp_bench: needs an NVIDIA GPU", file=sys.stderr)
        return 2
    impls, reasons = {}, {}
    if report.CUDELTA in args.impls or report.T1_ALONE in args.impls:
        mtp, decode, why = load_cudelta()
        impls[report.CUDELTA], impls[report.T1_ALONE] = mtp, decode
        reasons[report.CUDELTA] = reasons[report.T1_ALONE] = why
    if report.VLLM_CUDA in args.impls:
        impls[report.VLLM_CUDA], reasons[report.VLLM_CUDA] = load_vllm_cuda(args.cuda_op_so, args.cuda_op_reason)
    if report.VLLM_TRITON in args.impls:
        impls[report.VLLM_TRITON], reasons[report.VLLM_TRITON] = load_vllm_triton()
    loaded = {n: f for n, f in impls.items() if f is not None and n in args.impls}
    name = torch.cuda.get_device_name(0) if DEVICE != "cpu" else "CPU dry run"
    result = {"device": f"{name}, torch {torch.__version__}", "times": [], "skips": [], "checks": []}
    chunk = min(report.COPY_CAP_BYTES, DRAM_BYTES)
    result["copy_GBps"] = 2 * chunk / copy_us(2 * chunk) / 1e3
    for state in args.states:
        for B in args.batches:
            for T in args.tokens:
                for name in args.impls:
                    if name not in loaded and (name != report.T1_ALONE or T == 1):
                        result["skips"].append(dict(state=state, B=B, T=T, impl=name, reason=reasons[name]))
                try:
                    run_cell(state, B, T, loaded, result, separate=not args.back_to_back)
                except Exception as exc:  # noqa: BLE001  (the cells done so far still count)
                    traceback.print_exc()
                    for name in loaded:
                        result["skips"].append(dict(state=state, B=B, T=T, impl=name, reason=f"cell failed: "
                                                    f"{short(exc)}"))
                    if "CUDA error" in str(exc):  # the context is lost: every later call would fail alike
                        Path(args.worker).write_text(json.dumps(result))
                        return 3
                Path(args.worker).write_text(json.dumps(result))  # after every cell: a crash keeps the rest
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"B {QUICK['batches']}, T {QUICK['tokens']}")
    parser.add_argument("--batches", type=int, nargs="+", help=f"default {FULL['batches']}")
    parser.add_argument("--tokens", type=int, nargs="+", choices=range(1, 10), metavar="T",
                        help=f"tokens per request, 1..9 (vLLM 0.34's op takes 9, 0.33's 8); default {FULL['tokens']}")
    parser.add_argument("--states", nargs="+", choices=STATES, default=STATES)
    parser.add_argument("--heads", type=parse_heads, default=(H, HV), metavar="H/HV",
                        help="q/k heads / v heads, default 16/32; the issue's shapes: " +
                             ", ".join(f"{k} ({v})" for k, v in HEADS.items()))
    parser.add_argument("--impls", nargs="+", choices=report.IMPLS, default=list(report.IMPLS))
    parser.add_argument("--procs", type=int, default=3, help="processes to take medians over (default 3)")
    parser.add_argument("--back-to-back", action="store_true",
                        help="no kernel between calls: a call may overlap the previous one (PDL), as in "
                             "kernel_bench, not as in a model")
    parser.add_argument("--cuda-op", type=Path, help="vLLM's library (.so or .so.xz); default .peers/cuda_op/*.so.xz")
    parser.add_argument("--out", type=Path, help="write the tables here (markdown) and the numbers beside it (.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    # A dry run of every step without a GPU (CPU tensors, cudelta's reference as cudelta, the peers
    # skipped, wall-clock times, small pools): what tests/unit runs.
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--dram-mib", type=int, default=DRAM_BYTES >> 20, help=argparse.SUPPRESS)
    parser.add_argument("--cuda-op-so", default="", help=argparse.SUPPRESS)
    parser.add_argument("--cuda-op-reason", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.batches = args.batches or preset["batches"]
    args.tokens = args.tokens or preset["tokens"]
    if args.procs < 1:
        parser.error(f"--procs must be >= 1; got {args.procs}")
    if any(b < 1 for b in args.batches):
        parser.error(f"--batches must be >= 1; got {args.batches}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    set_heads(*args.heads)
    if args.worker:
        return run_worker(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
