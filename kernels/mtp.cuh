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
#include <type_traits>

#include "launch.h"
#include "common/dtype.cuh"
#include "common/host.cuh"
#include "common/ptx.cuh"
#include "common/step.cuh"
#include "warp_vk.cuh"

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
constexpr int kMtpNarrowWarps = 4;
// Requests of at most two tokens past kMtpShortWarpsPerSm grid warps an SM take blocks of
// kMtpShortWarps: twice the blocks an SM at the same registers, so a block's staging and epilogue
// barriers stall fewer warps (H200, T=2, B=128 and 512: 0.91x -> 0.95-1.00x vLLM's op; at B=32
// the grid is one wave and 2-warp blocks run 0.73x, at T >= 4 they lose 1-3%).
constexpr int64_t kMtpShortWarpsPerSm = 256;
constexpr int kMtpShortWarps = 2;
// Row groups of the streaming kernel (launch_mtp_stream): blocks a head at most 1 / kMtpGroupSmShare
// of the SMs, each at least kMtpGroupChunks row chunks (blocks of fewer warps stage several tokens a
// warp), or up to one block an SM where each keeps twice that; at most kMtpMaxClusterGroups in a
// cluster (the portable size). H200, T = 2 / 4 / 8, µs, one group -> this rule
// (benchmarks/results-h200-mtp.md): 16/32 heads B=1 bf16 9.2 / 11.2 / 16.6 -> 8.5 / 9.7 / 13.3; 4/8
// heads B=1 8.8 / 11.1 / 16.6 -> 7.7 / 8.9 / 12.6; 16/64 heads B=1 (two groups of 8 chunks, 128
// blocks) bf16 9.1 / 11.4 / 16.5 -> 8.3 / 9.8 / 13.3, fp32 11.4 / 15.1 / 22.2 -> 10.0 / 11.9 / 17.0.
// Groups of 2-warp blocks (4/8 at B=1 in 8 groups: 14.4 at T=8) and a grid of 4-chunk blocks past
// half the SMs (16/32 at B=1 in 4 groups: 14.7) gain less; past one block an SM nothing.
constexpr int kMtpGroupSmShare = 2;
constexpr int kMtpGroupChunks = 4;
constexpr int kMtpMaxClusterGroups = 8;
// The one-token kernel's largest V (its outputs wait in shared memory for the epilogue).
constexpr int kMaxOneRows = 128;

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
// An index's bits (int32 in lo, or int64), loaded apart from its widening: a load under a condition
// is then not waited for where it is made (request_span).
struct IndexBits {
  uint32_t lo, hi;
};
__device__ __forceinline__ IndexBits load_index_bits(const void* p, bool is64, int64_t i) {
  IndexBits b;
  if (is64) {
    const uint2 x = static_cast<const uint2*>(p)[i];
    b.lo = x.x;
    b.hi = x.y;
  } else {
    b.lo = static_cast<const uint32_t*>(p)[i];
    b.hi = 0u;
  }
  return b;
}
__device__ __forceinline__ int64_t widen_index(IndexBits b, bool is64) {
  return is64 ? static_cast<int64_t>((uint64_t(b.hi) << 32) | b.lo) : static_cast<int64_t>(static_cast<int32_t>(b.lo));
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

// A block's (request, value head) in the grids of request_blocks(p) x HV blocks along x, heads
// fastest: the blocks of request N (a cu_seqlens launch's extra blocks, which only zero rows) come
// last in the order blocks are scheduled, after every request's (interleaved, they cost a grid of one
// block an SM a second wave: H200, bf16 T=1 B=4 7.2 -> 6.5 µs).
__device__ __forceinline__ int64_t block_request(const GdnDecodeParams& p) { return blockIdx.x / static_cast<uint32_t>(p.HV); }
__device__ __forceinline__ int64_t block_head(const GdnDecodeParams& p) { return blockIdx.x % static_cast<uint32_t>(p.HV); }

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
  const int64_t n = block_request(p), hv = block_head(p), h = qk_head(p, static_cast<uint32_t>(hv));
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
    const QkScales sc = lane_qk_scales<1, LPR>(p, qv, kv);
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

// The streaming kernel: a request of at most kStreamTokens tokens a pass (any number with idx [N] and
// an fp32 state, whose one slot carries it from pass to pass), its tokens' q, k, gates staged once in shared
// memory, then each warp streams row chunks of the head's state through its registers: a chunk of
// R rows is loaded (the next one already in flight), taken through every token, stored at each
// checkpoint and dropped. Rows are independent in the recurrence (they share only the tokens'
// scalars and the epilogue's mean over V), so a head needs registers for one chunk a warp, not the
// whole head: many more heads per SM are in flight than in decode_mtp_kernel, which keeps the whole
// head in registers and is left for requests with more than kStreamTokens checkpoint columns. For the
// same reason a head may be split into row groups, a block each (gridDim.z), in small grids.
constexpr int kStreamTokens = 8;
constexpr int kStreamRows = 8;

template <bool VK, int K, typename ST>
using StreamShape = MtpShape<VK, K, ST, kStreamRows>;

template <bool VK, int K, typename ST>
struct RawTile {
  using Sh = StreamShape<VK, K, ST>;
  typename Chunk<ST>::Raw r[VK ? Sh::NV : Sh::NK][Sh::CPR];
};

// 16-byte units of a chunk a lane holds, and the ring: kStreamRing chunks a warp, or as many as the
// warp streams where fewer (the launch sizes the block's dynamic shared memory by it).
template <bool VK, int K, typename ST>
constexpr int kStreamChunkRaws = (VK ? StreamShape<VK, K, ST>::NV : StreamShape<VK, K, ST>::NK) * StreamShape<VK, K, ST>::CPR;
constexpr int kStreamRing = 3;
// The ring's bytes a block at most, beside the kernel's static buffers (K = 256 fp32: 16 warps of
// 8 KB chunks take one slot each).
constexpr int kStreamRingBytes = 128 * 1024;
__host__ __device__ __forceinline__ int stream_ring_depth(int chunks, int warps, int chunk_bytes) {
  const int per_warp = (chunks + warps - 1) / warps;
  int depth = per_warp < kStreamRing ? per_warp : kStreamRing;
  while (depth > 1 && warps * depth * chunk_bytes > kStreamRingBytes) --depth;
  return depth;
}
// The staged values and outputs of a pass hold up to this many value rows (V): the launch takes the
// resident kernel for longer heads.
template <int K>
constexpr int kStreamMaxV = K <= 128 ? 128 : 256;

// A chunk's raw state in shared memory, lane-interleaved (element j of lane l at j * 32 + l, so a
// warp's 16-byte accesses cover 512 contiguous bytes: no bank conflicts), copied asynchronously by
// the lane that reads it back.
template <bool VK, int K, typename ST>
__device__ __forceinline__ void raw_copy(const GdnDecodeParams& p, const ST* S, int v0, int lane,
                                         typename Chunk<ST>::Raw* slot) {
  using Sh = StreamShape<VK, K, ST>;
  using Raw = typename Chunk<ST>::Raw;
  if constexpr (VK) {
#pragma unroll
    for (int a = 0; a < Sh::NV; ++a) {
      const Raw* row = reinterpret_cast<const Raw*>(S + int64_t(v0 + row_of<Sh, VK>(lane, a)) * K);
#pragma unroll
      for (int i = 0; i < Sh::CPL; ++i) cp_async16(slot + (a * Sh::CPL + i) * 32 + lane, row + i * Sh::LPR + lane % Sh::LPR);
    }
  } else {
#pragma unroll
    for (int b = 0; b < Sh::NK; ++b) {
      const Raw* row = reinterpret_cast<const Raw*>(S + int64_t(key_of<Sh, VK>(lane, b)) * p.V + v0);
#pragma unroll
      for (int c = 0; c < Sh::CPR; ++c) cp_async16(slot + (b * Sh::CPR + c) * 32 + lane, row + c);
    }
  }
}

template <bool VK, int K, typename ST>
__device__ __forceinline__ void raw_read(const typename Chunk<ST>::Raw* slot, int lane, RawTile<VK, K, ST>& t) {
  using Sh = StreamShape<VK, K, ST>;
  constexpr int A = VK ? Sh::NV : Sh::NK;
#pragma unroll
  for (int a = 0; a < A; ++a) {
#pragma unroll
    for (int i = 0; i < Sh::CPR; ++i) t.r[a][i] = slot[(a * Sh::CPR + i) * 32 + lane];
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
  __shared__ float s_beta[TS], s_qk[TS], s_decay[TS];
  // The epilogue's sums of squares a (token, row chunk), added in a fixed order: outputs do not
  // depend on which warp finished first.
  __shared__ float s_ss[TS][kStreamMaxV<K> / kStreamRows];
  __shared__ int64_t s_dst[TS];
  __shared__ float s_o[TS][kStreamMaxV<K>], s_v[TS][kStreamMaxV<K>];
  pdl_enter();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int group = lane - lane % LPR, mine = (lane % LPR) / F;
  const bool writer = lane % F == 0;
  const int64_t n = block_request(p), hv = block_head(p), h = qk_head(p, static_cast<uint32_t>(hv));
  const int V = static_cast<int>(p.V);
  // The head's rows in gridDim.z groups, a block each (small grids: more SMs share a head). The
  // epilogue's mean over V then needs every group's sums: the launch makes the blocks of a head a
  // cluster (launch_mtp_stream) and they exchange them through distributed shared memory.
  const int groups = static_cast<int>(gridDim.z), chunks = V / R / groups, c0 = static_cast<int>(blockIdx.z) * chunks;
  const int row0 = c0 * R, rows = chunks * R;
  const bool clustered = groups > 1 && cluster_size() > 1;
  const bool epilogue = p.gate_activation > 0 && (groups == 1 || clustered);

  auto zero_rows = [&](int64_t first, int64_t end) {
    for (int64_t i = threadIdx.x; i < (end - first) * rows; i += blockDim.x)
      store_f(p.out, p.dtype, (first + i / rows) * p.out_stride_n + hv * p.out_stride_h + row0 + i % rows, 0.f);
  };
  int64_t bos, len, start;
  // A cluster's blocks share the request, so they all return here or none does.
  if (!request_span(p, n, zero_rows, bos, len, start)) return;
  // Distributed shared memory is written only once every block of the cluster runs: this arrival is
  // waited for after the staging.
  if (clustered) cluster_arrive_relaxed();
  const int64_t block = p.K * p.V;
  ST* const pool = static_cast<ST*>(p.state);
  ST* const src = pool + start * p.state_stride_p + hv * block;
  const uint32_t a_log_bits = load_a_log_bits(p, hv);
  // The warp's chunks c = warp, warp + warps, ... go through its ring of `depth` slots in shared
  // memory, kStreamRing of them in flight while one is computed (a group of async copies a
  // chunk, committed even where empty so that every wait counts the same). The first ones are
  // issued before the tokens are staged, so that their round trip overlaps the staging's.
  using Raw = typename Chunk<ST>::Raw;
  extern __shared__ __align__(16) unsigned char s_ring_bytes[];
  const int depth = stream_ring_depth(chunks, warps, kStreamChunkRaws<VK, K, ST> * 32 * 16), mine_chunks = (chunks - warp + warps - 1) / warps;
  constexpr int kSlotRaws = kStreamChunkRaws<VK, K, ST> * 32;
  Raw* const ring = reinterpret_cast<Raw*>(s_ring_bytes) + warp * depth * kSlotRaws;
  // The warp's i-th chunk into ring slot `slot`; first: its first chunk (c0 + warp).
  auto copy_chunk = [&](int first, int i, int slot) {
    raw_copy<VK, K, ST>(p, src, (first + i * warps) * R, lane, ring + slot * kSlotRaws);
  };
  auto fetch = [&](int i) {
    if (i < mine_chunks) copy_chunk(c0 + warp, i, i % depth);
    cp_async_commit();
  };
  // The first `depth` chunks, in kStreamRing groups (the rest empty), so that the wait below counts
  // the same groups whatever the depth.
  auto ring_start = [&](int first) {
#pragma unroll
    for (int i = 0; i < kStreamRing; ++i) {
      if (i < depth && i < mine_chunks) copy_chunk(first, i, i);
      cp_async_commit();
    }
  };
  ring_start(c0 + warp);

  for (int64_t g0 = 0; g0 < len; g0 += TS) {
    const int tg = static_cast<int>(len - g0 < TS ? len - g0 : TS);
    // The epilogue's z and w of this thread's outputs, in flight while the step runs.
    constexpr int ZPT = 4;  // outputs a thread finishes from registers (more: loaded at the end)
    uint32_t z_bits[ZPT], w_bits[ZPT];
    if (epilogue) {
#pragma unroll
      for (int j = 0; j < ZPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        const bool mine_i = i < tg * rows;
        const int t = mine_i ? i / rows : 0, v = row0 + (mine_i ? i % rows : 0);
        z_bits[j] = mine_i ? load_bits(p.z, p.z_dtype, (bos + g0 + t) * p.z_stride_n + hv * p.z_stride_h + v) : 0u;
        w_bits[j] = mine_i ? load_bits(p.norm_weight, p.norm_weight_dtype, v) : 0u;
      }
    }
    // Stage the pass's tokens, a warp a token: up to kStageAhead of a warp's tokens have their loads
    // in flight together (a block of few warps stages several tokens a warp; one round trip each
    // cost small blocks their gain). v: only the block's rows.
    constexpr int KL = K / 32, VL = kStreamMaxV<K> / 32;
    constexpr int kStageAhead = K > 128 || PER_CHANNEL ? 1 : 2;
    struct TokenBits {
      int64_t dst;
      uint32_t q[KL], k[KL], v[VL], beta;
      DecayBits d[PER_CHANNEL ? KL : 1];
    };
    // With twice the pass's tokens in warps, two warps stage a token: one its q and k (their loads and
    // norms), one the rest (v, gates, checkpoint slot), so the staging the other warps wait for at the
    // barrier is the longer of the two halves, not their sum. Not at K = 256: there the two paths made
    // the kernel spill 130-240 bytes a thread (at the 128-register cap of its launch bound, a spill in
    // the step cost another change 30%: benchmarks/results-h200-mtp.md).
    const bool split = K <= 128 && 2 * tg <= warps, stage_qk = !split || warp < tg, stage_rest = !split || warp >= tg;
    for (int base = split && warp >= tg ? warp - tg : warp; base < tg; base += kStageAhead * warps) {
      TokenBits tb[kStageAhead];
#pragma unroll
      for (int j = 0; j < kStageAhead; ++j) {
        const int t = base + j * warps;
        if (t >= tg) break;
        const int64_t tok = bos + g0 + t;
        TokenBits& b = tb[j];
        if (stage_qk) {
          const int64_t qo = tok * p.q_stride_n + h * p.q_stride_h, ko = tok * p.k_stride_n + h * p.k_stride_h;
#pragma unroll
          for (int c = 0; c < KL; ++c) {
            b.q[c] = load_bits(p.q, p.dtype, qo + lane + 32 * c);
            b.k[c] = load_bits(p.k, p.dtype, ko + lane + 32 * c);
          }
        }
        if (!stage_rest) continue;
        b.dst = p.idx_columns > 0 && lane == 0 ? load_index(p.idx, p.idx_is_int64, n * p.idx_columns + g0 + t) : -1;
        if constexpr (PER_CHANNEL) {
#pragma unroll
          for (int c = 0; c < KL; ++c) b.d[c] = load_decay_bits(p, tok, hv, lane + 32 * c);
        } else {
          b.d[0] = load_decay_bits(p, tok, hv, -1);
        }
        b.beta = load_beta_bits(p, tok, hv);
#pragma unroll
        for (int c = 0; c < VL; ++c) {
          const int r = lane + 32 * c;
          b.v[c] = r < rows ? load_bits(p.v, p.dtype, tok * p.v_stride_n + hv * p.v_stride_h + row0 + r) : 0u;
        }
      }
#pragma unroll
      for (int j = 0; j < kStageAhead; ++j) {
        const int t = base + j * warps;
        if (t >= tg) break;
        const TokenBits& b = tb[j];
        if (stage_qk) {
          float qv[KL], kv[KL];
          widen_all<KL>(b.q, p.dtype, qv);
          widen_all<KL>(b.k, p.dtype, kv);
          const QkScales sc = lane_qk_scales<1, 32>(p, qv, kv);
#pragma unroll
          for (int c = 0; c < KL; ++c) {
            s_k[t][lane + 32 * c] = kv[c] * sc.k;
            s_q[t][lane + 32 * c] = qv[c] * sc.q;
          }
          if (lane == 0) s_qk[t] = sc.qk;
        }
        if (!stage_rest) continue;
#pragma unroll
        for (int c = 0; c < VL; ++c) {
          const int r = lane + 32 * c;
          if (r < rows) s_v[t][row0 + r] = widen_bits(b.v[c], p.dtype);
        }
        if constexpr (PER_CHANNEL) {
          float d[KL];
          decays<KL>(p, b.d, a_log_bits, d);
#pragma unroll
          for (int c = 0; c < KL; ++c) s_d[t][lane + 32 * c] = d[c];
        }
        if (lane == 0) {
          s_beta[t] = beta_of(p, b.beta);
          s_decay[t] = PER_CHANNEL ? 1.f : decay_of(p, b.d[0], a_log_bits);
          s_dst[t] = slot_valid(p, b.dst) ? b.dst : -1;  // -1: no checkpoint (idx [N], or an invalid slot)
        }
      }
    }
    __syncthreads();
    if (clustered && g0 == 0) cluster_wait();

    // Stream the block's row chunks through the warps, the next chunk's load in flight.
    for (int i = 0; i < mine_chunks; ++i) {
      const int v0 = (c0 + warp + i * warps) * R;
      float hs[NV][NK];
      {
        // Chunk i is in the group issued depth groups before the newest.
        if (depth >= 3) cp_async_wait<2>();
        else if (depth == 2) cp_async_wait<1>();
        else cp_async_wait<0>();
        RawTile<VK, K, ST> raw;
        raw_read<VK, K, ST>(ring + (i % depth) * kSlotRaws, lane, raw);
        raw_widen<VK, K, ST>(raw, hs);
      }
      // The slot is free once its values are in registers (the widening waited for them; in-order
      // issue puts the copy after it): the chunk `depth` ahead goes in.
      fetch(i + depth);
      const int my_row = v0 + row_of<Sh, VK>(lane, mine);
      // Not unrolled: the body is the kernel's bulk, and eight copies of it cost the release 2.5x its
      // compile time and size for no measured speed (benchmarks/results-h100-mtp.md).
#pragma unroll 1
      for (int t = 0; t < tg; ++t) {
        // KDA: the per-channel decay folded into k and q; GDN: one decay a head, applied to the row
        // sums instead (two arrays of NK registers fewer).
        float kk[NK], kq[NK], dec[PER_CHANNEL ? NK : 1];
#pragma unroll
        for (int b = 0; b < NK; ++b) {
          const int ch = key_of<Sh, VK>(lane, b);
          kk[b] = s_k[t][ch];
          kq[b] = s_q[t][ch];
          if constexpr (PER_CHANNEL) dec[b] = s_d[PER_CHANNEL ? t : 0][PER_CHANNEL ? ch : 0];
        }
        if constexpr (!PER_CHANNEL) dec[0] = s_decay[t];
        float pk[NV], pq[NV];
#pragma unroll
        for (int a = 0; a < NV; ++a) {
          pk[a] = 0.f;
          pq[a] = 0.f;
#pragma unroll
          for (int b = 0; b < NK; ++b) {
            const float x = PER_CHANNEL ? hs[a][b] * dec[PER_CHANNEL ? b : 0] : hs[a][b];
            pk[a] += x * kk[b];
            pq[a] += x * kq[b];
          }
        }
        butterfly<NV, LPR / 2>(pk, pq, lane);
        const float row_decay = PER_CHANNEL ? 1.f : dec[0];
        const float u_mine = s_beta[t] * (s_v[t][my_row] - pk[0] * row_decay);
        const float o = rounded(pq[0] * row_decay + u_mine * s_qk[t], p.dtype);
        if (epilogue) {
          // The epilogue's sum of squares, a warp's rows at a time (the writers hold each row once).
          const float ss = warp_sum(writer ? o * o : 0.f);
          if (writer) s_o[t][my_row] = o;
          if (!clustered) {
            if (lane == 0) s_ss[t][v0 / R] = ss;
          } else if (lane < groups) {
            store_cluster(&s_ss[t][v0 / R], static_cast<unsigned>(lane), ss);  // into every block of the head
          }
        } else if (writer) {
          store_f(p.out, p.dtype, (bos + g0 + t) * p.out_stride_n + hv * p.out_stride_h + my_row, o);
        }
#pragma unroll
        for (int a = 0; a < NV; ++a) {
          const float u = __shfl_sync(0xffffffffu, u_mine, group + a * F);
#pragma unroll
          for (int b = 0; b < NK; ++b) hs[a][b] = hs[a][b] * dec[PER_CHANNEL ? b : 0] + kk[b] * u;
        }
        // The checkpoint slots were read while the tokens were staged: no global load here.
        const int64_t dst = s_dst[t];
        if (dst >= 0) tile_store<VK, K, ST, R>(p, pool + dst * p.state_stride_p + hv * block, v0, lane, hs);
      }
      // idx [N]: the one slot carries the state to the next pass and holds it after the last.
      if (p.idx_columns == 0) tile_store<VK, K, ST, R>(p, src, v0, lane, hs);
    }
    // The next pass's first chunks: stored above by this same warp (idx [N]), read after the fence.
    if (g0 + TS < len) {
      cp_async_wait<0>();
      __threadfence();
      // Before sm_90 the reload's addresses are computed here, not hoisted out of the pass loop:
      // held across it, they spilled (ptxas -v, sm_80, vk, K = 128, GDN: fp32 152 bytes a thread,
      // bf16 48). Not from sm_90: sm_90 spills nothing either way, sm_120 fp32 KDA spilled 32 more.
      int first = c0 + warp;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
      asm volatile("" : "+r"(first));
#endif
      ring_start(first);
    }

    if (epilogue) {
      if (clustered) {
        cluster_arrive();
        cluster_wait();
      } else {
        __syncthreads();
      }
      // Token t's 1 / rms from the head's chunk sums in chunk order, whichever blocks made them (a
      // warp's threads share t: broadcast reads).
      auto rstd = [&](int t) {
        float ss = 0.f;
        for (int c = 0; c < V / R; ++c) ss += s_ss[t][c];
        return rsqrtf(ss / static_cast<float>(V) + p.norm_eps);
      };
#pragma unroll
      for (int j = 0; j < ZPT; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i >= tg * rows) break;
        const int t = i / rows, v = row0 + i % rows;
        const float z = widen_bits(z_bits[j], p.z_dtype), w = widen_bits(w_bits[j], p.norm_weight_dtype);
        store_f(p.out, p.dtype, (bos + g0 + t) * p.out_stride_n + hv * p.out_stride_h + v,
                s_o[t][v] * rstd(t) * w * gate_act(z, p.gate_activation));
      }
      for (int i = threadIdx.x + ZPT * blockDim.x; i < tg * rows; i += blockDim.x) {  // long passes on few warps
        const int t = i / rows, v = row0 + i % rows;
        const float z = load_f(p.z, p.z_dtype, (bos + g0 + t) * p.z_stride_n + hv * p.z_stride_h + v);
        store_f(p.out, p.dtype, (bos + g0 + t) * p.out_stride_n + hv * p.out_stride_h + v,
                s_o[t][v] * rstd(t) * load_f(p.norm_weight, p.norm_weight_dtype, v) * gate_act(z, p.gate_activation));
      }
    }
    // The staged tokens, outputs and sums are reused by the next pass (in a cluster, sums arrive from
    // the other blocks).
    if (g0 + TS < len) {
      if (clustered) {
        cluster_arrive();
        cluster_wait();
      } else {
        __syncthreads();
      }
    }
  }
}

// The one-token kernels of layout vk: at most one token a request (idx [N] with one token a
// request, or idx [N, 1]: one column bounds a request's tokens to one, request_span skips longer
// ones), the epilogue or not. Both run the warp kernel's step (warp_vk.cuh, warp_step: the state kept
// as loaded, never widened into registers of fp32 between tokens) on the slots the multi-token
// contract names (request_span); they differ in where the epilogue's mean over V is taken.
//
// decode_vk_one_kernel, small grids: a block of V / BW warps a (request, value head). The warps keep
// their outputs in shared memory and meet once, after their state stores are issued; the barrier
// waits on the block's slowest warp, not on memory traffic. One launch: the latency regime's choice.
template <int K, typename ST, int BW, bool PER_CHANNEL, bool STREAM>
__global__ void __launch_bounds__(512) decode_vk_one_kernel(const GdnDecodeParams p) {
  __shared__ float s_o[kMaxOneRows];
  __shared__ float s_sumsq[16];
  pdl_enter();
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t n = block_request(p), hv = block_head(p);
  const int V = static_cast<int>(p.V);
  auto zero_rows = [&](int64_t first, int64_t end) {
    for (int64_t i = threadIdx.x; i < (end - first) * V; i += blockDim.x)
      store_f(p.out, p.dtype, (first + i / V) * p.out_stride_n + hv * p.out_stride_h + i % V, 0.f);
  };
  int64_t bos, len, start;
  if (!request_span(p, n, zero_rows, bos, len, start)) return;
  const int64_t dst = p.idx_columns > 0 ? load_index(p.idx, p.idx_is_int64, n * p.idx_columns) : start;
  // The epilogue's z and w of this thread's output (blockDim >= V: BW <= 32 rows a warp).
  const bool epilogue = p.gate_activation > 0, mine = threadIdx.x < V;
  const uint32_t z_bits = epilogue && mine ? load_bits(p.z, p.z_dtype, bos * p.z_stride_n + hv * p.z_stride_h + threadIdx.x) : 0u;
  const uint32_t w_bits = epilogue && mine ? load_bits(p.norm_weight, p.norm_weight_dtype, threadIdx.x) : 0u;
  TileEpilogue epi{s_o, 0.f};
  warp_step<K, ST, BW, PER_CHANNEL, 1, STREAM, true>(p, warp, hv, qk_head(p, static_cast<uint32_t>(hv)), bos, start, dst,
                                                     &epi);
  if (threadIdx.x % 32 == 0) s_sumsq[warp] = epi.sumsq;
  __syncthreads();
  if (!mine) return;
  float o = s_o[threadIdx.x];
  if (epilogue) {
    float total = 0.f;
    for (int i = 0; i < warps; ++i) total += s_sumsq[i];
    o *= rsqrtf(total / static_cast<float>(V) + p.norm_eps) * widen_bits(w_bits, p.norm_weight_dtype) *
         gate_act(widen_bits(z_bits, p.z_dtype), p.gate_activation);
  }
  store_f(p.out, p.dtype, bos * p.out_stride_n + hv * p.out_stride_h + threadIdx.x, o);
}

// decode_vk_one_warp_kernel, larger grids: the warp kernel's grid of one-warp blocks (no barrier, so
// an SM's warps never wait on each other), its outputs stored rounded; the epilogue follows as
// gated_rms_norm_kernel, which reads them back (a few MB beside the state's hundreds).
template <int K, typename ST, int BW, bool PER_CHANNEL, int TPW, bool STREAM>
__global__ void __launch_bounds__(32, (warp_min_blocks<K, ST, BW, TPW>())) decode_vk_one_warp_kernel(const GdnDecodeParams p) {
  pdl_enter();
  const int64_t n = blockIdx.z, hv = blockIdx.y;
  const int64_t row0 = int64_t(blockIdx.x) * (BW * TPW);
  auto zero_rows = [&](int64_t first, int64_t end) {
    for (int64_t tok = first; tok < end; ++tok) {
      for (int r = threadIdx.x; r < BW * TPW; r += 32) store_f(p.out, p.dtype, tok * p.out_stride_n + hv * p.out_stride_h + row0 + r, 0.f);
    }
  };
  int64_t bos, len, start;
  if (!request_span(p, n, zero_rows, bos, len, start)) return;
  const int64_t dst = p.idx_columns > 0 ? load_index(p.idx, p.idx_is_int64, n * p.idx_columns) : start;
  warp_step<K, ST, BW, PER_CHANNEL, TPW, STREAM, false, true>(p, blockIdx.x, hv, qk_head(p, static_cast<uint32_t>(hv)),
                                                              bos, start, dst);
}

// The epilogue on outputs already stored (rounded to out's dtype): one warp a (token row, value head),
// every row of the call (rows left zero stay zero). V <= kMaxOneRows: 4 values a lane.
__global__ void __launch_bounds__(128) gated_rms_norm_kernel(const GdnDecodeParams p) {
  pdl_enter();
  const int64_t item = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (item >= p.L * p.HV) return;
  const int lane = threadIdx.x % 32, V = static_cast<int>(p.V);
  const int64_t tok = item / p.HV, hv = item % p.HV;
  const int64_t o_at = tok * p.out_stride_n + hv * p.out_stride_h, z_at = tok * p.z_stride_n + hv * p.z_stride_h;
  constexpr int PER = kMaxOneRows / 32;
  uint32_t o_bits[PER], z_bits[PER], w_bits[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int v = lane + 32 * j;
    o_bits[j] = v < V ? load_bits(p.out, p.dtype, o_at + v) : 0u;
    z_bits[j] = v < V ? load_bits(p.z, p.z_dtype, z_at + v) : 0u;
    w_bits[j] = v < V ? load_bits(p.norm_weight, p.norm_weight_dtype, v) : 0u;
  }
  float o[PER], ss = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    o[j] = widen_bits(o_bits[j], p.dtype);
    ss += o[j] * o[j];
  }
  const float rstd = rsqrtf(warp_sum(ss) / static_cast<float>(V) + p.norm_eps);
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int v = lane + 32 * j;
    if (v < V) {
      store_f(p.out, p.dtype, o_at + v, o[j] * rstd * widen_bits(w_bits[j], p.norm_weight_dtype) *
                                            gate_act(widen_bits(z_bits[j], p.z_dtype), p.gate_activation));
    }
  }
}

// The grid's blocks along the requests: one a request, and with cu_seqlens one more, which zeroes
// the rows after cu_seqlens[N] (request_span).
inline unsigned request_blocks(const GdnDecodeParams& p) {
  return static_cast<unsigned>(p.N + (p.cu_seqlens != nullptr ? 1 : 0));
}

template <int K, typename ST, int BW, bool STREAM>
int launch_vk_one_rows(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_vk_one_kernel<K, ST, BW, true, STREAM> : decode_vk_one_kernel<K, ST, BW, false, STREAM>;
  const unsigned requests = request_blocks(p);
  return launch_decode(kernel, dim3(requests * static_cast<unsigned>(p.HV)), dim3(static_cast<unsigned>(p.V / BW) * 32),
                       p, stream);
}

template <int K, typename ST, int BW, int TPW, bool STREAM>
int launch_vk_one_split(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_vk_one_warp_kernel<K, ST, BW, true, TPW, STREAM>
                                : decode_vk_one_warp_kernel<K, ST, BW, false, TPW, STREAM>;
  const unsigned requests = request_blocks(p);
  int err = launch_decode(kernel, dim3(static_cast<unsigned>(p.V / (BW * TPW)), static_cast<unsigned>(p.HV), requests),
                          dim3(32), p, stream);
  if (err != 0 || p.gate_activation <= 0) return err;
  return launch_decode(gated_rms_norm_kernel, dim3(static_cast<unsigned>((p.L * p.HV + 3) / 4)), dim3(128), p, stream);
}

// Whether a call takes a one-token kernel: at most one token a request, layout vk, K = 128 (the head
// dim the warp kernel's extra builds are for), V whole tiles of 16 rows, at most kMaxOneRows.
inline bool one_token_call(const GdnDecodeParams& p) {
  const bool one = p.idx_columns == 1 || (p.idx_columns == 0 && p.cu_seqlens == nullptr && p.tokens == 1);
  return one && p.state_vk && p.K == 128 && p.V % 16 == 0 && p.V <= kMaxOneRows;
}

// Which one-token kernel and build. bf16 state takes the block kernel from half a (request, head)
// pair an SM to eight (fewer leave SMs idle: a block a pair); with the epilogue, fp32 state takes it
// too, 16-warp blocks up to a pair an SM and 8-warp blocks up to sixteen (its second launch costs
// more there than the barrier: H200, B=4..16 at HV=32, 0.92-0.95x -> 1.02-1.10x vLLM's op; B=32 and
// 64 41.4 / 76.0 -> 40.1 / 75.0 µs; bf16 B=32, 7.8 pairs an SM, 26.6 -> 24.2 µs, but at B=64 47.0
// against 45.6 µs for the split). Elsewhere the warp kernel's builds and the separate epilogue (H100,
// benchmarks/results-h100-mtp.md).
template <typename ST>
int launch_vk_one(const GdnDecodeParams& p, cudaStream_t stream) {
  const int64_t pairs = p.N * p.HV, sms = p.sm_count > 0 ? p.sm_count : 132;
  const bool epilogue = p.gate_activation > 0;
  if constexpr (std::is_same_v<ST, float>) {
    if (epilogue && pairs >= sms / 2 && pairs <= sms) return launch_vk_one_rows<128, ST, 8, true>(p, stream);
    if (epilogue && pairs > sms && pairs <= 16 * sms) return launch_vk_one_rows<128, ST, 16, true>(p, stream);
    if (pairs <= sms) return launch_vk_one_split<128, ST, 4, 1, false>(p, stream);
    if (pairs <= 16 * sms) return launch_vk_one_split<128, ST, 8, 2, true>(p, stream);
    return launch_vk_one_split<128, ST, 8, 1, false>(p, stream);
  } else {
    if (pairs <= sms / 2) return launch_vk_one_split<128, ST, 8, 1, false>(p, stream);
    if (pairs <= 8 * sms) return launch_vk_one_rows<128, ST, 16, true>(p, stream);
    if (pairs <= 64 * sms) return launch_vk_one_split<128, ST, 16, 1, true>(p, stream);
    return launch_vk_one_split<128, ST, 16, 1, false>(p, stream);
  }
}

// Resident kernel (decode_mtp_kernel): value rows a warp takes: 16, so a block holds at most 16
// warps (the kernel's launch bound, which leaves it 128 registers a thread).
template <bool VK, int K, typename ST, int BW>
int launch_mtp_rows(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_mtp_kernel<VK, K, ST, BW, true> : decode_mtp_kernel<VK, K, ST, BW, false>;
  const unsigned requests = request_blocks(p);
  return launch_decode(kernel, dim3(requests * static_cast<unsigned>(p.HV)), dim3(static_cast<unsigned>(p.V / BW) * 32),
                       p, stream);
}

template <bool VK, int K, typename ST>
int launch_mtp_stream(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_mtp_stream_kernel<VK, K, ST, true> : decode_mtp_stream_kernel<VK, K, ST, false>;
  const unsigned requests = request_blocks(p);
  const int64_t sms = p.sm_count > 0 ? p.sm_count : 132;
  const int head_chunks = static_cast<int>(p.V / kStreamRows), chunk_bytes = kStreamChunkRaws<VK, K, ST> * 32 * 16;
  // Row groups (decode_mtp_stream_kernel): while a block a head fills at most kMtpGroupSmShare of
  // the SMs, the head's rows split over twice the blocks, each of at least kMtpGroupChunks chunks, or
  // to one block an SM where each keeps 2 * kMtpGroupChunks, so that more SMs share the step; with
  // the epilogue its sums go through a cluster (sm_90+ images).
  const bool epilogue = p.gate_activation > 0;
  const int max_groups = !epilogue ? head_chunks : p.clusters ? kMtpMaxClusterGroups : 1;
  auto groups_fit = [&](int g) {
    const int block_chunks = head_chunks / g;
    const int64_t blocks = p.N * p.HV * g;
    return head_chunks % g == 0 && ((block_chunks >= kMtpGroupChunks && blocks * kMtpGroupSmShare <= sms) ||
                                    (block_chunks >= 2 * kMtpGroupChunks && blocks <= sms));
  };
  int groups = 1;
  while (groups * 2 <= max_groups && groups_fit(groups * 2)) groups *= 2;
  const int chunks = head_chunks / groups;
  // A warp a chunk (at most 16: the launch bound) while the grid fills the GPU only a few times;
  // then 8 warps a block, each two chunks; past kMtpWideWarpsPerSm warps an SM, 4, or 2 for
  // requests of at most two tokens past kMtpShortWarpsPerSm (benchmarks/results-h100-mtp.md,
  // results-h200-mtp.md).
  const int64_t grid_warps = p.N * p.HV * head_chunks;
  const int wide = chunks < 16 ? chunks : 16;
  const bool short_requests = p.L <= 2 * p.N;
  const int warps = grid_warps <= 16 * sms                  ? wide
                    : grid_warps <= kMtpWideWarpsPerSm * sms ? (wide < 8 ? wide : 8)
                    : short_requests && grid_warps > kMtpShortWarpsPerSm * sms && chunks >= kMtpShortWarps
                        ? kMtpShortWarps
                        : (wide < kMtpNarrowWarps ? wide : kMtpNarrowWarps);
  const size_t ring = size_t(warps) * stream_ring_depth(chunks, warps, chunk_bytes) * chunk_bytes;
  if (const int err = allow_dynamic_smem<decode_mtp_stream_kernel<VK, K, ST, false>>(p.device, ring)) return err;
  if (const int err = allow_dynamic_smem<decode_mtp_stream_kernel<VK, K, ST, true>>(p.device, ring)) return err;
  return launch_decode(kernel, dim3(requests * static_cast<unsigned>(p.HV), 1, static_cast<unsigned>(groups)),
                       dim3(static_cast<unsigned>(warps) * 32), p, stream, ring,
                       epilogue && groups > 1 ? static_cast<unsigned>(groups) : 1u);
}

template <bool VK, int K, typename ST>
int launch_mtp_k(const GdnDecodeParams& p, cudaStream_t stream) {
  if constexpr (VK && K == 128) {
    if (one_token_call(p)) return launch_vk_one<ST>(p, stream);
  }
  // More checkpoint columns than a pass stages: only the resident kernel carries the state across.
  // So too for a bf16 state with idx [N] where a request may have more tokens than a pass: the
  // streaming kernel would carry it from pass to pass through the slot, rounded to bf16 mid-request
  // (cu_seqlens is not read on the host: any request may then hold all L rows).
  const bool long_requests = p.idx_columns == 0 && (p.cu_seqlens != nullptr ? p.L : p.tokens) > kStreamTokens;
  if (p.idx_columns > kStreamTokens || (!std::is_same_v<ST, float> && long_requests))
    return launch_mtp_rows<VK, K, ST, 16>(p, stream);
  // About one token a request (rows <= requests: the epilogue alone, or vLLM's MTP call at T = 1) in
  // a grid of at most two heads per SM: the resident kernel has the shorter path there (no staging,
  // one barrier), and streaming gains nothing. Either kernel computes any call; this is speed only.
  const int64_t sms = p.sm_count > 0 ? p.sm_count : 132;
  if ((p.L <= p.N && p.N * p.HV <= 2 * sms) || p.V > kStreamMaxV<K>) return launch_mtp_rows<VK, K, ST, 16>(p, stream);
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
