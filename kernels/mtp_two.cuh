// The two-token kernel of the multi-token contract: vLLM's MTP call with one draft token (idx
// [N, 2], GDN, layout vk, K = 128), each warp's rows of the state loaded straight into registers
// with both tokens' inputs, no shared staging.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "mtp_common.cuh"
#include "mtp_one.cuh"
#include "warp_vk.cuh"

namespace cudelta {
namespace {

constexpr int kTwoTokens = 2;
// Rows a warp of the two-token kernel (launch_vk_two: 8 in some small grids).
constexpr int kTwoRows = 16;

// A block of V / BW warps a (request, value head), as decode_vk_one_kernel: a warp loads its BW rows
// of the starting slot and every input of the request's (at most two) tokens at once, carries the
// rows in fp32 from token to token (a bf16 state is rounded only where it is stored), stores them
// at each token's checkpoint slot and keeps its outputs in shared memory; the block meets once,
// for the epilogue's mean over V.
template <int K, typename ST, int BW>
__global__ void __launch_bounds__(BW >= 16 ? 256 : 512, BW >= 16 ? 2 : 1) decode_vk_two_kernel(const GdnDecodeParams p) {
  using C = Chunk<ST>;
  using Raw = typename C::Raw;
  using Sh = WarpShape<K, ST, BW>;
  constexpr int E = Sh::E, KC = Sh::KC, LPR = Sh::LPR, CPL = Sh::CPL, RPP = Sh::RPP, NP = Sh::NP, F = Sh::F;
  constexpr int TT = kTwoTokens;
  __shared__ float s_o[TT][kMaxOneRows];
  __shared__ float s_sumsq[TT][16];
  pdl_enter();
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int l = lane % LPR, r = lane / LPR;
  const int64_t n = block_request(p), hv = block_head(p);
  const int V = static_cast<int>(p.V);
  auto zero_rows = [&](int64_t first, int64_t end) {
    for (int64_t i = threadIdx.x; i < (end - first) * V; i += blockDim.x)
      store_f(p.out, p.dtype, (first + i / V) * p.out_stride_n + hv * p.out_stride_h + i % V, 0.f);
  };
  int64_t bos, len, start;
  if (!request_span(p, n, zero_rows, bos, len, start)) return;
  const int64_t h = qk_head(p, static_cast<uint32_t>(hv));
  const int row0 = warp * BW;
  const int64_t head = (hv * p.V + row0) * int64_t(K);
  ST* const pool = static_cast<ST*>(p.state);

  // The tile first, then both tokens' inputs and checkpoint slots (a one-token request loads its
  // token twice and uses it once), the epilogue's z and w: all in flight together.
  const Raw* S = reinterpret_cast<const Raw*>(pool + start * p.state_stride_p + head);
  Raw s[NP][CPL];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
#pragma unroll
    for (int i = 0; i < CPL; ++i) s[j][i] = state_load<true>(S + (r + RPP * j) * KC + i * LPR + l);
  }
  const int my_j = l / F, my_row = r + RPP * my_j;
  uint32_t v_bits[TT], beta_bits[TT];
  RunBits<E> q_bits[TT][CPL], k_bits[TT][CPL];
  DecayBits d_bits[TT];
  int64_t dst[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    const int64_t tok = bos + (t < len ? t : 0);
    v_bits[t] = load_bits(p.v, p.dtype, tok * p.v_stride_n + hv * p.v_stride_h + row0 + my_row);
    const int64_t qo = tok * p.q_stride_n + h * p.q_stride_h, ko = tok * p.k_stride_n + h * p.k_stride_h;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      q_bits[t][i] = load_run_bits<E>(p.q, p.dtype, qo + E * (i * LPR + l), p.qk_aligned);
      k_bits[t][i] = load_run_bits<E>(p.k, p.dtype, ko + E * (i * LPR + l), p.qk_aligned);
    }
    d_bits[t] = load_decay_bits(p, tok, hv, -1);
    beta_bits[t] = load_beta_bits(p, tok, hv);
    dst[t] = load_index(p.idx, p.idx_is_int64, n * p.idx_columns + t);
  }
  const bool epilogue = p.gate_activation > 0, mine = threadIdx.x < V;
  uint32_t z_bits[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    z_bits[t] = epilogue && mine && t < len ? load_bits(p.z, p.z_dtype, (bos + t) * p.z_stride_n + hv * p.z_stride_h + threadIdx.x) : 0u;
  }
  const uint32_t w_bits = epilogue && mine ? load_bits(p.norm_weight, p.norm_weight_dtype, threadIdx.x) : 0u;
  const uint32_t a_log_bits = load_a_log_bits(p, hv);

  float x[NP][CPL * E];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
#pragma unroll
    for (int i = 0; i < CPL; ++i) C::widen(s[j][i], &x[j][i * E]);
  }
  float ss[TT] = {0.f, 0.f};
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= len) break;
    float qv[CPL][E], kv[CPL][E];
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      widen_run<E>(q_bits[t][i], p.dtype, p.qk_aligned, qv[i]);
      widen_run<E>(k_bits[t][i], p.dtype, p.qk_aligned, kv[i]);
    }
    const float decay = decay_of(p, d_bits[t], a_log_bits), beta = beta_of(p, beta_bits[t]);
    const QkScales sc = lane_qk_scales<1, LPR>(p, qv, kv);
    // Row sums of the undecayed rows (the head's decay and k's scale applied to the sums).
    auto partial = [&](int j, float& pk, float& pq) {
      pk = 0.f;
      pq = 0.f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
#pragma unroll
        for (int m = 0; m < E; ++m) {
          pk += x[j][i * E + m] * kv[i][m];
          pq += x[j][i * E + m] * qv[i][m];
        }
      }
    };
    float pk, pq;
    tile_row_sums<NP, LPR>(partial, lane, pk, pq);
    const float u_mine = beta * (widen_bits(v_bits[t], p.dtype) - pk * (decay * sc.k));
    const float o_row = pq * (decay * sc.q) + u_mine * sc.qk;
    if (epilogue) {
      const float o_out = rounded(o_row, p.dtype);
      if (l % F == 0) s_o[t][row0 + my_row] = o_out;
      ss[t] = warp_sum(l % F == 0 ? o_out * o_out : 0.f);
    } else if (l % F == 0) {
      store_f(p.out, p.dtype, (bos + t) * p.out_stride_n + hv * p.out_stride_h + row0 + my_row, o_row);
    }
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const float us = sc.k * __shfl_sync(0xffffffffu, u_mine, r * LPR + j * F);
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
#pragma unroll
        for (int m = 0; m < E; ++m) x[j][i * E + m] = x[j][i * E + m] * decay + kv[i][m] * us;
      }
    }
    if (slot_valid(p, dst[t])) {
      Raw* D = reinterpret_cast<Raw*>(pool + dst[t] * p.state_stride_p + head);
#pragma unroll
      for (int j = 0; j < NP; ++j) {
#pragma unroll
        for (int i = 0; i < CPL; ++i) state_store<true>(D + (r + RPP * j) * KC + i * LPR + l, C::narrow(&x[j][i * E]));
      }
    }
  }
  if (!epilogue) return;
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < TT; ++t) s_sumsq[t][warp] = ss[t];
  }
  __syncthreads();
  if (!mine) return;
  const float w = widen_bits(w_bits, p.norm_weight_dtype);
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= len) break;
    float total = 0.f;
    for (int i = 0; i < warps; ++i) total += s_sumsq[t][i];
    store_f(p.out, p.dtype, (bos + t) * p.out_stride_n + hv * p.out_stride_h + threadIdx.x,
            gated_rms_norm(p, s_o[t][threadIdx.x], total, w, widen_bits(z_bits[t], p.z_dtype)));
  }
}

// Where a call takes the two-token kernel: idx of two columns (at most two tokens a request), GDN,
// layout vk, K = 128, V whole tiles of 16 rows, at most kMaxOneRows; with a bf16 state in grids of
// at most 2 (request, value head) pairs an SM, with fp32 in one wave of its 8-warp blocks (two an SM)
// or in waves that fill at least 90% of the last, up to kTwoMaxPairsPerSm pairs an SM. Elsewhere the
// streaming kernel. H200, 16/32 heads, T = 2, µs, streaming -> this kernel
// (benchmarks/results-h200-mtp.md): bf16 B=1 / 4 / 8 7.95 / 9.4 / 12.25 -> 7.4 / 8.45 / 11.8 (vLLM's
// op 8.65 / 9.25 / 12.2), but past two pairs an SM slower: B=12 / 16 / 32 16.7 / 19.85 / 35.65 ->
// 19.1 / 20.75 / 37.7; fp32 B=4 / 8 / 32 /
// 128 12.6 / 19.2 / 64.05 / 225.25 -> 11.1 / 17.1 / 58.05 / 215 (vLLM's op 12.0 / 18.7 / 61.3 /
// 225.3), B=12 (384 blocks: 1.45 waves) 25.75 -> 26.55.
constexpr int kTwoMaxPairsPerSm = 128;
template <typename ST>
bool two_token_call(const GdnDecodeParams& p) {
  if (p.idx_columns != kTwoTokens || p.g_per_channel || !p.state_vk || p.K != 128 || p.V % 16 != 0 || p.V > kMaxOneRows)
    return false;
  const int64_t pairs = p.N * p.HV, sms = p.sm_count > 0 ? p.sm_count : 132, wave = 2 * sms;
  if (pairs <= wave) return true;
  const int64_t waves = (pairs + wave - 1) / wave;
  return std::is_same_v<ST, float> && pairs <= kTwoMaxPairsPerSm * sms && pairs * 10 >= waves * wave * 9;
}

template <typename ST, int BW>
int launch_vk_two_rows(const GdnDecodeParams& p, cudaStream_t stream) {
  return launch_decode(decode_vk_two_kernel<128, ST, BW>, request_head_grid(p), dim3(static_cast<unsigned>(p.V / BW) * 32),
                       p, stream);
}

// Rows a warp: 8 (a block of 16 warps a head, one an SM) where a bf16 state's pairs fit the SMs
// once, 16 (8-warp blocks, two an SM) elsewhere. H200, 16/32 heads, T = 2, 8 -> 16 rows, µs: bf16
// B=1 / 4 7.4 / 8.45 -> 8.0 / 9.0, B=8 14.45 -> 11.8; fp32 B=1 / 4 8.35 / 11.15 -> 8.45 / 11.1.
template <typename ST>
int launch_vk_two(const GdnDecodeParams& p, cudaStream_t stream) {
  if constexpr (!std::is_same_v<ST, float>) {
    if (p.N * p.HV <= (p.sm_count > 0 ? p.sm_count : 132)) return launch_vk_two_rows<ST, 8>(p, stream);
  }
  return launch_vk_two_rows<ST, kTwoRows>(p, stream);
}

}  // namespace
}  // namespace cudelta
