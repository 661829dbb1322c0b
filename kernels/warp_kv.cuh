// The warp kernel of layout "kv" [K, V]: a warp owns all K rows of a few value columns, so every
// reduction of the step stays inside the warp. launch_rules.cuh picks the build for a batch.
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

// One warp owns all K rows of BW = CPR * E value columns and keeps them
// in registers. The step's reductions run over k, down the columns, so a lane holds NR consecutive
// rows of one 16-byte column chunk: it sums its rows alone, and only the RPI lanes of a column
// chunk exchange their sums, never another warp: by the transposing butterfly, after which a lane
// holds NF of the chunk's E column sums (whose u and outputs it computes) and the u of the others
// come back by shuffle. A load instruction covers RPI row segments of CPR * 16 bytes (whole 32-byte
// sectors). The lane's q, k (and KDA's decay) are its NR consecutive channels, read as vectors.
// K = 256 runs the block kernel instead (block_kv.cuh says why).
template <int K, typename ST, int CPR>
struct KvWarpShape {
  static constexpr int E = Chunk<ST>::E;  // columns per 16-byte chunk
  static constexpr int BW = CPR * E;      // columns per tile
  static constexpr int RPI = 32 / CPR;    // rows per load instruction
  static constexpr int NR = K / RPI;      // consecutive rows a lane holds
  static constexpr int RUN = NR >= 8 ? 8 : 4;
  static constexpr int NF = E > RPI ? E / RPI : 1;  // column sums a lane ends the butterfly with
  static_assert(CPR >= 1 && CPR <= 32 && 32 % CPR == 0 && NR >= 4 && NR % RUN == 0, "kv warp tile shape");
};

// The first of the NF columns (of the lane's chunk) whose sums the butterfly leaves to `lane`, and
// the lane of column chunk c that holds column m: the halving levels run at lane offsets 16, 8, ...
// and give the upper half, E/2, E/4, ..., to the lanes with that bit set.
template <int E, int CPR>
__device__ __forceinline__ int kv_first_column(int lane) {
  int m = 0;
#pragma unroll
  for (int o = 16, h = E / 2; o >= CPR && h >= 1; o >>= 1, h >>= 1) m += (lane & o) ? h : 0;
  return m;
}
template <int E, int CPR>
__device__ __forceinline__ int kv_holder(int c, int m) {
  int lane = c;
#pragma unroll
  for (int o = 16, h = E / 2; o >= CPR && h >= 1; o >>= 1, h >>= 1) lane += (m & h) ? o : 0;
  return lane;
}

template <int K, typename ST, int CPR, bool PER_CHANNEL>
constexpr int kv_warp_min_blocks() {
  using Sh = KvWarpShape<K, ST, CPR>;
  constexpr int regs = Sh::NR * 4 + Sh::NR * (PER_CHANNEL ? 3 : 2);
  return regs >= 140 ? 8 : regs >= 80 ? 12 : 16;
}

// WPB warps per block: adjacent column tiles of one head, each warp on its own (no block sync),
// started together so a row's segments are read and written at about the same time.
template <int K, typename ST, int CPR, bool PER_CHANNEL, int WPB = 1, bool STREAM = false>
__global__ void __launch_bounds__(32 * WPB, (kv_warp_min_blocks<K, ST, CPR, PER_CHANNEL>() / WPB > 0
                                                  ? kv_warp_min_blocks<K, ST, CPR, PER_CHANNEL>() / WPB
                                                  : 1))
    decode_kv_warp_kernel(const GdnDecodeParams p) {
  pdl_enter();
  using C = Chunk<ST>;
  using Raw = typename C::Raw;
  using Sh = KvWarpShape<K, ST, CPR>;
  constexpr int E = Sh::E, BW = Sh::BW, NR = Sh::NR, RUN = Sh::RUN, NF = Sh::NF;
  const int lane = threadIdx.x % 32;
  const int c = lane % CPR;
  const int r = lane / CPR;
  const int64_t n = blockIdx.z, hv = blockIdx.y;
  const int64_t col0 = (int64_t(blockIdx.x) * WPB + threadIdx.x / 32) * BW + c * E;
  const int64_t h = qk_head(p, blockIdx.y);
  const int64_t slot = p.idx_is_int64 ? static_cast<const int64_t*>(p.idx)[n] : static_cast<const int32_t*>(p.idx)[n];
  const int64_t o_at = n * p.out_stride_n + hv * p.out_stride_h + col0;
  if (!slot_valid(p, slot)) {
    if (r == 0) {
#pragma unroll
      for (int m = 0; m < E; ++m) store_f(p.out, p.dtype, o_at + m, 0.f);
    }
    return;
  }
  // Rows r * NR + j, columns col0 .. col0 + E - 1, in 16-byte chunks.
  Raw* S = reinterpret_cast<Raw*>(static_cast<ST*>(p.state) + slot * p.state_stride_p + (hv * K + r * NR) * p.V + col0);
  const int64_t row_chunks = p.V / E;

  Raw s[NR];
#pragma unroll
  for (int j = 0; j < NR; ++j) s[j] = state_load<STREAM>(S + j * row_chunks);
  // Every other load of the step before any use (as the vk kernel): v of the columns this lane ends
  // the reduction with (kv_first_column), q and k of its rows, the gates.
  const int m0 = kv_first_column<E, CPR>(lane);
  uint32_t v_bits[NF];
#pragma unroll
  for (int f = 0; f < NF; ++f) v_bits[f] = load_bits(p.v, p.dtype, n * p.v_stride_n + hv * p.v_stride_h + col0 + m0 + f);
  const int64_t qo = n * p.q_stride_n + h * p.q_stride_h + r * NR, ko = n * p.k_stride_n + h * p.k_stride_h + r * NR;
  RunBits<RUN> q_bits[NR / RUN], k_bits[NR / RUN];
#pragma unroll
  for (int i = 0; i < NR / RUN; ++i) {
    q_bits[i] = load_run_bits<RUN>(p.q, p.dtype, qo + RUN * i, p.qk_aligned);
    k_bits[i] = load_run_bits<RUN>(p.k, p.dtype, ko + RUN * i, p.qk_aligned);
  }
  // KDA: the lane's NR rows are key channels with a gate each, the same for the CPR lanes of a row
  // group. The warp shares them out instead: lane L reads and computes channels L * G .. L * G + G - 1
  // (G = K / 32), and each lane fetches its rows' decays by shuffle. Per lane that is G loads beside
  // the tile instead of NR (their bits spilled a 32-row fp32 tile) and G gate formulas instead of NR.
  constexpr int G = K / 32;
  static_assert(!PER_CHANNEL || NR % G == 0, "a lane's rows start at a multiple of G");
  DecayBits d_bits[PER_CHANNEL ? G : 1];
  if constexpr (PER_CHANNEL) {
#pragma unroll
    for (int i = 0; i < G; ++i) d_bits[i] = load_decay_bits(p, n, hv, lane * G + i);
  } else {
    d_bits[0] = load_decay_bits(p, n, hv, -1);
  }
  const uint32_t a_log_bits = load_a_log_bits(p, hv), beta_bits = load_beta_bits(p, n, hv);

  float vv[NF], qv[NR], kv[NR], decay[PER_CHANNEL ? NR : 1];
#pragma unroll
  for (int f = 0; f < NF; ++f) vv[f] = widen_bits(v_bits[f], p.dtype);
#pragma unroll
  for (int i = 0; i < NR / RUN; ++i) {
    widen_run<RUN>(q_bits[i], p.dtype, p.qk_aligned, qv + RUN * i);
    widen_run<RUN>(k_bits[i], p.dtype, p.qk_aligned, kv + RUN * i);
  }
  if constexpr (PER_CHANNEL) {
    float mine[G];
    decays<G>(p, d_bits, a_log_bits, mine);
#pragma unroll
    for (int j = 0; j < NR; ++j) decay[j] = __shfl_sync(0xffffffffu, mine[j % G], (r * NR + j) / G);
  } else {
    decay[0] = decay_of<false>(p, d_bits[0], a_log_bits);
  }
  const float beta = beta_of(p, beta_bits);
  // Each row group's lanes hold the same sums: add across the groups only.
  const QkScales sc = lane_qk_scales<CPR, 32>(p, qv, kv);
  if constexpr (PER_CHANNEL) {
#pragma unroll
    for (int j = 0; j < NR; ++j) qv[j] *= decay[j];
  }
  const float sum_decay = PER_CHANNEL ? 1.f : decay[0];

  // Column sums of the decayed state against k and q over this lane's rows, then across the
  // column's RPI lanes.
  float pk[E], pq[E];
#pragma unroll
  for (int m = 0; m < E; ++m) pk[m] = pq[m] = 0.f;
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    float x[E];
    C::widen(s[j], x);
    const float kj = PER_CHANNEL ? kv[j] * decay[j] : kv[j];
#pragma unroll
    for (int m = 0; m < E; ++m) {
      pk[m] += x[m] * kj;
      pq[m] += x[m] * qv[j];
    }
  }
  butterfly<E, 16, CPR>(pk, pq, lane);
  // This lane's columns m0 .. m0 + NF - 1: their u, and their outputs from the lanes whose row
  // group bits below the butterfly's are zero (one store per column).
  float u[NF];
#pragma unroll
  for (int f = 0; f < NF; ++f) {
    u[f] = beta * (vv[f] - pk[f] * (sum_decay * sc.k));
    if (lane == kv_holder<E, CPR>(c, m0)) store_f(p.out, p.dtype, o_at + m0 + f, pq[f] * (sum_decay * sc.q) + u[f] * sc.qk);
  }
  float us[E];
#pragma unroll
  for (int m = 0; m < E; ++m) us[m] = sc.k * __shfl_sync(0xffffffffu, u[m % NF], kv_holder<E, CPR>(c, m - m % NF));
#pragma unroll
  for (int j = 0; j < NR; ++j) opaque(s[j]);
  // The row stride is a run-time value: hidden here, so the store addresses are stepped from S
  // instead of the loads' NR addresses being kept live (64 registers at NR = 32).
  int64_t step = row_chunks;
  asm volatile("" : "+l"(step));
  Raw* w = S;
#pragma unroll
  for (int j = 0; j < NR; ++j, w += step) {
    float x[E];
    C::widen(s[j], x);
    const float dj = PER_CHANNEL ? decay[j] : decay[0];
#pragma unroll
    for (int m = 0; m < E; ++m) x[m] = x[m] * dj + kv[j] * us[m];
    state_store<STREAM>(w, C::narrow(x));
  }
}

template <int K, typename ST, int CPR, int WPB = 1, bool STREAM = false>
int launch_kv_warp_cols(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_kv_warp_kernel<K, ST, CPR, true, WPB, STREAM>
                                : decode_kv_warp_kernel<K, ST, CPR, false, WPB, STREAM>;
  const dim3 grid(static_cast<unsigned>(p.V / (KvWarpShape<K, ST, CPR>::BW * WPB)), static_cast<unsigned>(p.HV),
                  static_cast<unsigned>(p.N));
  return launch_decode(kernel, grid, dim3(32 * WPB), p, stream);
}

}  // namespace
}  // namespace cudelta
