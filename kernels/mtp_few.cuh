// The few-token kernel of the multi-token contract: vLLM's MTP call with one draft token (idx
// [N, 2]), and up to three (idx [N, 3..4]) with fp32 state (with bf16, vLLM's call on sm_90 images),
// GDN, layout vk, K = 128: each warp's rows of the state loaded straight into registers with its
// tokens' inputs, no shared staging.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "mtp_common.cuh"
#include "mtp_one.cuh"
#include "warp_vk.cuh"

namespace cudelta {
namespace {

// Rows a warp of the few-token kernel (launch_vk_few: 8 in some small grids).
constexpr int kFewRows = 16;
// Rows a warp of bf16's four-column build (launch_vk_few_builds): at kFewRows it spilled.
constexpr int kFewRowsFourBf16 = 8;

// Blocks of the few-token kernel an SM holds at `rows` rows a warp, as its launch bounds ask: two at
// 16 rows (8-warp blocks at V = 128), one below (16-warp blocks at 8 rows; the fp32 cluster builds'
// blocks of 4 rows a warp). few_token_call counts its waves in them.
__host__ __device__ constexpr int few_blocks_per_sm(int rows) { return rows >= 16 ? 2 : 1; }

// A block of V / BW warps a (request, value head), as decode_vk_one_kernel: a warp loads its BW rows
// of the starting slot and the inputs of its first tokens at once, carries the rows in fp32 from
// token to token (a bf16 state is rounded only where it is stored), stores them at each token's
// checkpoint slot and keeps its outputs in shared memory; the block meets once, for the epilogue's
// mean over V. TT: the idx columns it takes (a request has at most that many tokens). Two tokens'
// inputs are all loaded at the start; with four, token t + 1's go out as token t is computed (all
// four at once spilled, 8-308 bytes at sm_90a). The epilogue's sums of squares go to shared memory a
// token at a time, except in the build of two tokens and 16 rows a warp, which keeps them in
// registers to the end (in the loop that build was 1-1.5% slower from B=16 with fp32 state, H200;
// benchmarks/results-h200-mtp.md). CL > 1 (few_cluster_blocks): the head's V rows in CL blocks of a
// cluster instead, V / CL each (blockIdx.z says which), the epilogue's mean over V taken by each
// block from every block's sums. F8: the build of the epilogue's FP8 output (p.out_scale), apart so
// that the builds of v's dtype stay as they were (one store for both spilled 8-12 bytes in the token
// steps, sm_90a fp32 and sm_100 bf16).
// FW: the block's warps as a constant (the profile build: V = 128 fixes them), 0 = read blockDim.
template <int K, typename ST, int BW, int TT, int CL, bool F8, int FW = 0>
__device__ __forceinline__ void few_step(const GdnDecodeParams& p) {
  using C = Chunk<ST>;
  using Raw = typename C::Raw;
  using Sh = WarpShape<K, ST, BW>;
  constexpr int E = Sh::E, KC = Sh::KC, LPR = Sh::LPR, CPL = Sh::CPL, RPP = Sh::RPP, NP = Sh::NP, F = Sh::F;
  constexpr int D = TT <= 2 ? TT : 1;
  constexpr bool kLoopSums = BW < 16 || TT > 2;
  __shared__ float s_o[TT][kMaxOneRows], s_z[TT > 2 ? TT : 1][TT > 2 ? kMaxOneRows : 1];
  __shared__ float s_sumsq[TT][16];
  __shared__ float s_cl[TT][CL];
  __shared__ uint64_t s_sent;
  pdl_wait_early(p);
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, warps = FW > 0 ? FW : static_cast<int>(blockDim.x / 32);
  const int l = lane % LPR, r = lane / LPR;
  const int64_t n = block_request(p), hv = block_head(p);
  const int V = static_cast<int>(p.V);
  int64_t bos, len, start;
  if (!head_request_span(p, n, hv, bos, len, start)) return;
  // CL > 1: the head's rows in CL blocks of a cluster (blockIdx.z: which rows); all return above or
  // none does. Distributed shared memory is written only once every block runs: waited for below.
  if constexpr (CL > 1) {
    if (p.gate_activation > 0) {
      if (threadIdx.x == 0) expect_sends(&s_sent, TT * CL * sizeof(float));
      cluster_arrive_relaxed();
    }
  }
  const int rows = CL > 1 ? V / CL : V, base = CL > 1 ? static_cast<int>(blockIdx.z) * rows : 0;
  const int64_t h = qk_head(p, static_cast<uint32_t>(hv));
  const int row0 = base + warp * BW;
  const int64_t head = (hv * p.V + row0) * int64_t(K);
  ST* const pool = static_cast<ST*>(p.state);

  // The tile first, then the first D tokens' inputs and checkpoint slots (a token past the request's
  // end loads its first token's and is not computed), the epilogue's z and w: all in flight together.
  const Raw* S = reinterpret_cast<const Raw*>(pool + start * p.state_stride_p + head);
  Raw s[NP][CPL];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
#pragma unroll
    for (int i = 0; i < CPL; ++i) s[j][i] = state_load<true>(S + (r + RPP * j) * KC + i * LPR + l);
  }
  pdl_wait_late(p);
  const int my_j = l / F, my_row = r + RPP * my_j;
  const bool epilogue = p.gate_activation > 0, mine = threadIdx.x < rows;
  const unsigned col = static_cast<unsigned>(base) + threadIdx.x;  // this thread's output row of V
  struct Inputs {
    uint32_t v, beta, z;
    RunBits<E> q[CPL], k[CPL];
    DecayBits d;
    int64_t dst;
  };
  Inputs in[D];
  auto load_inputs = [&](int t, Inputs& b) {
    const int64_t tok = bos + (t < len ? t : 0);
    b.v = load_bits(p.v, p.dtype, tok * p.v_stride_n + hv * p.v_stride_h + row0 + my_row);
    const int64_t qo = tok * p.q_stride_n + h * p.q_stride_h, ko = tok * p.k_stride_n + h * p.k_stride_h;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      b.q[i] = load_run_bits<E>(p.q, p.dtype, qo + E * (i * LPR + l), p.qk_aligned);
      b.k[i] = load_run_bits<E>(p.k, p.dtype, ko + E * (i * LPR + l), p.qk_aligned);
    }
    b.d = load_decay_bits(p, tok, hv, -1);
    b.beta = load_beta_bits(p, tok, hv);
    b.dst = load_index(p.idx, p.idx_is_int64, n * p.idx_columns + t);
  };
  // z apart, after the unconditional loads: a load under a condition in their midst split them
  // (H100 and H200, bf16 B=8 T=2: 2-3% slower).
  auto load_z = [&](int t, Inputs& b) {
    b.z = epilogue && mine && t < len ? load_bits(p.z, p.z_dtype, (bos + t) * p.z_stride_n + hv * p.z_stride_h + col) : 0u;
  };
#pragma unroll
  for (int t = 0; t < D; ++t) load_inputs(t, in[t]);
#pragma unroll
  for (int t = 0; t < D; ++t) load_z(t, in[t]);
  const uint32_t w_bits = epilogue && mine ? load_bits(p.norm_weight, p.norm_weight_dtype, col) : 0u;
  const uint32_t a_log_bits = load_a_log_bits(p, hv);

  float x[NP][CPL * E];
#pragma unroll
  for (int j = 0; j < NP; ++j) {
#pragma unroll
    for (int i = 0; i < CPL; ++i) C::widen(s[j][i], &x[j][i * E]);
  }
  // z until the epilogue: two tokens' in registers (the build the A/B timed), more in s_z.
  uint32_t z_bits[TT <= 2 ? TT : 1];
  float ss[kLoopSums ? 1 : TT] = {};
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= len) break;
    Inputs& b = in[t % D];
    float qv[CPL][E], kv[CPL][E];
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      widen_run<E>(b.q[i], p.dtype, p.qk_aligned, qv[i]);
      widen_run<E>(b.k[i], p.dtype, p.qk_aligned, kv[i]);
    }
    const float decay = decay_of<false>(p, b.d, a_log_bits), beta = beta_of(p, b.beta);
    const float v_t = widen_bits(b.v, p.dtype);
    const int64_t dst = b.dst;
    if constexpr (TT <= 2) z_bits[t] = b.z;
    else if (epilogue && mine) s_z[t][threadIdx.x] = widen_bits(b.z, p.z_dtype);
    // The slot of the ring is free: token t + D's inputs go out before this token's chain.
    if (t + D < TT && t + D < len) {
      load_inputs(t + D, b);
      load_z(t + D, b);
    }
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
    const float u_mine = beta * (v_t - pk * (decay * sc.k));
    const float o_row = pq * (decay * sc.q) + u_mine * sc.qk;
    if (epilogue) {
      const float o_out = rounded(o_row, p.dtype);
      if (l % F == 0) s_o[t][row0 - base + my_row] = o_out;
      const float sumsq = warp_sum(l % F == 0 ? o_out * o_out : 0.f);
      if constexpr (kLoopSums) {
        if (lane == 0) s_sumsq[t][warp] = sumsq;
      } else {
        ss[t] = sumsq;
      }
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
    if (slot_valid(p, dst)) {
      Raw* Dp = reinterpret_cast<Raw*>(pool + dst * p.state_stride_p + head);
#pragma unroll
      for (int j = 0; j < NP; ++j) {
#pragma unroll
        for (int i = 0; i < CPL; ++i) state_store<true>(Dp + (r + RPP * j) * KC + i * LPR + l, C::narrow(&x[j][i * E]));
      }
    }
  }
  if (!epilogue) return;
  if constexpr (!kLoopSums) {
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < TT; ++t) s_sumsq[t][warp] = ss[t];
    }
  }
  __syncthreads();
  if constexpr (CL > 1) {
    // Block c's sums go to slot c of every block; each adds them in slot order.
    cluster_wait();
    if (threadIdx.x < TT * CL) {
      const int t = static_cast<int>(threadIdx.x) / CL;
      float mine_sum = 0.f;
      for (int i = 0; i < warps; ++i) mine_sum += s_sumsq[t][i];
      send_cluster(&s_cl[t][blockIdx.z], threadIdx.x % CL, mine_sum, &s_sent);
    }
    wait_sends(&s_sent);
  }
  if (!mine) return;
  const float w = widen_bits(w_bits, p.norm_weight_dtype);
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= len) break;
    float total = 0.f;
    if constexpr (CL > 1) {
      for (int c = 0; c < CL; ++c) total += s_cl[t][c];
    } else {
      for (int i = 0; i < warps; ++i) total += s_sumsq[t][i];
    }
    float z;
    if constexpr (TT <= 2) z = widen_bits(z_bits[t], p.z_dtype);
    else z = s_z[t][threadIdx.x];
    const int64_t at = (bos + t) * p.out_stride_n + hv * p.out_stride_h + col;
    const float y = gated_rms_norm(p, s_o[t][threadIdx.x], total, w, z);
    if constexpr (F8) store_fp8(p, at, y);
    else store_f(p.out, p.dtype, at, y);
  }
}

// VP: the build of vLLM's call (vllm_profile): its dtypes, index widths and V = 128 as constants,
// and so the block's warps; in the fp32 build of 16 rows a warp and two tokens outside clusters the
// dtypes alone (its geometry too spilled 4 bytes a thread, ptxas -v at sm_90a). From sm_100 it
// compiles the generic body, as the streaming kernel's. H100, main's generic build -> these, µs
// (benchmarks/results-few-token-profile.md): T = 2 at 4/8 heads B=1 bf16 6.0 -> 4.7, fp32 6.15 ->
// 4.8, B=16 bf16 8.9 -> 7.4; 16/32 heads B=1 bf16 6.8 -> 5.4, B=8 13.1 -> 10.9; fp32 T = 4 16/32
// B=4 19.0 -> 17.15 (vLLM 0.34's op 5.8, 6.1, 9.55, 6.95, 13.6, 19.95).
template <int K, typename ST, int BW, int TT, int CL = 1, bool F8 = false, bool VP = false>
__global__ void __launch_bounds__(BW >= 16 ? 256 : 512, few_blocks_per_sm(BW)) decode_vk_few_kernel(const GdnDecodeParams p) {
  static_assert(!VP || !F8, "vLLM's call has no FP8 output");
  if constexpr (VP && kProfileBodies) {
    constexpr bool kGeometry = !(std::is_same_v<ST, float> && BW == 16 && TT == 2 && CL == 1);
    few_step<K, ST, BW, TT, CL, F8, kGeometry ? kVllmProfileV / CL / BW : 0>(vllm_profile_params<K, kGeometry>(p));
  } else {
    few_step<K, ST, BW, TT, CL, F8>(p);
  }
}

// Where a call takes the few-token kernel: GDN, layout vk, K = 128, V whole tiles of 16 rows, at
// most kMaxOneRows, and
//   idx [N, 2] (at most two tokens a request): with a bf16 state in grids of at most 2 (request,
//     value head) pairs an SM; with fp32, and with bf16 for vLLM's call on an sm_90 image, in one
//     wave of its 8-warp blocks (two an SM) or in waves that fill at least 90% of the last, up to
//     kFewMaxPairsPerSm pairs an SM;
//   idx [N, 3..4], fp32 state: the same waves, from 90% of the SMs (a pair an SM) up to
//     kFewMaxPairsPerSm4 pairs an SM; bf16, vLLM's call on an sm_90 image: from 90% of the SMs up to
//     kFewMaxPairsPerSm4Bf16 pairs an SM, in waves of its 16-warp blocks (one an SM) as full.
// Elsewhere the streaming kernel. H200, 16/32 heads (benchmarks/results-h200-mtp.md), µs, streaming
// -> this kernel: T = 2 bf16 B=1 / 4 / 8 7.95 / 9.4 / 12.25 -> 7.4 / 8.45 / 11.8 (vLLM's op 8.65 /
// 9.25 / 12.2), but past two pairs an SM slower: B=12 / 16 / 32 16.7 / 19.85 / 35.65 -> 19.1 / 20.75
// / 37.7; fp32 B=4 / 8 / 32 / 128 12.6 / 19.2 / 64.05 / 225.25 -> 11.1 / 17.1 / 58.05 / 215 (vLLM's
// op 12.0 / 18.7 / 61.3 / 225.3), B=12 (384 blocks: 1.45 waves) 25.75 -> 26.55. fp32 T = 3 / 4 B=4
// 15.35 / 17.6 -> 14.5 / 17.1, B=8 24.25 / 28.35 -> 22.2 / 26.2, B=32 81.15 / 98.45 -> 76.3 / 94.3,
// B=128 295.3 / 367.3 -> 290.35 / 364.2 (vLLM's op 14.95 / 17.6, 24.3 / 29.3, 81.9 / 102.55, 303.9
// / 383.5), but T = 4 B=1 / 2 (each token's inputs a round trip, on fewer SMs than the streaming
// kernel's row groups use) 10.9 / 11.9 -> 15.0 / 15.05; bf16 T = 4 (the generic 16-row build)
// slower at every batch (B=4 / 8 / 128 11.6 / 17.25 / 193.4 -> 12.3 / 18.55 / 240.7), T = 8 at all
// but fp32 B=8.
// The profile build (vLLM's call, decode_vk_few_kernel's VP) took bf16 T = 2 past two pairs an SM
// too: H100, 16/32 heads, streaming -> this kernel, µs: B=16 / 32 / 128 / 512 23.05 / 41.7 / 152.4 /
// 581.5 -> 20.7 / 39.6 / 146.2 / 578.15, 4/8 heads B=128 / 512 42.4 / 155.0 -> 39.95 / 149.3
// (vLLM 0.34's op 23.5 / 43.05 / 153.9 / 600.2, 43.2 / 156.0; benchmarks/results-few-token-profile.md).
// Measured on an sm_90 GPU (an H100; not yet on an H200) and taken on sm_90 images only
// (kFewProfileWavesArch): from sm_100 the profile build compiles the generic body. Its bf16 build
// of four tokens at 16 rows a warp spilled (124 bytes a thread at sm_90a); at 8 (16-warp blocks, one
// an SM) none, and vLLM's call takes it at three and four tokens up to 4 pairs an SM: H100,
// streaming -> this kernel, µs, T = 3 / 4: 16/32 heads B=4 9.8 / 11.25 -> 9.2 / 10.55, B=16 30.1 /
// 36.75 -> 29.5 / 35.1; 4/8 B=16 9.85 / 11.2 -> 9.2 / 10.6, B=32 17.1 / 20.1 -> 16.5 / 19.2 (vLLM
// 0.34's op 11.0 / 12.55, 31.55 / 38.65, 11.0 / 12.5, 17.5 / 20.45); past that mixed at 7.8 pairs an
// SM (T = 3 1.007-1.015x, T = 4 0.981-0.987x), slower at 31 (1.06-1.09x;
// benchmarks/results-few-token-bf16-four.md). On an H200 (main's tables at 7f29755, no A/B yet) it
// took 18.3 µs at T = 4 and 256 pairs, two waves (16/32 B=8, 4/8 B=32), where e804148's streaming
// kernel had taken 16.8, and 10.1 at 128 pairs against 11.2 (16/32 B=4): a cap at one wave there is
// the A/B to make (benchmarks/results-h200-7f29755.md).
constexpr int kFewMaxPairsPerSm = 128;
constexpr int kFewMaxPairsPerSm4 = 32;
constexpr int kFewMaxPairsPerSm4Bf16 = 4;
constexpr int kFewProfileWavesArch = 900;
template <typename ST>
bool few_token_call(const GdnDecodeParams& p) {
  constexpr bool fp32 = std::is_same_v<ST, float>;
  // fp32's rules, and a bf16 state's in vLLM's call on an sm_90 image: up to four columns, and waves
  // past the first.
  const bool wide_rules = fp32 || (vllm_profile(p) && p.image_arch == kFewProfileWavesArch);
  if (p.idx_columns < 2 || p.idx_columns > (wide_rules ? 4 : 2) || p.g_per_channel || !p.state_vk || p.K != 128 ||
      p.V % 16 != 0 || p.V > kMaxOneRows)
    return false;
  // A wave: the blocks an SM of the build launch_vk_few_builds picks past one pair an SM.
  const int rows = fp32 || p.idx_columns == 2 ? kFewRows : kFewRowsFourBf16;
  const int64_t pairs = p.N * p.HV, sms = rule_sms(p), wave = few_blocks_per_sm(rows) * sms;
  const int64_t waves = (pairs + wave - 1) / wave;
  const bool full_waves = pairs <= wave || pairs * 10 >= waves * wave * 9;
  if (p.idx_columns > 2)
    return pairs * 10 >= sms * 9 && pairs <= (fp32 ? kFewMaxPairsPerSm4 : kFewMaxPairsPerSm4Bf16) * sms && full_waves;
  return pairs <= wave || (wide_rules && pairs <= kFewMaxPairsPerSm * sms && full_waves);
}

// vLLM's call (no FP8 output) takes the profile build (VP), any other the generic one. PROFILE_ONLY:
// a build only vLLM's call reaches (few_token_call), launched without a generic twin.
template <typename ST, int BW, int TT, bool F8, bool PROFILE_ONLY = false>
int launch_vk_few_rows(const GdnDecodeParams& p, cudaStream_t stream) {
  static_assert(!PROFILE_ONLY || !F8, "vLLM's call has no FP8 output");
  const dim3 grid = request_head_grid(p), block(static_cast<unsigned>(p.V / BW) * 32);
  constexpr auto profile = decode_vk_few_kernel<128, ST, BW, TT, 1, false, true>;
  if constexpr (PROFILE_ONLY) {
    return launch_decode(profile, grid, block, p, stream);
  } else {
    constexpr auto generic = decode_vk_few_kernel<128, ST, BW, TT, 1, F8>;
    if constexpr (F8) return launch_decode(generic, grid, block, p, stream);
    else return launch_profile_or_generic<generic, profile>(p, grid, block, stream);
  }
}

// A head's rows in clusters of CL blocks along z (few_cluster_blocks: sm_90+ images, the epilogue).
template <typename ST, int BW, int TT, int CL, bool F8>
int launch_vk_few_cluster(const GdnDecodeParams& p, cudaStream_t stream) {
  const dim3 grid = request_head_grid(p, CL), block(static_cast<unsigned>(p.V / CL / BW) * 32), cluster(1, 1, CL);
  constexpr auto generic = decode_vk_few_kernel<128, ST, BW, TT, CL, F8>;
  if constexpr (F8) return launch_decode(generic, grid, block, p, stream, 0, cluster);
  else return launch_profile_or_generic<generic, decode_vk_few_kernel<128, ST, BW, TT, CL, false, true>>(p, grid, block, stream, 0, cluster);
}

// Blocks a head's rows take, in a thread block cluster, in the few-token kernel: 4 or 2 where that
// many blocks a (request, value head) pair still fit the SMs once (vLLM's call with one draft token
// and the epilogue, on sm_90+ images), else 1. Fewer rows a block put more SMs on a small grid's
// state and its checkpoint stores; the epilogue's sums of squares cross the cluster through
// distributed shared memory. H200, 16/32 heads, T = 2, µs, one block a pair -> this rule: bf16 B=1 /
// 2 7.4 / 7.6 -> 6.5 / 7.0 (vLLM's op 8.6 / 8.75), fp32 8.45 / 9.1 -> 7.5 / 8.65 (9.8 / 10.15); more
// blocks than the SMs lose (B=4 at 2 a pair, bf16 / fp32 8.4 / 11.0 -> 8.8 / 11.6), and 8 a pair at
// B=1 gains less than 4 (bf16 6.5, fp32 7.7; benchmarks/results-h200-mtp.md).
// A warp's rows in the clusters' blocks: an fp32 state's 4 in clusters of 4 (8-warp blocks at V =
// 128, vLLM 0.34's geometry), else those of launch_vk_few's blocks where pairs fit the SMs once. H200,
// T = 2, 16 -> 4 rows, µs: fp32 4/8 heads B=1 / 4 6.7 / 7.4 -> 5.9 / 6.8, 16/32 B=1 7.5 -> 6.9; a
// bf16 state's 8 -> 4 lost (4/8 B=4 6.5 -> 6.7, 16/32 B=1 6.5 -> 6.7; benchmarks/results-h200-small-grid.md).
template <typename ST, int CL>
constexpr int kFewClusterWarpRows = std::is_same_v<ST, float> ? (CL == 4 ? 4 : kFewRows) : 8;
template <typename ST>
int few_cluster_blocks(const GdnDecodeParams& p) {
  if (!p.clusters || p.gate_activation <= 0 || p.idx_columns != 2) return 1;
  const int64_t pairs = p.N * p.HV, sms = rule_sms(p);
  if (pairs * 4 <= sms && p.V % (4 * kFewClusterWarpRows<ST, 4>) == 0) return 4;
  if (pairs * 2 <= sms && p.V % (2 * kFewClusterWarpRows<ST, 2>) == 0) return 2;
  return 1;
}

// Rows a warp: 8 (a block of 16 warps a head, one an SM) where a bf16 state's pairs fit the SMs
// once, 16 (8-warp blocks, two an SM) elsewhere. H200, 16/32 heads, T = 2, 8 -> 16 rows, µs: bf16
// B=1 / 4 7.4 / 8.45 -> 8.0 / 9.0, B=8 14.45 -> 11.8; fp32 B=1 / 4 8.35 / 11.15 -> 8.45 / 11.1.
template <typename ST, bool F8>
int launch_vk_few_builds(const GdnDecodeParams& p, cudaStream_t stream) {
  switch (few_cluster_blocks<ST>(p)) {
    case 4: return launch_vk_few_cluster<ST, kFewClusterWarpRows<ST, 4>, 2, 4, F8>(p, stream);
    case 2: return launch_vk_few_cluster<ST, kFewClusterWarpRows<ST, 2>, 2, 2, F8>(p, stream);
    default: break;
  }
  if constexpr (std::is_same_v<ST, float>) {
    if (p.idx_columns > 2) return launch_vk_few_rows<ST, kFewRows, 4, F8>(p, stream);
  } else {
    // Only vLLM's call takes bf16's four columns (few_token_call): the profile build alone. Its 16
    // rows a warp spilled 124 bytes a thread at sm_90a (28 generic, 24 with the next token's inputs
    // loaded after the row sums), 8 none.
    if constexpr (!F8) {
      if (p.idx_columns > 2) return launch_vk_few_rows<ST, kFewRowsFourBf16, 4, false, true>(p, stream);
    }
    if (p.N * p.HV <= rule_sms(p)) return launch_vk_few_rows<ST, 8, 2, F8>(p, stream);
  }
  return launch_vk_few_rows<ST, kFewRows, 2, F8>(p, stream);
}

template <typename ST>
int launch_vk_few(const GdnDecodeParams& p, cudaStream_t stream) {
  return p.out_scale != nullptr ? launch_vk_few_builds<ST, true>(p, stream) : launch_vk_few_builds<ST, false>(p, stream);
}

}  // namespace
}  // namespace cudelta
