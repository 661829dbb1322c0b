// The resident multi-token kernel: several tokens per request in order (speculative decoding), the
// state after each token stored to its checkpoint slot, and the gated RMSNorm epilogue; both layouts.
//
// One block per (request, value head), its warps splitting the head's V value rows (columns in
// layout kv) BW a warp. The head's state is read once into fp32 registers, carried in fp32 from
// token to token (a bf16 state is rounded only where it is stored), and written once per
// checkpoint. Every reduction of a token's step stays inside a warp; the block meets only for the
// epilogue's mean over V, one __syncthreads a token (a double-buffered slot per warp).
#pragma once

#include "mtp_common.cuh"

namespace cudelta {
namespace {

template <bool VK, int K, typename ST, int BW, bool PER_CHANNEL>
__global__ void __launch_bounds__(512) decode_mtp_kernel(const GdnDecodeParams p) {
  using Sh = MtpShape<VK, K, ST, BW>;
  constexpr int NV = Sh::NV, NK = Sh::NK, LPR = Sh::LPR;
  // After the transposing butterfly each lane holds the sums of one of its rows, `mine`, shared
  // with the F - 1 other lanes of its group that end with the same row.
  constexpr int F = LPR / NV;
  static_assert(NV <= LPR && (NV & (NV - 1)) == 0, "one row a lane after the butterfly");
  __shared__ float sumsq[2][16];
  pdl_wait_early(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int v0 = warp * BW;
  const int group = lane - lane % LPR, mine = (lane % LPR) / F;
  const bool writer = lane % F == 0;
  const int my_row = v0 + row_of<Sh, VK>(lane, mine);
  const int64_t n = block_request(p), hv = block_head(p), h = qk_head(p, static_cast<uint32_t>(hv));
  const bool epilogue = p.gate_activation > 0;

  auto zero_rows = [&](int64_t first, int64_t end) {
    if (!writer) return;
    for (int64_t tok = first; tok < end; ++tok) store_out_zero(p, tok * p.out_stride_n + hv * p.out_stride_h + my_row);
  };
  int64_t bos, len, start;
  if (!request_span(p, n, zero_rows, bos, len, start)) return;
  const int64_t block = p.K * p.V;
  ST* const pool = static_cast<ST*>(p.state);
  float hs[NV][NK];
  tile_load<VK, K, ST, BW>(p, pool + start * p.state_stride_p + hv * block, v0, lane, hs);
  pdl_wait_late(p);
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
      const float d = decay_of<false>(p, d_bits[0], a_log_bits);
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
      o = gated_rms_norm(p, o, total, w, widen_bits(z_bits, p.z_dtype));
    }
    if (writer) store_out(p, o_at, o);
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

// Resident kernel (decode_mtp_kernel): value rows a warp takes: 16, so a block holds at most 16
// warps (the kernel's launch bound, which leaves it 128 registers a thread).
template <bool VK, int K, typename ST, int BW>
int launch_mtp_rows(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_mtp_kernel<VK, K, ST, BW, true> : decode_mtp_kernel<VK, K, ST, BW, false>;
  return launch_decode(kernel, request_head_grid(p), dim3(static_cast<unsigned>(p.V / BW) * 32), p, stream);
}

}  // namespace
}  // namespace cudelta
