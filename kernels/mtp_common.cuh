// What the multi-token kernels (mtp_one.cuh, mtp_stream.cuh, mtp_resident.cuh) share: how a warp
// holds a tile of the state, the tile's loads and stores, the epilogue's gate, and request_span,
// which every one of them starts with (the request's rows, its starting slot, the skip and zero
// rules of the contract).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"
#include "common/dtype.cuh"
#include "common/host.cuh"
#include "common/ptx.cuh"
#include "common/step.cuh"

namespace cudelta {
namespace {

// How a warp holds its BW value rows x K key channels. A lane holds NV value rows x NK key
// channels, one reduction over K adds across the LPR lanes that hold the same rows.
//   vk ([V, K] rows contiguous along K): a row's K split over LPR lanes in 16-byte chunks (CPL
//      chunks a lane), RPP rows per load instruction.
//   kv ([K, V] rows contiguous along V): lane l holds key rows l, l + 32, ..., each as the warp's
//      BW columns (CPR chunks), so a load instruction covers 32 rows' 32-byte (or wider) segments.
template <bool VK, int K, typename ST, int BW>
struct MtpShape {
  static constexpr int E = Chunk<ST>::E;
  static constexpr int KC = K / E;
  static constexpr int LPR = VK ? (KC < 32 ? KC : 32) : 32;
  static constexpr int CPL = VK ? KC / LPR : 1;
  static constexpr int RPP = VK ? 32 / LPR : 1;
  static constexpr int NV = VK ? BW / RPP : BW;
  static constexpr int NK = VK ? CPL * E : K / 32;
  static constexpr int CPR = VK ? CPL : BW / E;
  static_assert(NV >= 1 && NK >= 1 && (VK || BW % E == 0), "multi-token tile shape");
};

template <typename Sh, bool VK>
__device__ __forceinline__ int key_of(int lane, int b) {
  if constexpr (VK) return Sh::E * ((b / Sh::E) * Sh::LPR + lane % Sh::LPR) + b % Sh::E;
  else return lane + 32 * b;
}
template <typename Sh, bool VK>
__device__ __forceinline__ int row_of(int lane, int a) {
  if constexpr (VK) return lane / Sh::LPR + Sh::RPP * a;
  else return a;
}

template <int LPR>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = 1; o < LPR; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The warp's tile of one slot: load into fp32 registers, store narrowed to the state dtype. S: the
// head's block in the slot; v0: the warp's first value row.
template <bool VK, int K, typename ST, int BW>
__device__ __forceinline__ void tile_load(const GdnDecodeParams& p, const ST* S, int v0, int lane,
                                          float (&h)[MtpShape<VK, K, ST, BW>::NV][MtpShape<VK, K, ST, BW>::NK]) {
  using Sh = MtpShape<VK, K, ST, BW>;
  using C = Chunk<ST>;
  using Raw = typename C::Raw;
  constexpr int E = Sh::E;
  if constexpr (VK) {
#pragma unroll
    for (int a = 0; a < Sh::NV; ++a) {
      const Raw* row = reinterpret_cast<const Raw*>(S + int64_t(v0 + row_of<Sh, VK>(lane, a)) * K);
#pragma unroll
      for (int i = 0; i < Sh::CPL; ++i) C::widen(row[i * Sh::LPR + lane % Sh::LPR], &h[a][i * E]);
    }
  } else {
#pragma unroll
    for (int b = 0; b < Sh::NK; ++b) {
      const Raw* row = reinterpret_cast<const Raw*>(S + int64_t(key_of<Sh, VK>(lane, b)) * p.V + v0);
#pragma unroll
      for (int c = 0; c < Sh::CPR; ++c) {
        float x[E];
        C::widen(row[c], x);
#pragma unroll
        for (int m = 0; m < E; ++m) h[c * E + m][b] = x[m];
      }
    }
  }
}

// Whether tile_store stores evict-first (state_store), as the few-token kernel stores its
// checkpoints: no kernel of the step reads a stored state back, so the T states a request writes
// need not hold L2 against the loads still to come (the likely reason for the gain; not profiled).
// The streaming kernel, 16/32 heads, µs: H200 bf16 B=8 T=4 / T=8 17.45 / 28.1 -> 16.85 / 26.7, B=32
// T=2 35.7 -> 34.45 (0.99x -> 1.03x vLLM's op), B=512 T=8 1403.5 -> 1410.5; H100 bf16 B=8 T=4 / T=8
// 21.05 / 35.45 -> 20.55 / 34.5, fp32 B=8 T=8 60.55 -> 59.2; elsewhere level or up to 1% faster
// (benchmarks/results-h200-mtp.md, results-h100-mtp.md). Not in sm_120 images: there ptxas spilled
// 32 bytes a thread of the streaming kernel's bf16 build with it (no such GPU here to time either).
__host__ __device__ constexpr bool evict_first_checkpoints() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
  return false;
#else
  return true;
#endif
}

template <bool VK, int K, typename ST, int BW>
__device__ __forceinline__ void tile_store(const GdnDecodeParams& p, ST* S, int v0, int lane,
                                           const float (&h)[MtpShape<VK, K, ST, BW>::NV][MtpShape<VK, K, ST, BW>::NK]) {
  using Sh = MtpShape<VK, K, ST, BW>;
  using C = Chunk<ST>;
  using Raw = typename C::Raw;
  constexpr bool kEvictFirst = evict_first_checkpoints();
  constexpr int E = Sh::E;
  if constexpr (VK) {
#pragma unroll
    for (int a = 0; a < Sh::NV; ++a) {
      Raw* row = reinterpret_cast<Raw*>(S + int64_t(v0 + row_of<Sh, VK>(lane, a)) * K);
#pragma unroll
      for (int i = 0; i < Sh::CPL; ++i) state_store<kEvictFirst>(row + i * Sh::LPR + lane % Sh::LPR, C::narrow(&h[a][i * E]));
    }
  } else {
#pragma unroll
    for (int b = 0; b < Sh::NK; ++b) {
      Raw* row = reinterpret_cast<Raw*>(S + int64_t(key_of<Sh, VK>(lane, b)) * p.V + v0);
#pragma unroll
      for (int c = 0; c < Sh::CPR; ++c) {
        float x[E];
#pragma unroll
        for (int m = 0; m < E; ++m) x[m] = h[c * E + m][b];
        state_store<kEvictFirst>(row + c, C::narrow(x));
      }
    }
  }
}

__device__ __forceinline__ float gate_act(float z, int activation) {
  const float s = __frcp_rn(1.f + __expf(-z));
  return activation == 2 ? s : z * s;
}

// The gated RMSNorm epilogue of one output: o (already rounded to out's dtype) times 1 / rms over
// the head's V outputs (sumsq: the sum of their squares), times w and act(z). Every kernel with the
// epilogue ends in this one expression, so that they all round it alike.
__device__ __forceinline__ float gated_rms_norm(const GdnDecodeParams& p, float o, float sumsq, float w, float z) {
  return o * rsqrtf(sumsq / static_cast<float>(p.V) + p.norm_eps) * w * gate_act(z, p.gate_activation);
}

// 1 / s rounded to nearest, as __frcp_rn computes it, without its slow path, which is a call: in the
// resident kernel's token loop that call took ptxas from 128 registers to 32 (K = 256, fp32, kv;
// 916 -> 2,228 bytes of spills), and hoisted out of it, another build from 128 to 64. __frcp_rn's fast
// path (its sm_90a SASS) is this: MUFU.RCP and one FMA-refined step, for exponent fields 1-252; it
// leaves the rest to the call. Here those are scaled by 2^+-64 into the range first (exact), and
// zero, the infinities and NaN give IEEE's results. Past exponent 252, 1 / s is below 2^-125, where
// the last scaling may round a subnormal a second time; any output times it is an e4m3 zero anyway.
__device__ __forceinline__ float reciprocal_rn(float s) {
  const uint32_t e = (__float_as_uint(s) >> 23) & 0xffu;
  if (e == 0xffu) return isnan(s) ? s : copysignf(0.f, s);
  if (s == 0.f) return copysignf(__int_as_float(0x7f800000), s);
  const float scale = e == 0u ? 0x1p64f : (e > 252u ? 0x1p-64f : 1.f);
  const float t = s * scale;
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(t));
  r = __fmaf_rn(r, -__fmaf_rn(t, r, -1.f), r);
  return r * scale;
}

// The output stores of the kernels that may take the epilogue's FP8 output (p.out_scale): out is v's
// dtype, or e4m3, in the order of vLLM's Qwen3.5 gated-norm kernel and of
// cudelta.reference.static_fp8: rounded to v's dtype, times the correctly rounded 1 / scale
// (reciprocal_rn; a zero stays a zero, whatever the scale), clamped to +-448 (a NaN stays NaN, as
// torch's clamp keeps it), rounded to the nearest e4m3 value. The scale is read here, on the device,
// so that a CUDA graph replays with its current value; with a plain load, which the compiler cannot
// move above the stores before it (an __ldg it hoisted over the few-token kernel's token steps, when
// that kernel still stored through here, and ptxas spilled there). store_fp8: the e4m3 store alone,
// for a build that only makes the FP8 output (the few-token kernel's F8).
__device__ __forceinline__ void store_fp8(const GdnDecodeParams& p, int64_t i, float y) {
  float x = rounded(y, p.dtype);
  x = x == 0.f ? x : x * reciprocal_rn(*p.out_scale);
  x = x > 448.f ? 448.f : (x < -448.f ? -448.f : x);
  static_cast<__nv_fp8_storage_t*>(p.out)[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ void store_out(const GdnDecodeParams& p, int64_t i, float y) {
  if (p.out_scale == nullptr) store_f(p.out, p.dtype, i, y);
  else store_fp8(p, i, y);
}

// A zero output (a row the contract zeroes): no scale to read, e4m3's zero is a zero byte.
__device__ __forceinline__ void store_out_zero(const GdnDecodeParams& p, int64_t i) {
  if (p.out_scale == nullptr) store_f(p.out, p.dtype, i, 0.f);
  else static_cast<__nv_fp8_storage_t*>(p.out)[i] = 0;
}

// Block n's request in both multi-token kernels: its token rows [bos, bos + len) and the slot its
// state starts from. Returns whether the block computes; where it does not, `zero_rows(first, end)`
// (the kernel's own division of rows among its threads) has zeroed what the call's contract says:
// the rows outside every request (block N, the extra block of a cu_seqlens launch) or the rows of
// a request without a valid starting slot.
template <typename ZeroRows>
__device__ __forceinline__ bool request_span(const GdnDecodeParams& p, int64_t n, ZeroRows& zero_rows, int64_t& bos,
                                             int64_t& len, int64_t& start) {
  if (n == p.N) {
    zero_rows(0, load_index(p.cu_seqlens, p.cu_is_int64, 0));
    zero_rows(load_index(p.cu_seqlens, p.cu_is_int64, p.N), p.L);
    return false;
  }
  // Every index the request needs is loaded before any is used, so that the state's load waits on
  // one round trip: lane c loads column c of the request's idx row, lanes 0-2 also
  // num_accepted_tokens[n], cu_seqlens[n] and [n + 1], each as raw bits (IndexBits), and shuffles
  // hand them round. Loaded alike by every lane, the compiler kept each index in a uniform register
  // and waited for it as it was loaded; widened where it was loaded, under a condition, the wait
  // came there: a round trip an index (sm_90a SASS).
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t cols = p.idx_columns;
  const bool varlen = p.cu_seqlens != nullptr;
  const int64_t column_at = cols > 0 ? n * cols + (lane < cols ? lane : cols - 1) : n;
  const IndexBits column = load_index_bits(p.idx, p.idx_is_int64, column_at);
  const bool lane_acc = lane == 0 && p.accepted != nullptr, lane_cu = lane >= 1 && lane <= 2 && varlen;
  const bool mine_is64 = lane_acc ? p.accepted_is_int64 : lane_cu ? p.cu_is_int64 : p.idx_is_int64;
  const IndexBits mine = load_index_bits(lane_acc ? p.accepted : lane_cu ? p.cu_seqlens : p.idx, mine_is64,
                                         lane_acc ? n : lane_cu ? n + lane - 1 : column_at);
  const int64_t mine_index = widen_index(mine, mine_is64);
  const int64_t acc = p.accepted != nullptr ? __shfl_sync(0xffffffffu, mine_index, 0) : 1;
  bos = varlen ? __shfl_sync(0xffffffffu, mine_index, 1) : n * p.tokens;
  len = varlen ? __shfl_sync(0xffffffffu, mine_index, 2) - bos : p.tokens;
  // cu_seqlens is not read on the host (no synchronisation): a request whose rows fall outside the
  // call's, or outnumber idx's columns, is skipped, never read or written out of bounds.
  if (len <= 0 || bos < 0 || bos + len > p.L || (cols > 0 && len > cols)) return false;
  const int64_t col = cols > 0 ? acc - 1 : 0;  // idx [N]: its one column
  start = __shfl_sync(0xffffffffu, widen_index(column, p.idx_is_int64), static_cast<int>(col & 31));
  if (col < 0 || (cols > 0 && col >= cols)) start = -1;
  else if (col >= 32) start = load_index(p.idx, p.idx_is_int64, n * cols + col);
  if (!slot_valid(p, start)) {
    zero_rows(bos, bos + len);
    return false;
  }
  return true;
}

// A block's (request, value head) in request_head_grid(p) (request_blocks(p) x HV along x), heads
// fastest: the blocks of request N (a cu_seqlens launch's extra blocks, which only zero rows) come
// last in the order blocks are scheduled, after every request's (interleaved, they cost a grid of one
// block an SM a second wave: H200, bf16 T=1 B=4 7.2 -> 6.5 µs). Requests fastest instead: H100, bf16
// T=1, 4/8 heads B=32 and 2/4 B=64 0.14-0.36 µs faster on random slots, 0.26-0.36 slower on
// consecutive ones, 16/32 B=4 and 8 0.18-0.57 slower (benchmarks/results-h100-t1-scatter.md).
__device__ __forceinline__ int64_t block_request(const GdnDecodeParams& p) { return blockIdx.x / static_cast<uint32_t>(p.HV); }
__device__ __forceinline__ int64_t block_head(const GdnDecodeParams& p) { return blockIdx.x % static_cast<uint32_t>(p.HV); }

// request_span for a block that holds all V rows of its (request, value head): its threads share
// the rows to zero (the one-token block kernel, the few-token kernel).
__device__ __forceinline__ bool head_request_span(const GdnDecodeParams& p, int64_t n, int64_t hv, int64_t& bos,
                                                  int64_t& len, int64_t& start) {
  const int V = static_cast<int>(p.V);
  auto zero_rows = [&](int64_t first, int64_t end) {
    for (int64_t i = threadIdx.x; i < (end - first) * V; i += blockDim.x)
      store_out_zero(p, (first + i / V) * p.out_stride_n + hv * p.out_stride_h + i % V);
  };
  return request_span(p, n, zero_rows, bos, len, start);
}

// The grid's blocks along the requests: one a request, and with cu_seqlens one more, which zeroes
// the rows after cu_seqlens[N] (request_span).
inline unsigned request_blocks(const GdnDecodeParams& p) {
  return static_cast<unsigned>(p.N + (p.cu_seqlens != nullptr ? 1 : 0));
}

// The grid block_request and block_head read: request_blocks(p) x HV along x; z, a head's row groups.
inline dim3 request_head_grid(const GdnDecodeParams& p, unsigned z = 1) {
  return dim3(request_blocks(p) * static_cast<unsigned>(p.HV), 1, z);
}

// vLLM's GDN call as its layer makes it: bf16 q, k, v, z and out, raw bf16 gates a and b, int32
// idx, cu_seqlens and num_accepted_tokens, q and k l2-normalised, no FP8 output, and V = 128 (the
// value heads of Qwen3-Next and Qwen3.5). A build that takes these as constants (the "profile"
// builds: the streaming kernel's VP, the few-token kernel's) drops the branches each runtime dtype
// or index width costs where it is read. In small grids those are the time: a warp's path before
// its token loop ran 1,168 instructions against vLLM 0.34 op's 389, bound by their dependent
// waits, not by the loads (ncu_mtp.py --source, H200, 4/8 heads, B=1, T=8).
constexpr int64_t kVllmProfileV = 128;
inline bool vllm_profile(const GdnDecodeParams& p) {
  return p.dtype == DType::kBFloat16 && (p.gate_activation == 0 || p.z_dtype == DType::kBFloat16) && p.gate_raw && p.g_dtype == DType::kBFloat16 &&
         p.beta_raw && p.beta_dtype == DType::kBFloat16 && !p.idx_is_int64 && !p.cu_is_int64 && !p.accepted_is_int64 &&
         p.out_scale == nullptr && p.use_qk_l2norm && p.V == kVllmProfileV;
}

// The profile's fields as its builds hold them. Every field set here is one vllm_profile asks for
// (z's dtype where the call has an epilogue; without one z is not read), so a call in the profile
// runs with the values it had: tests/unit/test_vllm_profile.py flips each byte of such a call. V is
// set by the builds whose geometry holds it (it spilled in the staging-first one).
__host__ __device__ __forceinline__ void fix_vllm_profile(GdnDecodeParams& p) {
  p.dtype = p.z_dtype = p.g_dtype = p.beta_dtype = DType::kBFloat16;
  p.gate_raw = p.beta_raw = p.use_qk_l2norm = true;
  p.idx_is_int64 = p.cu_is_int64 = p.accepted_is_int64 = false;
  p.out_scale = nullptr;
}

// Whether this compile pass gives the profile builds their fixed body. From sm_100 they compile the
// generic one: there the streaming kernel's spilled 80-88 bytes a thread at the 128-register cap
// (ptxas -v, shipped flags; sm_80 and sm_90a none), and no GPU here times either kernel's.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr bool kProfileBodies = false;
#else
constexpr bool kProfileBodies = true;
#endif

// A call in the profile as its build reads it: the fields fix_vllm_profile sets, and with GEOMETRY
// K and V too (the builds whose tiles V = 128 fixes).
template <int K, bool GEOMETRY>
__device__ __forceinline__ GdnDecodeParams vllm_profile_params(const GdnDecodeParams& p) {
  GdnDecodeParams fixed = p;
  fix_vllm_profile(fixed);
  if constexpr (GEOMETRY) {
    fixed.K = K;
    fixed.V = kVllmProfileV;
  }
  return fixed;
}

// The kernel a launch takes: the profile build for vLLM's call, the generic one for any other (the
// dynamic shared memory set on the one launched).
template <auto Generic, auto Profile>
int launch_profile_or_generic(const GdnDecodeParams& p, dim3 grid, dim3 block, cudaStream_t stream, size_t smem = 0,
                              dim3 cluster = dim3(1, 1, 1)) {
  const bool vp = vllm_profile(p);
  if (smem > 0) {
    if (const int err = vp ? allow_dynamic_smem<Profile>(p.device, smem) : allow_dynamic_smem<Generic>(p.device, smem)) return err;
  }
  return launch_decode(vp ? Profile : Generic, grid, block, p, stream, smem, cluster);
}

}  // namespace
}  // namespace cudelta
