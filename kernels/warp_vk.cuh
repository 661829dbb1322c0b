// The warp kernel of layout "vk" [V, K]: a warp owns whole rows of K, so every reduction of the
// step stays inside the warp. launch_rules.cuh picks the build for a batch.
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

// One warp, alone in its block, owns a tile of BW rows x the whole K and keeps it in registers (at
// most 512 bytes a lane), so nothing crosses warps: the q/k norms and the gates are computed by
// every warp with shuffles, there is no __syncthreads and no shared memory, and an SM holds as many
// independent tiles as its registers allow (the whole decode step is one read and one write of the
// state, so what bounds it is the bytes in flight per SM). Lane l of a row holds chunks i*LPR + l
// (16 bytes each), so each load instruction of the warp covers 512 contiguous bytes. The two row
// dot-products (h'^T k, h'^T q) are reduced by a transposing butterfly: each level halves the rows
// a lane carries, so a 32-row tile costs 31 shuffles per product instead of 32 x 5, and each lane
// ends with the sums of one row, whose u and output it computes (the output store is one coalesced
// line); u comes back to the row's lanes by shuffle. Rows per tile (BW) and tiles per warp (TPW)
// are build parameters: a warp holds at most 32 rows, 128 state registers a lane. Small batches
// take short tiles (more warps, each with less dependent work), large ones long tiles;
// launch_vk_warp (launch_rules.cuh) holds the rule.
template <int K, typename ST>
constexpr int warp_rows_big() {
  return 32 * 512 / (K * int(sizeof(ST))) < 32 ? 32 * 512 / (K * int(sizeof(ST))) : 32;
}

template <int K, typename ST, int BW>
struct WarpShape {
  static constexpr int E = Chunk<ST>::E;
  static constexpr int KC = K / E;                      // 16-byte chunks per row
  static constexpr int LPR = KC < 32 ? KC : 32;         // lanes per row
  static constexpr int CPL = KC / LPR;                  // chunks per lane in a row
  static constexpr int RPP = 32 / LPR;                  // rows per load instruction
  static constexpr int NP = BW / RPP;                   // rows a lane holds
  static constexpr int F = LPR / NP;                    // lanes that end with the same row
  static_assert(NP >= 2 && F >= 1 && LPR % NP == 0, "warp tile shape");
};

// Resident warps per SM the register cap aims at. A warp lives on one of the SM's four 16K-register
// quarters, so the useful counts are 8 (255 registers), 12 (168) and 16 (128): a 128-register tile
// takes 8 (at 12 it spilled), a 64-register one 12 (at 16 it spilled), smaller ones 16.
template <int K, typename ST, int BW, int TPW = 1>
constexpr int warp_min_blocks() {
  using Sh = WarpShape<K, ST, BW>;
  constexpr int tile_regs = Sh::NP * Sh::CPL * 4 * TPW;
  return tile_regs >= 128 ? 8 : tile_regs >= 64 ? 12 : 16;
}

// The gated RMSNorm epilogue of a one-token step in a block of warps (mtp_one.cuh, decode_vk_one_kernel):
// the tile's outputs, rounded to the output dtype, go to `o` (the head's V values) instead of out,
// and `sumsq` gathers the sum of their squares over the warp's rows.
struct TileEpilogue {
  float* o;
  float sumsq;
};

// The two row dot-products of a warp's tile (h^T k, h^T q) across the LPR lanes of each row:
// partial(j, pk, pq) gives this lane's share of row j's; pairs (j, j + NP/2) are folded at once into
// the butterfly's first level, so only NP/2 accumulators per product are ever live beside the tile.
// Each lane ends with the sums of row r + RPP * (l / F) of its group (l = lane % LPR).
template <int NP, int LPR, typename Partial>
__device__ __forceinline__ void tile_row_sums(const Partial& partial, int lane, float& pk, float& pq) {
  constexpr int H0 = NP / 2;
  float ak[H0], aq[H0];
  const bool hi = (lane & (LPR / 2)) != 0;
#pragma unroll
  for (int i = 0; i < H0; ++i) {
    float k0, q0, k1, q1;
    partial(i, k0, q0);
    partial(i + H0, k1, q1);
    const float sk = hi ? k0 : k1, kk = hi ? k1 : k0;
    const float sq = hi ? q0 : q1, kq = hi ? q1 : q0;
    ak[i] = kk + __shfl_xor_sync(0xffffffffu, sk, LPR / 2);
    aq[i] = kq + __shfl_xor_sync(0xffffffffu, sq, LPR / 2);
  }
  butterfly<H0, LPR / 4>(ak, aq, lane);
  pk = ak[0];
  pq = aq[0];
}

// The step of one tile group: the inputs of token row `n` (a request, or with several tokens a token
// row), the state read from slot `src` and written to slot `dst` (DST_CHECK: not written where dst
// is invalid), the outputs at out row n, or (EPI) to the epilogue's buffer. STAGED_LAST: the last
// tile is not loaded into registers but read where it is used from `staged`, a copy of its rows in
// shared memory laid out as in the slot, whose asynchronous copies (each lane's own chunks) the
// caller issued (decode_vk_one_staged_kernel).
template <int K, typename ST, int BW, bool PER_CHANNEL, int TPW, bool STREAM, bool EPI = false, bool DST_CHECK = EPI,
          bool STAGED_LAST = false>
__device__ __forceinline__ void warp_step(const GdnDecodeParams& p, uint32_t g, int64_t hv, int64_t h, int64_t n,
                                          int64_t src, int64_t dst, TileEpilogue* epi = nullptr,
                                          const typename Chunk<ST>::Raw* staged = nullptr) {
  using C = Chunk<ST>;
  using Raw = typename C::Raw;
  using Sh = WarpShape<K, ST, BW>;
  constexpr int E = Sh::E, KC = Sh::KC, LPR = Sh::LPR, CPL = Sh::CPL, RPP = Sh::RPP, NP = Sh::NP, F = Sh::F;
  const int lane = threadIdx.x & 31;
  const int l = lane % LPR;
  const int r = lane / LPR;
  const int64_t row0 = int64_t(g) * (BW * TPW);
  const int64_t o_at = n * p.out_stride_n + hv * p.out_stride_h + row0;
  const int64_t head = (hv * p.V + row0) * int64_t(K);
  const Raw* S = reinterpret_cast<const Raw*>(static_cast<const ST*>(p.state) + src * p.state_stride_p + head);
  Raw* D = reinterpret_cast<Raw*>(static_cast<ST*>(p.state) + dst * p.state_stride_p + head);

  // The tiles first: all of their loads are in flight while the gates, q and k are read.
  constexpr int HELD = STAGED_LAST ? TPW - 1 : TPW;  // tiles in registers
  Raw s[TPW][NP][CPL];
#pragma unroll
  for (int t = 0; t < HELD; ++t) {
#pragma unroll
    for (int j = 0; j < NP; ++j) {
#pragma unroll
      for (int i = 0; i < CPL; ++i) s[t][j][i] = state_load<STREAM>(S + (t * BW + r + RPP * j) * KC + i * LPR + l);
    }
  }
  pdl_wait_late(p);  // its callers: pdl_wait_early
  // The row this lane reduces last (the butterfly's result) and its v.
  const int my_j = l / F;
  const int my_row = r + RPP * my_j;
  // Every other load of the step (v, q and k of this lane's channels, the gates) before any use.
  uint32_t v_bits[TPW];
#pragma unroll
  for (int t = 0; t < TPW; ++t) v_bits[t] = load_bits(p.v, p.dtype, n * p.v_stride_n + hv * p.v_stride_h + row0 + t * BW + my_row);
  const int64_t qo = n * p.q_stride_n + h * p.q_stride_h, ko = n * p.k_stride_n + h * p.k_stride_h;
  RunBits<E> q_bits[CPL], k_bits[CPL];
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    q_bits[i] = load_run_bits<E>(p.q, p.dtype, qo + E * (i * LPR + l), p.qk_aligned);
    k_bits[i] = load_run_bits<E>(p.k, p.dtype, ko + E * (i * LPR + l), p.qk_aligned);
  }
  DecayBits d_bits[PER_CHANNEL ? CPL * E : 1];
  if constexpr (PER_CHANNEL) {
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
#pragma unroll
      for (int m = 0; m < E; ++m) d_bits[i * E + m] = load_decay_bits(p, n, hv, E * (i * LPR + l) + m);
    }
  } else {
    d_bits[0] = load_decay_bits(p, n, hv, -1);
  }
  const uint32_t a_log_bits = load_a_log_bits(p, hv), beta_bits = load_beta_bits(p, n, hv);

  // Then their values, and the three dot products over the row's lanes.
  float vv[TPW];
#pragma unroll
  for (int t = 0; t < TPW; ++t) vv[t] = widen_bits(v_bits[t], p.dtype);
  float qv[CPL][E], kv[CPL][E], decay[CPL * E];  // decay of channel E * (i * LPR + l) + m at i * E + m
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    widen_run<E>(q_bits[i], p.dtype, p.qk_aligned, qv[i]);
    widen_run<E>(k_bits[i], p.dtype, p.qk_aligned, kv[i]);
  }
  if constexpr (PER_CHANNEL) {
    decays<CPL * E>(p, d_bits, a_log_bits, decay);
  } else {
    const float d = decay_of<false>(p, d_bits[0], a_log_bits);
#pragma unroll
    for (int i = 0; i < CPL * E; ++i) decay[i] = d;
  }
  const float beta = beta_of(p, beta_bits);
  const QkScales sc = lane_qk_scales<1, LPR>(p, qv, kv);
  // KDA: the per-channel decay folded into k and q. GDN: one decay per head, applied to the row
  // sums instead (the same value, 8 registers and 2 multiplies per channel fewer).
  float kd[CPL][E], qd[CPL][E];
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
#pragma unroll
    for (int m = 0; m < E; ++m) {
      kd[i][m] = PER_CHANNEL ? kv[i][m] * decay[i * E + m] : kv[i][m];
      qd[i][m] = PER_CHANNEL ? qv[i][m] * decay[i * E + m] : qv[i][m];
    }
  }
  const float sum_decay = PER_CHANNEL ? 1.f : decay[0];
  if constexpr (STAGED_LAST) cp_async_wait<0>();
  // Chunk (j, i) of tile t: from registers, or the staged tile's from shared memory.
  auto raw = [&](int t, int j, int i) -> Raw {
    if (STAGED_LAST && t == TPW - 1) return staged[(r + RPP * j) * KC + i * LPR + l];
    return s[t][j][i];
  };

  // Per tile: the row partial sums, reduced by tile_row_sums.
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    auto partial = [&](int j, float& pk, float& pq) {
      pk = 0.f;
      pq = 0.f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        float x[E];
        C::widen(raw(t, j, i), x);
#pragma unroll
        for (int m = 0; m < E; ++m) {
          pk += x[m] * kd[i][m];
          pq += x[m] * qd[i][m];
        }
      }
    };
    float pk, pq;
    tile_row_sums<NP, LPR>(partial, lane, pk, pq);
    const float u_mine = beta * (vv[t] - pk * (sum_decay * sc.k));
    const float o_row = pq * (sum_decay * sc.q) + u_mine * sc.qk;
    if constexpr (EPI) {
      const float o_out = rounded(o_row, p.dtype);
      if (l % F == 0) epi->o[row0 + t * BW + my_row] = o_out;
      epi->sumsq += warp_sum(l % F == 0 ? o_out * o_out : 0.f);
    } else {
      if (l % F == 0) store_f(p.out, p.dtype, o_at + t * BW + my_row, o_row);
    }
    if (DST_CHECK && !slot_valid(p, dst)) continue;

    if (!STAGED_LAST || t < TPW - 1) {
#pragma unroll
      for (int j = 0; j < NP; ++j) {
#pragma unroll
        for (int i = 0; i < CPL; ++i) opaque(s[t][j][i]);
      }
    }
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const float us = sc.k * __shfl_sync(0xffffffffu, u_mine, r * LPR + j * F);
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        float x[E];
        C::widen(raw(t, j, i), x);
#pragma unroll
        for (int m = 0; m < E; ++m) x[m] = x[m] * decay[i * E + m] + kv[i][m] * us;
        state_store<STREAM>(D + (t * BW + r + RPP * j) * KC + i * LPR + l, C::narrow(x));
      }
    }
  }
}

// One work item of the warp kernel: request n32, value head hv32, group g of TPW tiles.
template <int K, typename ST, int BW, bool PER_CHANNEL, int TPW, bool STREAM>
__device__ __forceinline__ void warp_tile(const GdnDecodeParams& p, uint32_t g, uint32_t hv32, uint32_t n32) {
  // The qk head: off the path to the slot's load, which needs n alone.
  const int64_t n = n32, hv = hv32, h = qk_head(p, hv32);
  const int64_t slot = p.idx_is_int64 ? static_cast<const int64_t*>(p.idx)[n] : static_cast<const int32_t*>(p.idx)[n];
  if (!slot_valid(p, slot)) {
    const int64_t o_at = n * p.out_stride_n + hv * p.out_stride_h + int64_t(g) * (BW * TPW);
    for (int row = threadIdx.x; row < BW * TPW; row += 32) store_f(p.out, p.dtype, o_at + row, 0.f);
    return;
  }
  warp_step<K, ST, BW, PER_CHANNEL, TPW, STREAM>(p, g, hv, h, n, slot, slot);
}

// PERSIST: a grid of one wave whose warps loop over the work items, so a warp's stores drain while
// it loads its next tile instead of holding its registers at exit, and no block is launched per
// tile. The evict-first plain grid measured faster, so the launch rule does not take it; the sweep
// (benchmarks/warp_sweep.cu) still times it.
// STREAM: the state loads and stores carry the evict-first hint (state_load).
template <int K, typename ST, int BW, bool PER_CHANNEL, int TPW = 1, bool PERSIST = false, bool STREAM = false>
__global__ void __launch_bounds__(32, (warp_min_blocks<K, ST, BW, TPW>())) decode_vk_warp_kernel(const GdnDecodeParams p) {
  pdl_wait_early(p);
  if constexpr (PERSIST) {
    // 32-bit: the item count is below 2^31, and a 64-bit division costs ~100 instructions on the
    // path to the slot's load.
    const uint32_t groups = static_cast<uint32_t>(p.V) / (BW * TPW), HV = static_cast<uint32_t>(p.HV);
    const uint32_t items = static_cast<uint32_t>(p.N) * HV * groups;
    for (uint32_t w = blockIdx.x; w < items; w += gridDim.x) {
      const uint32_t nh = w / groups, n = nh / HV;
      warp_tile<K, ST, BW, PER_CHANNEL, TPW, STREAM>(p, w - nh * groups, nh - n * HV, n);
    }
  } else {
    // A grid of (tile groups, value heads, requests): no division before the slot's load
    // (launch_gdn_decode keeps N within the grid's z limit).
    warp_tile<K, ST, BW, PER_CHANNEL, TPW, STREAM>(p, blockIdx.x, blockIdx.y, blockIdx.z);
  }
}

template <int K, typename ST, int BW, int TPW = 1, bool PERSIST = false, bool STREAM = false>
int launch_vk_warp_rows(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_vk_warp_kernel<K, ST, BW, true, TPW, PERSIST, STREAM>
                                : decode_vk_warp_kernel<K, ST, BW, false, TPW, PERSIST, STREAM>;
  int64_t grid = p.N * p.HV * (p.V / (BW * TPW));
  if constexpr (PERSIST) {
    // One wave of resident warps (the GDN build stands for both: the KDA build differs by a few registers).
    const int per_sm = resident_blocks_of<decode_vk_warp_kernel<K, ST, BW, false, TPW, true, STREAM>>(p.device, 32, 0);
    const int64_t wave = int64_t(per_sm > 0 ? per_sm : 1) * (p.sm_count > 0 ? p.sm_count : 1);
    grid = grid < wave ? grid : wave;
  }
  const dim3 blocks = PERSIST ? dim3(static_cast<unsigned>(grid))
                              : dim3(static_cast<unsigned>(p.V / (BW * TPW)), static_cast<unsigned>(p.HV),
                                     static_cast<unsigned>(p.N));
  return launch_decode(kernel, blocks, dim3(32), p, stream);
}

}  // namespace
}  // namespace cudelta
