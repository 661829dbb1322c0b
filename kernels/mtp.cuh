// The multi-token kernel: several tokens per request in order (speculative decoding), the state
// after each token stored to its checkpoint slot, and the gated RMSNorm epilogue; both layouts.
//
// One block per (request, value head), its warps splitting the head's V value rows (columns in
// layout kv) BW a warp. The head's state is read once into fp32 registers, carried in fp32 from
// token to token (a bf16 state is rounded only where it is stored), and written once per
// checkpoint. Every reduction of a token's step stays inside a warp; the block meets only for the
// epilogue's mean over V, one __syncthreads a token (a double-buffered slot per warp).
#pragma once

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

// The streaming kernel's launch (launch_mtp_stream): more warps a block while the grid's warps
// number at most kMtpWideWarpsPerSm an SM, else kMtpNarrowWarps a block.
constexpr int64_t kMtpWideWarpsPerSm = 64;
constexpr int64_t kMtpNarrowWarps = 4;

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

__device__ __forceinline__ int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
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

template <bool VK, int K, typename ST, int BW>
__device__ __forceinline__ void tile_store(const GdnDecodeParams& p, ST* S, int v0, int lane,
                                           const float (&h)[MtpShape<VK, K, ST, BW>::NV][MtpShape<VK, K, ST, BW>::NK]) {
  using Sh = MtpShape<VK, K, ST, BW>;
  using C = Chunk<ST>;
  using Raw = typename C::Raw;
  constexpr int E = Sh::E;
  if constexpr (VK) {
#pragma unroll
    for (int a = 0; a < Sh::NV; ++a) {
      Raw* row = reinterpret_cast<Raw*>(S + int64_t(v0 + row_of<Sh, VK>(lane, a)) * K);
#pragma unroll
      for (int i = 0; i < Sh::CPL; ++i) row[i * Sh::LPR + lane % Sh::LPR] = C::narrow(&h[a][i * E]);
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
        row[c] = C::narrow(x);
      }
    }
  }
}

__device__ __forceinline__ float gate_act(float z, int activation) {
  const float s = __frcp_rn(1.f + __expf(-z));
  return activation == 2 ? s : z * s;
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
  if (p.cu_seqlens != nullptr) {
    bos = load_index(p.cu_seqlens, p.cu_is_int64, n);
    len = load_index(p.cu_seqlens, p.cu_is_int64, n + 1) - bos;
  } else {
    bos = n * p.tokens;
    len = p.tokens;
  }
  // cu_seqlens is not read on the host (no synchronisation): a request whose rows fall outside the
  // call's, or outnumber idx's columns, is skipped, never read or written out of bounds.
  if (len <= 0 || bos < 0 || bos + len > p.L || (p.idx_columns > 0 && len > p.idx_columns)) return false;
  if (p.idx_columns > 0) {
    const int64_t col = p.accepted != nullptr ? load_index(p.accepted, p.accepted_is_int64, n) - 1 : 0;
    start = col >= 0 && col < p.idx_columns ? load_index(p.idx, p.idx_is_int64, n * p.idx_columns + col) : -1;
  } else {
    start = load_index(p.idx, p.idx_is_int64, n);
  }
  if (!slot_valid(p, start)) {
    zero_rows(bos, bos + len);
    return false;
  }
  return true;
}

// Rounds x to the output dtype and back: the epilogue reads the output as stored (vLLM's order).
__device__ __forceinline__ float rounded(float x, DType t) {
  if (t == DType::kBFloat16) return __bfloat162float(__float2bfloat16_rn(x));
  if (t == DType::kFloat16) return __half2float(__float2half_rn(x));
  return x;
}

template <bool VK, int K, typename ST, int BW, bool PER_CHANNEL>
__global__ void __launch_bounds__(512) decode_mtp_kernel(const GdnDecodeParams p) {
  using Sh = MtpShape<VK, K, ST, BW>;
  constexpr int NV = Sh::NV, NK = Sh::NK, LPR = Sh::LPR;
  // After the transposing butterfly each lane holds the sums of one of its rows, `mine`, shared
  // with the F - 1 other lanes of its group that end with the same row.
  constexpr int F = LPR / NV;
  static_assert(NV <= LPR && (NV & (NV - 1)) == 0, "one row a lane after the butterfly");
  __shared__ float sumsq[2][16];
  pdl_enter();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int v0 = warp * BW;
  const int group = lane - lane % LPR, mine = (lane % LPR) / F;
  const bool writer = lane % F == 0;
  const int my_row = v0 + row_of<Sh, VK>(lane, mine);
  const int64_t n = blockIdx.x, hv = blockIdx.y, h = qk_head(p, static_cast<uint32_t>(hv));
  const bool epilogue = p.gate_activation > 0;

  auto zero_rows = [&](int64_t first, int64_t end) {
    if (!writer) return;
    for (int64_t tok = first; tok < end; ++tok) store_f(p.out, p.dtype, tok * p.out_stride_n + hv * p.out_stride_h + my_row, 0.f);
  };
  int64_t bos, len, start;
  if (!request_span(p, n, zero_rows, bos, len, start)) return;
  const int64_t block = p.K * p.V;
  ST* const pool = static_cast<ST*>(p.state);
  float hs[NV][NK];
  tile_load<VK, K, ST, BW>(p, pool + start * p.state_stride_p + hv * block, v0, lane, hs);
  const uint32_t a_log_bits = load_a_log_bits(p, hv);
  const float w = epilogue ? load_f(p.norm_weight, p.norm_weight_dtype, my_row) : 0.f;

  for (int64_t t = 0; t < len; ++t) {
    const int64_t tok = bos + t;
    // Every load of the token before any use.
    const int64_t qo = tok * p.q_stride_n + h * p.q_stride_h, ko = tok * p.k_stride_n + h * p.k_stride_h;
    float qv[NK], kv[NK];
    if constexpr (VK) {
      constexpr int E = Sh::E;
      RunBits<E> qb[Sh::CPL], kb[Sh::CPL];
#pragma unroll
      for (int i = 0; i < Sh::CPL; ++i) {
        qb[i] = load_run_bits<E>(p.q, p.dtype, qo + key_of<Sh, VK>(lane, i * E), p.qk_aligned);
        kb[i] = load_run_bits<E>(p.k, p.dtype, ko + key_of<Sh, VK>(lane, i * E), p.qk_aligned);
      }
#pragma unroll
      for (int i = 0; i < Sh::CPL; ++i) {
        widen_run<E>(qb[i], p.dtype, p.qk_aligned, &qv[i * E]);
        widen_run<E>(kb[i], p.dtype, p.qk_aligned, &kv[i * E]);
      }
    } else {
      uint32_t qb[NK], kb[NK];
#pragma unroll
      for (int b = 0; b < NK; ++b) {
        qb[b] = load_bits(p.q, p.dtype, qo + key_of<Sh, VK>(lane, b));
        kb[b] = load_bits(p.k, p.dtype, ko + key_of<Sh, VK>(lane, b));
      }
      widen_all<NK>(qb, p.dtype, qv);
      widen_all<NK>(kb, p.dtype, kv);
    }
    const int64_t o_at = tok * p.out_stride_n + hv * p.out_stride_h + my_row;
    const uint32_t v_bits = load_bits(p.v, p.dtype, tok * p.v_stride_n + hv * p.v_stride_h + my_row);
    DecayBits d_bits[PER_CHANNEL ? NK : 1];
    if constexpr (PER_CHANNEL) {
#pragma unroll
      for (int b = 0; b < NK; ++b) d_bits[b] = load_decay_bits(p, tok, hv, key_of<Sh, VK>(lane, b));
    } else {
      d_bits[0] = load_decay_bits(p, tok, hv, -1);
    }
    const uint32_t beta_bits = load_beta_bits(p, tok, hv);
    const uint32_t z_bits = epilogue ? load_bits(p.z, p.z_dtype, tok * p.z_stride_n + hv * p.z_stride_h + my_row) : 0u;

    float decay[NK];
    if constexpr (PER_CHANNEL) {
      decays<NK>(p, d_bits, a_log_bits, decay);
    } else {
      const float d = decay_of(p, d_bits[0], a_log_bits);
#pragma unroll
      for (int b = 0; b < NK; ++b) decay[b] = d;
    }
    const float beta = beta_of(p, beta_bits);
    float sqq = 0.f, skk = 0.f, sqk = 0.f;
#pragma unroll
    for (int b = 0; b < NK; ++b) {
      sqq += qv[b] * qv[b];
      skk += kv[b] * kv[b];
      sqk += qv[b] * kv[b];
    }
    const QkScales sc = warp_qk_scales<1, LPR>(p, sqq, skk, sqk);
    float kk[NK], kd[NK], qd[NK];
#pragma unroll
    for (int b = 0; b < NK; ++b) {
      kk[b] = kv[b] * sc.k;
      kd[b] = kk[b] * decay[b];
      qd[b] = qv[b] * sc.q * decay[b];
    }
    // The decayed state's products with k and q, each row's sums left on its lanes by the butterfly.
    float pk[NV], pq[NV];
#pragma unroll
    for (int a = 0; a < NV; ++a) {
      pk[a] = 0.f;
      pq[a] = 0.f;
#pragma unroll
      for (int b = 0; b < NK; ++b) {
        pk[a] += hs[a][b] * kd[b];
        pq[a] += hs[a][b] * qd[b];
      }
    }
    butterfly<NV, LPR / 2>(pk, pq, lane);
    const float u_mine = beta * (widen_bits(v_bits, p.dtype) - pk[0]);
    float o = rounded(pq[0] + u_mine * sc.qk, p.dtype);
    if (epilogue) {
      // Mean of o^2 over the head's V: each row counted by its writer lane.
      const float ss = warp_sum(writer ? o * o : 0.f);
      float* slot_sums = sumsq[t & 1];
      if (lane == 0) slot_sums[warp] = ss;
      __syncthreads();
      float total = 0.f;
      for (int i = 0; i < warps; ++i) total += slot_sums[i];
      o = o * rsqrtf(total / static_cast<float>(p.V) + p.norm_eps) * w * gate_act(widen_bits(z_bits, p.z_dtype), p.gate_activation);
    }
    if (writer) store_f(p.out, p.dtype, o_at, o);
    // The update, each row's u brought back from its lanes.
#pragma unroll
    for (int a = 0; a < NV; ++a) {
      const float u = __shfl_sync(0xffffffffu, u_mine, group + a * F);
#pragma unroll
      for (int b = 0; b < NK; ++b) hs[a][b] = hs[a][b] * decay[b] + kk[b] * u;
    }
    if (p.idx_columns > 0) {
      const int64_t dst = load_index(p.idx, p.idx_is_int64, n * p.idx_columns + t);
      if (slot_valid(p, dst)) tile_store<VK, K, ST, BW>(p, pool + dst * p.state_stride_p + hv * block, v0, lane, hs);
    }
  }
  if (p.idx_columns == 0) tile_store<VK, K, ST, BW>(p, pool + start * p.state_stride_p + hv * block, v0, lane, hs);
}

// The streaming kernel: a request of at most kStreamTokens tokens a pass (any number with idx [N],
// whose one slot carries the state from pass to pass), its tokens' q, k, gates staged once in shared
// memory, then each warp streams row chunks of the head's state through its registers: a chunk of
// R rows is loaded (the next one already in flight), taken through every token, stored at each
// checkpoint and dropped. Rows are independent in the recurrence (they share only the tokens'
// scalars and the epilogue's mean over V), so a head needs registers for one chunk a warp, not the
// whole head: many more heads per SM are in flight than in decode_mtp_kernel, which keeps the whole
// head in registers and is left for requests with more than kStreamTokens checkpoint columns.
constexpr int kStreamTokens = 8;
constexpr int kStreamRows = 8;

template <bool VK, int K, typename ST>
using StreamShape = MtpShape<VK, K, ST, kStreamRows>;

template <bool VK, int K, typename ST>
struct RawTile {
  using Sh = StreamShape<VK, K, ST>;
  typename Chunk<ST>::Raw r[VK ? Sh::NV : Sh::NK][Sh::CPR];
};

template <bool VK, int K, typename ST>
__device__ __forceinline__ void raw_load(const GdnDecodeParams& p, const ST* S, int v0, int lane, RawTile<VK, K, ST>& t) {
  using Sh = StreamShape<VK, K, ST>;
  using Raw = typename Chunk<ST>::Raw;
  if constexpr (VK) {
#pragma unroll
    for (int a = 0; a < Sh::NV; ++a) {
      const Raw* row = reinterpret_cast<const Raw*>(S + int64_t(v0 + row_of<Sh, VK>(lane, a)) * K);
#pragma unroll
      for (int i = 0; i < Sh::CPL; ++i) t.r[a][i] = row[i * Sh::LPR + lane % Sh::LPR];
    }
  } else {
#pragma unroll
    for (int b = 0; b < Sh::NK; ++b) {
      const Raw* row = reinterpret_cast<const Raw*>(S + int64_t(key_of<Sh, VK>(lane, b)) * p.V + v0);
#pragma unroll
      for (int c = 0; c < Sh::CPR; ++c) t.r[b][c] = row[c];
    }
  }
}

template <bool VK, int K, typename ST>
__device__ __forceinline__ void raw_widen(const RawTile<VK, K, ST>& t,
                                          float (&h)[StreamShape<VK, K, ST>::NV][StreamShape<VK, K, ST>::NK]) {
  using Sh = StreamShape<VK, K, ST>;
  using C = Chunk<ST>;
  constexpr int E = Sh::E;
  if constexpr (VK) {
#pragma unroll
    for (int a = 0; a < Sh::NV; ++a) {
#pragma unroll
      for (int i = 0; i < Sh::CPL; ++i) C::widen(t.r[a][i], &h[a][i * E]);
    }
  } else {
#pragma unroll
    for (int b = 0; b < Sh::NK; ++b) {
#pragma unroll
      for (int c = 0; c < Sh::CPR; ++c) {
        float x[E];
        C::widen(t.r[b][c], x);
#pragma unroll
        for (int m = 0; m < E; ++m) h[c * E + m][b] = x[m];
      }
    }
  }
}

template <bool VK, int K, typename ST, bool PER_CHANNEL>
__global__ void __launch_bounds__(512) decode_mtp_stream_kernel(const GdnDecodeParams p) {
  using Sh = StreamShape<VK, K, ST>;
  constexpr int NV = Sh::NV, NK = Sh::NK, LPR = Sh::LPR, F = LPR / NV, R = kStreamRows, TS = kStreamTokens;
  static_assert(NV <= LPR && (NV & (NV - 1)) == 0, "one row a lane after the butterfly");
  // The staged tokens: k and q scaled (l2-normalised, q times the attention scale), the per-channel
  // decay (KDA), and per token beta, k.q and the head's decay (GDN); the epilogue's outputs and sums.
  __shared__ float s_k[TS][K], s_q[TS][K], s_d[PER_CHANNEL ? TS : 1][PER_CHANNEL ? K : 1];
  __shared__ float s_beta[TS], s_qk[TS], s_decay[TS], s_rstd[TS];
  __shared__ float s_o[TS][256], s_v[TS][256];
  pdl_enter();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int group = lane - lane % LPR, mine = (lane % LPR) / F;
  const bool writer = lane % F == 0;
  const int64_t n = blockIdx.x, hv = blockIdx.y, h = qk_head(p, static_cast<uint32_t>(hv));
  const bool epilogue = p.gate_activation > 0;
  const int V = static_cast<int>(p.V);

  auto zero_rows = [&](int64_t first, int64_t end) {
    for (int64_t i = threadIdx.x; i < (end - first) * V; i += blockDim.x)
      store_f(p.out, p.dtype, (first + i / V) * p.out_stride_n + hv * p.out_stride_h + i % V, 0.f);
  };
  int64_t bos, len, start;
  if (!request_span(p, n, zero_rows, bos, len, start)) return;
  const int64_t block = p.K * p.V;
  ST* const pool = static_cast<ST*>(p.state);
  ST* const src = pool + start * p.state_stride_p + hv * block;
  const uint32_t a_log_bits = load_a_log_bits(p, hv);
  const int chunks = V / R;
  // A chunk's state, loaded one chunk ahead, and the first chunk before the tokens are staged, so
  // that its round trip overlaps the staging's.
  RawTile<VK, K, ST> next;
  auto prefetch = [&](int c) { raw_load<VK, K, ST>(p, src, c * R, lane, next); };
  if (warp < chunks) prefetch(warp);

  for (int64_t g0 = 0; g0 < len; g0 += TS) {
    const int tg = static_cast<int>(len - g0 < TS ? len - g0 : TS);
    // The epilogue's z and w of this thread's outputs, in flight while the step runs.
    constexpr int ZPT = 4;  // outputs a thread finishes from registers (more: loaded at the end)
    uint32_t z_bits[ZPT], w_bits[ZPT];
    if (epilogue) {
#pragma unroll
      for (int j = 0; j < ZPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        const bool mine_i = i < tg * V;
        const int t = mine_i ? i / V : 0, v = mine_i ? i % V : 0;
        z_bits[j] = mine_i ? load_bits(p.z, p.z_dtype, (bos + g0 + t) * p.z_stride_n + hv * p.z_stride_h + v) : 0u;
        w_bits[j] = mine_i ? load_bits(p.norm_weight, p.norm_weight_dtype, v) : 0u;
      }
    }
    // Stage the pass's tokens, a warp a token.
    for (int t = warp; t < tg; t += warps) {
      const int64_t tok = bos + g0 + t;
      const int64_t qo = tok * p.q_stride_n + h * p.q_stride_h, ko = tok * p.k_stride_n + h * p.k_stride_h;
      constexpr int KL = K / 32;
      uint32_t qb[KL], kb[KL];
#pragma unroll
      for (int b = 0; b < KL; ++b) {
        qb[b] = load_bits(p.q, p.dtype, qo + lane + 32 * b);
        kb[b] = load_bits(p.k, p.dtype, ko + lane + 32 * b);
      }
      DecayBits d_bits[PER_CHANNEL ? KL : 1];
      if constexpr (PER_CHANNEL) {
#pragma unroll
        for (int b = 0; b < KL; ++b) d_bits[b] = load_decay_bits(p, tok, hv, lane + 32 * b);
      } else {
        d_bits[0] = load_decay_bits(p, tok, hv, -1);
      }
      const uint32_t beta_bits = load_beta_bits(p, tok, hv);
      for (int v = lane; v < V; v += 32) s_v[t][v] = load_f(p.v, p.dtype, tok * p.v_stride_n + hv * p.v_stride_h + v);
      float qv[KL], kv[KL];
      widen_all<KL>(qb, p.dtype, qv);
      widen_all<KL>(kb, p.dtype, kv);
      float sqq = 0.f, skk = 0.f, sqk = 0.f;
#pragma unroll
      for (int b = 0; b < KL; ++b) {
        sqq += qv[b] * qv[b];
        skk += kv[b] * kv[b];
        sqk += qv[b] * kv[b];
      }
      const QkScales sc = warp_qk_scales<1, 32>(p, sqq, skk, sqk);
#pragma unroll
      for (int b = 0; b < KL; ++b) {
        s_k[t][lane + 32 * b] = kv[b] * sc.k;
        s_q[t][lane + 32 * b] = qv[b] * sc.q;
      }
      if constexpr (PER_CHANNEL) {
        float d[KL];
        decays<KL>(p, d_bits, a_log_bits, d);
#pragma unroll
        for (int b = 0; b < KL; ++b) s_d[t][lane + 32 * b] = d[b];
      }
      if (lane == 0) {
        s_beta[t] = beta_of(p, beta_bits);
        s_qk[t] = sc.qk;
        s_decay[t] = PER_CHANNEL ? 1.f : decay_of(p, d_bits[0], a_log_bits);
      }
    }
    __syncthreads();

    // Stream the head's row chunks through the warps, the next chunk's load in flight.
    for (int c = warp; c < chunks; c += warps) {
      const int v0 = c * R;
      float hs[NV][NK];
      raw_widen<VK, K, ST>(next, hs);
      if (c + warps < chunks) prefetch(c + warps);
      const int my_row = v0 + row_of<Sh, VK>(lane, mine);
      // Not unrolled: the body is the kernel's bulk, and eight copies of it cost the release 2.5x its
      // compile time and size for no measured speed (benchmarks/results-h100-mtp.md).
#pragma unroll 1
      for (int t = 0; t < tg; ++t) {
        float kk[NK], kd[NK], qd[NK], dec[NK];
#pragma unroll
        for (int b = 0; b < NK; ++b) {
          const int ch = key_of<Sh, VK>(lane, b);
          dec[b] = PER_CHANNEL ? s_d[PER_CHANNEL ? t : 0][PER_CHANNEL ? ch : 0] : s_decay[t];
          kk[b] = s_k[t][ch];
          kd[b] = kk[b] * dec[b];
          qd[b] = s_q[t][ch] * dec[b];
        }
        float pk[NV], pq[NV];
#pragma unroll
        for (int a = 0; a < NV; ++a) {
          pk[a] = 0.f;
          pq[a] = 0.f;
#pragma unroll
          for (int b = 0; b < NK; ++b) {
            pk[a] += hs[a][b] * kd[b];
            pq[a] += hs[a][b] * qd[b];
          }
        }
        butterfly<NV, LPR / 2>(pk, pq, lane);
        const float u_mine = s_beta[t] * (s_v[t][my_row] - pk[0]);
        const float o = rounded(pq[0] + u_mine * s_qk[t], p.dtype);
        if (writer) {
          if (epilogue) s_o[t][my_row] = o;
          else store_f(p.out, p.dtype, (bos + g0 + t) * p.out_stride_n + hv * p.out_stride_h + my_row, o);
        }
#pragma unroll
        for (int a = 0; a < NV; ++a) {
          const float u = __shfl_sync(0xffffffffu, u_mine, group + a * F);
#pragma unroll
          for (int b = 0; b < NK; ++b) hs[a][b] = hs[a][b] * dec[b] + kk[b] * u;
        }
        if (p.idx_columns > 0) {
          const int64_t dst = load_index(p.idx, p.idx_is_int64, n * p.idx_columns + g0 + t);
          if (slot_valid(p, dst)) tile_store<VK, K, ST, R>(p, pool + dst * p.state_stride_p + hv * block, v0, lane, hs);
        }
      }
      // idx [N]: the one slot carries the state to the next pass and holds it after the last.
      if (p.idx_columns == 0) tile_store<VK, K, ST, R>(p, src, v0, lane, hs);
    }
    // The next pass's first chunk: stored above by this same warp (idx [N]), read after it.
    if (g0 + TS < len && warp < chunks) prefetch(warp);

    if (epilogue) {
      __syncthreads();
      for (int t = warp; t < tg; t += warps) {
        float ss = 0.f;
        for (int v = lane; v < V; v += 32) ss += s_o[t][v] * s_o[t][v];
        ss = warp_sum(ss);
        if (lane == 0) s_rstd[t] = rsqrtf(ss / static_cast<float>(V) + p.norm_eps);
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < ZPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i >= tg * V) break;
        const int t = i / V, v = i % V;
        const float z = widen_bits(z_bits[j], p.z_dtype), w = widen_bits(w_bits[j], p.norm_weight_dtype);
        store_f(p.out, p.dtype, (bos + g0 + t) * p.out_stride_n + hv * p.out_stride_h + v,
                s_o[t][v] * s_rstd[t] * w * gate_act(z, p.gate_activation));
      }
      for (int i = threadIdx.x + ZPT * blockDim.x; i < tg * V; i += blockDim.x) {  // long passes on few warps
        const int t = i / V, v = i % V;
        const float z = load_f(p.z, p.z_dtype, (bos + g0 + t) * p.z_stride_n + hv * p.z_stride_h + v);
        store_f(p.out, p.dtype, (bos + g0 + t) * p.out_stride_n + hv * p.out_stride_h + v,
                s_o[t][v] * s_rstd[t] * load_f(p.norm_weight, p.norm_weight_dtype, v) * gate_act(z, p.gate_activation));
      }
    }
    __syncthreads();  // the staged tokens and outputs are reused by the next pass
  }
}

// Resident kernel (decode_mtp_kernel): value rows a warp takes: 16, so a block holds at most 16
// warps (the kernel's launch bound, which leaves it 128 registers a thread).
template <bool VK, int K, typename ST, int BW>
int launch_mtp_rows(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_mtp_kernel<VK, K, ST, BW, true> : decode_mtp_kernel<VK, K, ST, BW, false>;
  const unsigned requests = static_cast<unsigned>(p.N + (p.cu_seqlens != nullptr ? 1 : 0));
  return launch_decode(kernel, dim3(requests, static_cast<unsigned>(p.HV)), dim3(static_cast<unsigned>(p.V / BW) * 32),
                       p, stream);
}

template <bool VK, int K, typename ST>
int launch_mtp_stream(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_mtp_stream_kernel<VK, K, ST, true> : decode_mtp_stream_kernel<VK, K, ST, false>;
  const unsigned requests = static_cast<unsigned>(p.N + (p.cu_seqlens != nullptr ? 1 : 0));
  const int64_t chunks = p.V / kStreamRows, sms = p.sm_count > 0 ? p.sm_count : 132;
  // A warp a chunk (at most 16: the launch bound) while the grid fills the GPU only a few times;
  // then 8 warps a block, each two chunks; past kMtpWideWarpsPerSm warps an SM, 4 (H100, bench:
  // benchmarks/results-h100-mtp.md).
  const int64_t grid_warps = p.N * p.HV * chunks;
  const int64_t wide = chunks < 16 ? chunks : 16;
  const int64_t warps = grid_warps <= 16 * sms ? wide : grid_warps <= kMtpWideWarpsPerSm * sms ? (wide < 8 ? wide : 8)
                                                                                              : kMtpNarrowWarps;
  return launch_decode(kernel, dim3(requests, static_cast<unsigned>(p.HV)), dim3(static_cast<unsigned>(warps) * 32), p,
                       stream);
}

template <bool VK, int K, typename ST>
int launch_mtp_k(const GdnDecodeParams& p, cudaStream_t stream) {
  // More checkpoint columns than a pass stages: only the resident kernel carries the state across.
  if (p.idx_columns > kStreamTokens) return launch_mtp_rows<VK, K, ST, 16>(p, stream);
  // About one token a request (rows <= requests: the epilogue alone, or vLLM's MTP call at T = 1) in
  // a grid of at most two heads per SM: the resident kernel has the shorter path there (no staging,
  // one barrier), and streaming gains nothing. Either kernel computes any call; this is speed only.
  const int64_t sms = p.sm_count > 0 ? p.sm_count : 132;
  if (p.L <= p.N && p.N * p.HV <= 2 * sms) return launch_mtp_rows<VK, K, ST, 16>(p, stream);
  return launch_mtp_stream<VK, K, ST>(p, stream);
}

template <typename ST>
int launch_mtp(const GdnDecodeParams& p, cudaStream_t stream) {
  switch (p.K) {
    case 64: return p.state_vk ? launch_mtp_k<true, 64, ST>(p, stream) : launch_mtp_k<false, 64, ST>(p, stream);
    case 128: return p.state_vk ? launch_mtp_k<true, 128, ST>(p, stream) : launch_mtp_k<false, 128, ST>(p, stream);
    case 256: return p.state_vk ? launch_mtp_k<true, 256, ST>(p, stream) : launch_mtp_k<false, 256, ST>(p, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace
}  // namespace cudelta
