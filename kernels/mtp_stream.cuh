// The streaming multi-token kernel and its launch: what vLLM's multi-token calls take.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "mtp_common.cuh"

namespace cudelta {
namespace {

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
// The long-pass build: 9-16 checkpoint columns in one pass (vLLM 0.34's MTP op takes 9 tokens a
// request), at K = 128 in vLLM's layout only. Its staged tokens and outputs take 32 KB of static
// shared memory (KDA's decays 8 KB more); at K = 256 they would take 64 KB, past the 48 KB allowed.
constexpr int kStreamLongTokens = 16;
// Rows a chunk: with 4 the per-chunk work that does not shrink with the rows doubled (H200, 16/32
// heads: bf16 11-46% slower, fp32 -9% to +12%), and ptxas filled the 128 registers either way.
constexpr int kStreamRows = 8;

// The short-chunk build: 4 rows a chunk, in blocks of 8 warps, where that grid fits the SMs once
// (launch_mtp_stream): vLLM 0.34's geometry at small grids, two warps a scheduler.
constexpr int kStreamShortRows = 4;
constexpr int kStreamShortWarps = 8;

template <bool VK, int K, typename ST, int R = kStreamRows>
using StreamShape = MtpShape<VK, K, ST, R>;

template <bool VK, int K, typename ST, int R = kStreamRows>
struct RawTile {
  using Sh = StreamShape<VK, K, ST, R>;
  typename Chunk<ST>::Raw r[VK ? Sh::NV : Sh::NK][Sh::CPR];
};

// 16-byte units of a chunk a lane holds, and the ring: kStreamRing chunks a warp, or as many as the
// warp streams where fewer (the launch sizes the block's dynamic shared memory by it).
template <bool VK, int K, typename ST, int R = kStreamRows>
constexpr int kStreamChunkRaws = (VK ? StreamShape<VK, K, ST, R>::NV : StreamShape<VK, K, ST, R>::NK) * StreamShape<VK, K, ST, R>::CPR;
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
template <bool VK, int K, typename ST, int R = kStreamRows>
__device__ __forceinline__ void raw_copy(const GdnDecodeParams& p, const ST* S, int v0, int lane,
                                         typename Chunk<ST>::Raw* slot) {
  using Sh = StreamShape<VK, K, ST, R>;
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

template <bool VK, int K, typename ST, int R = kStreamRows>
__device__ __forceinline__ void raw_read(const typename Chunk<ST>::Raw* slot, int lane, RawTile<VK, K, ST, R>& t) {
  using Sh = StreamShape<VK, K, ST, R>;
  constexpr int A = VK ? Sh::NV : Sh::NK;
#pragma unroll
  for (int a = 0; a < A; ++a) {
#pragma unroll
    for (int i = 0; i < Sh::CPR; ++i) t.r[a][i] = slot[(a * Sh::CPR + i) * 32 + lane];
  }
}

template <bool VK, int K, typename ST, int R = kStreamRows>
__device__ __forceinline__ void raw_widen(const RawTile<VK, K, ST, R>& t,
                                          float (&h)[StreamShape<VK, K, ST, R>::NV][StreamShape<VK, K, ST, R>::NK]) {
  using Sh = StreamShape<VK, K, ST, R>;
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

// Whether the streaming kernel takes its epilogue's sums of squares after the token loop (bf16
// state) or in the loop, a warp reduction a chunk and token (fp32 state, and sm_100 and later
// images: there ptxas spilled 12-32 bytes a thread otherwise, and no GPU here times them). In the
// loop the reduction sits on the recurrence's path where few warps share an SM: the next token's
// update issues behind its dependent shuffles (ncu, H200, bf16 B=1 T=8: 300 instructions a token,
// issued over 1,330 cycles). After the loop, bf16, 16/32 heads, B=1-128 with 2-8 tokens: H200
// 1.4-4.6% faster in 13 of 15 cells, level in the others (B=128 T=2 125.5 -> 121.6 µs, T=8 373 ->
// 360); H100 2-4% faster at B=1, 1.6-2% slower at B=4 T=2 / T=4 and B=32 T=2, level elsewhere
// (benchmarks/results-h200-mtp.md, results-h100-mtp.md). fp32 after the loop (ptxas spills 20
// bytes a thread at sm_90a): H200 2% faster at B=1, 2-7% slower from B=4 (B=8 T=2 19.1 -> 20.2 µs).
template <typename ST>
__host__ __device__ constexpr bool late_epilogue_sums() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
  return false;
#else
  return !std::is_same_v<ST, float>;
#endif
}

// Whether the sends build (SENDS) sends in this compile pass. From sm_100 it compiles the stores and
// the cluster barrier instead: ptxas spilled 8 bytes a thread in its sm_120 bf16 build (shipped
// flags; sm_90a and sm_100 none), and no GPU here times either image.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr bool kSendsBodies = false;
#else
constexpr bool kSendsBodies = true;
#endif

// STAGE_FIRST: the first pass's staging loads go out before the state's copies, not after
// (kStreamStageFirstBuild: which calls take this build). TS: the tokens a pass stages
// (kStreamTokens, or kStreamLongTokens). R: rows a chunk (kStreamRows, or kStreamShortRows).
// FW, FG: the launch's warps a block and row groups a head, where the build holds them as constants
// (0: blockDim and gridDim.z), so that the ring's depth, a warp's chunks and an output's token and
// row are constants, not divisions (the vLLM profile's builds, decode_mtp_stream_kernel).
// SENDS: the build launched in clusters, whose blocks send the epilogue's sums with st.async,
// counted by a transaction barrier (stream_sends_launch: which calls take it).
template <bool VK, int K, typename ST, bool PER_CHANNEL, bool STAGE_FIRST, int TS, int R, int FW = 0, int FG = 0,
          bool SENDS = false>
__device__ __forceinline__ void stream_step(const GdnDecodeParams& p) {
  using Sh = StreamShape<VK, K, ST, R>;
  constexpr int NV = Sh::NV, NK = Sh::NK, LPR = Sh::LPR, F = LPR / NV;
  static_assert(TS == kStreamTokens || (TS == kStreamLongTokens && K <= 128), "the long pass's staging fits 48 KB at K <= 128");
  static_assert(NV <= LPR && (NV & (NV - 1)) == 0, "one row a lane after the butterfly");
  // The staged tokens: k and q scaled (l2-normalised, q times the attention scale), the per-channel
  // decay (KDA), and per token beta, k.q and the head's decay (GDN); the epilogue's outputs and sums.
  __shared__ float s_k[TS][K], s_q[TS][K], s_d[PER_CHANNEL ? TS : 1][PER_CHANNEL ? K : 1];
  __shared__ float s_beta[TS], s_qk[TS], s_decay[TS];
  // The epilogue's sums of squares a (token, row chunk), added in a fixed order: outputs do not
  // depend on which warp finished first.
  __shared__ float s_ss[TS][kStreamMaxV<K> / R];
  __shared__ int64_t s_dst[TS];
  __shared__ float s_o[TS][kStreamMaxV<K>], s_v[TS][kStreamMaxV<K>];
  __shared__ uint64_t s_sent;  // SENDS: the head's sums arrived (send_cluster)
  pdl_wait_early(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = FW > 0 ? FW : blockDim.x / 32;
  const unsigned threads = FW > 0 ? FW * 32u : blockDim.x;
  const int group = lane - lane % LPR, mine = (lane % LPR) / F;
  const bool writer = lane % F == 0;
  const int64_t n = block_request(p), hv = block_head(p), h = qk_head(p, static_cast<uint32_t>(hv));
  const int V = static_cast<int>(p.V);
  // The head's rows in gridDim.z groups, a block each (small grids: more SMs share a head). The
  // epilogue's mean over V then needs every group's sums: the launch makes the blocks of a head a
  // cluster (launch_mtp_stream) and they exchange them through distributed shared memory.
  const int groups = FG > 0 ? FG : static_cast<int>(gridDim.z), chunks = V / R / groups, c0 = static_cast<int>(blockIdx.z) * chunks;
  const int row0 = c0 * R, rows = chunks * R;
  constexpr bool kLateSums = late_epilogue_sums<ST>();
  constexpr bool kSends = SENDS && kSendsBodies;
  const bool clustered = kSends || (groups > 1 && cluster_size() > 1);
  const bool epilogue = p.gate_activation > 0 && (groups == 1 || clustered);

  // A chunk's sum of squares into `slot` of cluster block `rank` (SENDS: counted by its barrier).
  auto push_sum = [&](float* slot, unsigned rank, float ss) {
    if constexpr (kSends) send_cluster(slot, rank, ss, &s_sent);
    else store_cluster(slot, rank, ss);
  };
  auto zero_rows = [&](int64_t first, int64_t end) {
    for (int64_t i = threadIdx.x; i < (end - first) * rows; i += threads)
      store_out_zero(p, (first + i / rows) * p.out_stride_n + hv * p.out_stride_h + row0 + i % rows);
  };
  int64_t bos, len, start;
  // A cluster's blocks share the request, so they all return here or none does.
  if (!request_span(p, n, zero_rows, bos, len, start)) return;
  // Distributed shared memory is written only once every block of the cluster runs (SENDS: its
  // barrier initialised for the request's sums, its tokens times the head's V / R chunk sums; one
  // pass, as the build takes idx [N, C] with C <= TS and request_span skips longer requests): this
  // arrival is waited for after the staging.
  if (clustered) {
    if (kSends && threadIdx.x == 0) expect_sends(&s_sent, static_cast<unsigned>(len * (V / R) * sizeof(float)));
    cluster_arrive_relaxed();
  }
  const int64_t block = p.K * p.V;
  ST* const pool = static_cast<ST*>(p.state);
  ST* const src = pool + start * p.state_stride_p + hv * block;
  const uint32_t a_log_bits = load_a_log_bits(p, hv);
  // The warp's chunks c = warp, warp + warps, ... go through its ring of `depth` slots in shared
  // memory, kStreamRing of them in flight while one is computed (a group of async copies a
  // chunk, committed even where empty so that every wait counts the same). The first ones are
  // issued before the tokens are staged, so that their round trip overlaps the staging's, or
  // (STAGE_FIRST) right after a warp's first staging loads.
  using Raw = typename Chunk<ST>::Raw;
  extern __shared__ __align__(16) unsigned char s_ring_bytes[];
  const int depth = stream_ring_depth(chunks, warps, kStreamChunkRaws<VK, K, ST, R> * 32 * 16), mine_chunks = (chunks - warp + warps - 1) / warps;
  constexpr int kSlotRaws = kStreamChunkRaws<VK, K, ST, R> * 32;
  Raw* const ring = reinterpret_cast<Raw*>(s_ring_bytes) + warp * depth * kSlotRaws;
  // The warp's i-th chunk into ring slot `slot`; first: its first chunk (c0 + warp).
  auto copy_chunk = [&](int first, int i, int slot) {
    raw_copy<VK, K, ST, R>(p, src, (first + i * warps) * R, lane, ring + slot * kSlotRaws);
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
  if constexpr (!STAGE_FIRST) ring_start(c0 + warp);
  pdl_wait_late(p);  // STAGE_FIRST: the ring's first copies come after it

  for (int64_t g0 = 0; g0 < len; g0 += TS) {
    const int tg = static_cast<int>(len - g0 < TS ? len - g0 : TS);
    // The epilogue's z and w of this thread's outputs, in flight while the step runs.
    constexpr int ZPT = 4;  // outputs a thread finishes from registers (more: loaded at the end)
    uint32_t z_bits[ZPT], w_bits[ZPT];
    if (epilogue) {
#pragma unroll
      for (int j = 0; j < ZPT; ++j) {
        const int i = threadIdx.x + j * threads;
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
    const int first_base = split && warp >= tg ? warp - tg : warp;
    if constexpr (STAGE_FIRST) {
      if (g0 == 0 && first_base >= tg) ring_start(c0 + warp);  // a warp that stages nothing
    }
    for (int base = first_base; base < tg; base += kStageAhead * warps) {
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
      if constexpr (STAGE_FIRST) {
        if (g0 == 0 && base == first_base) ring_start(c0 + warp);
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
          s_decay[t] = PER_CHANNEL ? 1.f : decay_of<false>(p, b.d[0], a_log_bits);
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
        RawTile<VK, K, ST, R> raw;
        raw_read<VK, K, ST, R>(ring + (i % depth) * kSlotRaws, lane, raw);
        raw_widen<VK, K, ST, R>(raw, hs);
      }
      // The slot is free once its values are in registers (the widening waited for them; in-order
      // issue puts the copy after it): the chunk `depth` ahead goes in.
      fetch(i + depth);
      const int my_row = v0 + row_of<Sh, VK>(lane, mine);
      // Not unrolled: the body is the kernel's bulk, and eight copies of it cost the release 2.5x its
      // compile time and size for no measured speed (benchmarks/results-h100-mtp.md).
      // One token a round. Two other forms lost on an H100 (benchmarks/results-h100-token-loop.md):
      // every sum taken against the starting row, then a triangular solve a row (1.10-1.36x the
      // time); two tokens a round (0.96x at 4/8 heads bf16 B <= 2 T=8, but 1.01-1.05x at B=4 and
      // at 16/32 heads B=1).
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
        // With the epilogue the outputs wait in shared memory; their sums of squares are taken here
        // or after the loop (late_epilogue_sums).
        if (epilogue) {
          if constexpr (!kLateSums) {
            // A warp's rows at a time (the writers hold each row once).
            const float ss = warp_sum(writer ? o * o : 0.f);
            if (writer) s_o[t][my_row] = o;
            if (!clustered) {
              if (lane == 0) s_ss[t][v0 / R] = ss;
            } else if (lane < groups) {
              push_sum(&s_ss[t][v0 / R], static_cast<unsigned>(lane), ss);  // into every block of the head
            }
          } else if (writer) {
            s_o[t][my_row] = o;
          }
        } else if (writer) {  // no epilogue, so never the FP8 output (store_out)
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
      // kLateSums: each (token, row chunk) of the block, the sum of its rows' squared outputs in row
      // order (a warp a token, a lane a chunk), into slot c of every block of the head.
      if constexpr (kLateSums) __syncthreads();
      if (kLateSums && lane < chunks) {
        const int c = c0 + lane;
        for (int t = warp; t < tg; t += warps) {
          float ss = 0.f;
#pragma unroll
          for (int r = 0; r < R; ++r) ss += s_o[t][c * R + r] * s_o[t][c * R + r];
          if (!clustered) {
            s_ss[t][c] = ss;
          } else {
            for (int g = 0; g < groups; ++g) push_sum(&s_ss[t][c], static_cast<unsigned>(g), ss);
          }
        }
      }
      if constexpr (kSends) {
        // The block's outputs (kLateSums: the barrier before the sums ordered them), then the head's
        // sums: no release barrier, so the state's stores drain while the outputs are normed.
        if constexpr (!kLateSums) __syncthreads();
        wait_sends(&s_sent);
      } else if (clustered) {
        cluster_arrive();
        cluster_wait();
      } else {
        __syncthreads();
      }
      // Token t's sum of squares from the head's chunk sums in chunk order, whichever blocks made them
      // (a warp's threads share t: broadcast reads).
      auto sumsq = [&](int t) {
        float ss = 0.f;
        for (int c = 0; c < V / R; ++c) ss += s_ss[t][c];
        return ss;
      };
#pragma unroll
      for (int j = 0; j < ZPT; ++j) {
        const int i = threadIdx.x + j * threads;
        if (i >= tg * rows) break;
        const int t = i / rows, v = row0 + i % rows;
        const float z = widen_bits(z_bits[j], p.z_dtype), w = widen_bits(w_bits[j], p.norm_weight_dtype);
        store_out(p, (bos + g0 + t) * p.out_stride_n + hv * p.out_stride_h + v,
                gated_rms_norm(p, s_o[t][v], sumsq(t), w, z));
      }
      for (int i = threadIdx.x + ZPT * threads; i < tg * rows; i += threads) {  // long passes on few warps
        const int t = i / rows, v = row0 + i % rows;
        const float z = load_f(p.z, p.z_dtype, (bos + g0 + t) * p.z_stride_n + hv * p.z_stride_h + v);
        store_out(p, (bos + g0 + t) * p.out_stride_n + hv * p.out_stride_h + v,
                gated_rms_norm(p, s_o[t][v], sumsq(t), load_f(p.norm_weight, p.norm_weight_dtype, v), z));
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

// The streaming kernel's profile builds (VP; vllm_profile, mtp_common.cuh): the short-chunk launch,
// whose grid V = 128 makes a constant too (8 warps a block, 4 row groups: no division for the ring's
// depth, a warp's chunks, an output's token and row), and the staging-first one. H200, main's
// generic builds -> these, µs (benchmarks/results-vllm-profile-grid.md): 4/8 heads B=1 bf16 T=4 / 8
// 6.6 / 9.15 -> 6.3 / 8.6, B=4 7.9 / 11.35 -> 7.6 / 10.7, fp32 B=4 T=8 13.6 -> 12.45; 16/32 B=1
// fp32 T=8 13.45 -> 12.2; staging-first, 16/32 bf16 B=4 T=4 / 8 11.35 / 16.2 -> 10.4 / 15.0, B=8
// 16.85 / 26.45 -> 16.3 / 25.45. The 8-row build of larger grids gained nothing so (H100, 16/32
// heads, B=32-512: bf16 0.99-1.01x main's time, fp32 level) and spilled 4 bytes a thread at sm_90a
// (bf16) and 36 at sm_80 (fp32): it has none.
template <bool VK, int K, typename ST, bool PER_CHANNEL, bool STAGE_FIRST = false, int TS = kStreamTokens,
          int R = kStreamRows, bool VP = false, bool SENDS = false>
__global__ void __launch_bounds__(512) decode_mtp_stream_kernel(const GdnDecodeParams p) {
  if constexpr (SENDS && !kClusterBodies) {
    __trap();  // launched in clusters, so from sm_90 images only (GdnDecodeParams::clusters)
  } else if constexpr (VP && kProfileBodies) {
    if constexpr (R == kStreamShortRows) {
      // The short-chunk launch's geometry too (launch_mtp_stream_short), which V = 128 fixes.
      stream_step<VK, K, ST, PER_CHANNEL, STAGE_FIRST, TS, R, kStreamShortWarps, kVllmProfileV / (R * kStreamShortWarps),
                  SENDS>(vllm_profile_params<K, true>(p));
    } else {
      // The staging-first launch (launch_mtp_stream): its geometry as constants too spilled 12-52 bytes
      // a thread (ptxas -v, sm_90a), its dtypes and index widths alone none.
      static_assert(STAGE_FIRST && !SENDS, "the profile's builds: short-chunk and staging-first");
      stream_step<VK, K, ST, PER_CHANNEL, STAGE_FIRST, TS, R>(vllm_profile_params<K, false>(p));
    }
  } else {
    stream_step<VK, K, ST, PER_CHANNEL, STAGE_FIRST, TS, R, 0, 0, SENDS>(p);
  }
}

// The streaming kernel's launch (launch_mtp_stream): a warp a chunk while the grid's warps number
// at most 16 an SM; past that, blocks of 8 or of 4 warps, by the rounds each grid takes
// (stream_block_warps). fp32 requests of at most two tokens take at most kMtpShortWideWarps a block
// even in small grids (a block's staging barrier stalls fewer warps; H100, 16/32 heads, B=4 T=2:
// 14.3 -> 13.7 µs, 0.96x -> 1.00x vLLM's op; bf16 lost with it: benchmarks/results-h100-mtp.md;
// on an H200 16 warps there lose 3.6%, 12.55 -> 13.0 µs). Nor does a build in which every warp
// stages the pass's tokens for itself, with no barrier before its token loop, gain: 3-10% slower
// (H200, T=2, B=4-128, both states: benchmarks/results-h200-mtp.md).
constexpr int kMtpShortWideWarps = 8;

// Blocks of 8 warps (w8, each two chunks where the head has 16) or of 4 (w4, four chunks), bps8 and
// bps4 resident an SM (the driver's occupancy at the block's warps and ring). A round is a wave of
// resident blocks, and a warp streams its chunks one after another, so a grid's length is its
// rounds times the chunks a warp takes. 8 warps where that is at most 9/10 of 4 warps' (bf16,
// 16/32 heads: B=8, one round either way, half the chunks a warp; B=24, 3 rounds of 2 chunks
// against 2 of 4), or, for requests of more than four tokens, where it is no longer and both grids
// fill their last rounds to 90% (a warp's longer stream of chunks then gains 1-3%); else 4, whose
// barriers stall fewer warps. H100, 16/32 heads, µs, 8 -> 4 warps (benchmarks/results-h100-mtp.md):
// bf16 T=2 B=12 / 16 / 32 / 128: 23.4 / 25.7 / 47.9 / 177 -> 18.4 / 23.3 / 41.7 / 153; B=24 T=4 /
// T=8 53.7 / 90.3 -> 58.6 / 105 (so 8 there); T=8 B=16 / 32 62.8 / 118 -> 64.3 / 122 (8 there);
// fp32 (three 4-warp blocks an SM, their ring takes the shared memory) B=16 T=2 41.1 -> 45.6 (8).
// It replaces 2-warp blocks for requests of at most two tokens in large grids (an H200 gain at an
// older commit, bf16 B=512 T=2 524 -> 476 µs): on this commit's H100, 4 warps beat them at every
// T=2 batch from 128 to 512, both states (bf16 B=512 592 -> 580, fp32 1152 -> 1134 µs).
inline int stream_block_warps(int64_t blocks, int chunks, int64_t sms, bool long_requests, int w8, int bps8, int w4,
                              int bps4) {
  if (w8 == w4 || bps8 <= 0 || bps4 <= 0) return w4;
  auto rounds = [&](int bps) { return (blocks + bps * sms - 1) / (bps * sms); };
  const int64_t r8 = rounds(bps8), r4 = rounds(bps4);
  const int64_t work8 = r8 * ((chunks + w8 - 1) / w8), work4 = r4 * ((chunks + w4 - 1) / w4);
  const bool full8 = blocks * 10 >= r8 * bps8 * sms * 9, full4 = blocks * 10 >= r4 * bps4 * sms * 9;
  return work8 * 10 <= work4 * 9 || (long_requests && work8 <= work4 && full8 && full4) ? w8 : w4;
}

// Row groups of the streaming kernel (launch_mtp_stream): blocks a head at most 1 / kMtpGroupSmShare
// of the SMs, each at least kMtpGroupChunks row chunks (blocks of fewer warps stage several tokens a
// warp), or up to one block an SM where each keeps twice that; at most kMtpMaxClusterGroups in a
// cluster (the portable size). H200, T = 2 / 4 / 8, µs, one group -> this rule
// (benchmarks/results-h200-mtp.md): 16/32 heads B=1 bf16 9.2 / 11.2 / 16.6 -> 8.5 / 9.7 / 13.3; 4/8
// heads B=1 8.8 / 11.1 / 16.6 -> 7.7 / 8.9 / 12.6; 16/64 heads B=1 (two groups of 8 chunks, 128
// blocks) bf16 9.1 / 11.4 / 16.5 -> 8.3 / 9.8 / 13.3, fp32 11.4 / 15.1 / 22.2 -> 10.0 / 11.9 / 17.0.
// Groups of 2-warp blocks (4/8 at B=1 in 8 groups: 14.4 at T=8) and a grid of 4-chunk blocks past
// half the SMs (16/32 at B=1 in 4 groups: 14.7) gain less; past one block an SM nothing: at about
// one (128 request-head pairs, T = 8, H100) two groups took 1.02-1.13x one's time and four 1.37-1.79x,
// the short-chunk build's four 8-warp blocks a head 1.24-1.65x (benchmarks/results-h100-d9fced0.md);
// 4-row chunks at 32/32 heads, B=4, T=8, fp32 / bf16: two 16-warp row groups (vLLM's block count;
// two waves at 120-124 registers a thread) 1.05 / 1.37x, one 16- or 8-warp block a head 1.03-1.04 /
// 1.16-1.40x (benchmarks/results-h100-t8-one-wave.md).
constexpr int kMtpGroupSmShare = 2;
constexpr int kMtpGroupChunks = 4;
constexpr int kMtpMaxClusterGroups = 8;

// The staging-first build of the streaming kernel (STAGE_FIRST) and where the launch takes it: GDN
// with a bf16 state in vLLM's layout (vk, K = 128), one block a head, and a grid of at most
// kStreamStageFirstSmWarps chunks an SM: B=3-8 at 16/32 heads (a warp a chunk to B=4, then 8-warp
// blocks of two chunks a warp). There the state's copies, issued first, held up the staging's loads
// behind them and the block waited at the staging barrier for the whole state (ncu, H200, bf16 B=4
// T=2: 18.5% of the warps' samples at that barrier, vLLM's op 10.7%; none at the chunk's wait after
// it). H200, 16/32 heads, µs (benchmarks/results-h200-mtp.md): B=4 T=2 / 4 / 8 9.7 / 12.0 / 17.0 ->
// 9.2 / 11.5 / 16.9 (vLLM's op 9.3 / 13.0 / 21.0); B=8 12.85 / 17.75 / 28.15 -> 12.35 / 17.4 / 28.0
// (vLLM's op 12.0 / 18.5 / 30.7). Past that it loses: B=32 T=4 +6.5%, B=128 T=4 +2.7%; and with
// fp32 state +4-5% from T=4 at B=4-128 (B=4 T=2 -1%). One kernel with both orders lost 3-8% from
// B=32 with 4 and more tokens (ptxas's allocation at the 128-register cap), so the order is a
// separate build; row groups (B=1) did not gain. On an H100 the build gains at B=6 and 8 with every
// token count: T=2 6%, T=4 2-3%, T=8 1.5-2% (benchmarks/results-h100-mtp.md). vLLM's own call takes
// its profile build (vllm_profile).
constexpr int kStreamStageFirstSmWarps = 32;
template <bool VK, int K, typename ST>
constexpr bool kStreamStageFirstBuild = VK && K == 128 && !std::is_same_v<ST, float>;

// The short-chunk build: kStreamShortRows rows a chunk, a warp a chunk in blocks of
// kStreamShortWarps, the head's rows in V / 32 row groups (a cluster with the epilogue), where those
// blocks fit the SMs once: GDN in vLLM's layout at K = 128, a pass of kStreamTokens, requests x heads
// <= SMs / 4 at V = 128 (16/32 heads at B = 1, 4/8 heads at B <= 4). There the 8-row grid gives a
// scheduler one or two warps of 8 rows (4/8 heads, B = 1: 32 blocks of 4 warps); vLLM 0.34's op runs
// 32 blocks of 8 warps of 4 rows (its machine code: benchmarks/results-vllm-0.34-surface.md).
// H200, main's 8-row grid -> this build, µs: 4/8 heads B=1 T=4 / 8 bf16 8.0 / 11.7 -> 7.1 / 10.0, fp32
// 8.4 / 12.4 -> 7.6 / 10.6; 16/32 B=1 fp32 T=4 / 8 10.6 / 15.0 -> 9.6 / 14.3; no cell of the rule
// slower (benchmarks/results-h200-small-grid.md).
// The sends build (SENDS): where the launch makes clusters of a head's row groups for the epilogue,
// GDN in vLLM's layout at K = 128 with checkpoint columns (idx [N, C], C <= kStreamTokens: one pass),
// the blocks send their sums with st.async, counted by a transaction barrier, in place of stores
// and a cluster barrier, whose arrive releases (MEMBAR.ALL.GPU): each warp then first waited for
// its state stores to be performed. A separate build: the same exchange in the one build slowed
// the grids that make no cluster by 1.2-4% (H100, bf16 B=32 T=4 67.9 -> 70.6 µs; the variant,
// benchmarks/results-h100-async-sums.md), and those keep the kernel they had.
template <bool VK, int K, int TS>
constexpr bool kStreamSendsBuild = VK && K == 128 && TS == kStreamTokens;
template <bool VK, int K, int TS>
bool stream_sends_launch(const GdnDecodeParams& p, unsigned groups) {
  return kStreamSendsBuild<VK, K, TS> && p.gate_activation > 0 && groups > 1 && !p.g_per_channel && p.idx_columns > 0 &&
         p.idx_columns <= TS;
}

template <bool VK, int K, typename ST>
bool short_chunk_launch(const GdnDecodeParams& p) {
  constexpr int block_rows = kStreamShortRows * kStreamShortWarps;
  if (p.g_per_channel || p.V % block_rows != 0 || p.V > kStreamMaxV<K>) return false;
  const int64_t groups = p.V / block_rows;
  if (groups > kMtpMaxClusterGroups || (groups > 1 && p.gate_activation > 0 && !p.clusters)) return false;
  return p.N * p.HV * groups <= rule_sms(p);
}

template <bool VK, int K, typename ST>
int launch_mtp_stream_short(const GdnDecodeParams& p, cudaStream_t stream) {
  constexpr int R = kStreamShortRows, W = kStreamShortWarps;
  constexpr auto generic = decode_mtp_stream_kernel<VK, K, ST, false, false, kStreamTokens, R>;
  constexpr auto fixed = decode_mtp_stream_kernel<VK, K, ST, false, false, kStreamTokens, R, true>;
  const unsigned groups = static_cast<unsigned>(p.V / (R * W));
  const int chunk_bytes = kStreamChunkRaws<VK, K, ST, R> * 32 * 16;
  const size_t ring = size_t(W) * stream_ring_depth(W, W, chunk_bytes) * chunk_bytes;
  const dim3 grid = request_head_grid(p, groups), block(W * 32), cluster(1, 1, p.gate_activation > 0 ? groups : 1u);
  if (stream_sends_launch<VK, K, kStreamTokens>(p, groups)) {
    constexpr auto generic_sends = decode_mtp_stream_kernel<VK, K, ST, false, false, kStreamTokens, R, false, true>;
    constexpr auto fixed_sends = decode_mtp_stream_kernel<VK, K, ST, false, false, kStreamTokens, R, true, true>;
    return launch_profile_or_generic<generic_sends, fixed_sends>(p, grid, block, stream, ring, cluster);
  }
  return launch_profile_or_generic<generic, fixed>(p, grid, block, stream, ring, cluster);
}

template <bool VK, int K, typename ST, int TS = kStreamTokens>
int launch_mtp_stream(const GdnDecodeParams& p, cudaStream_t stream) {
  if constexpr (VK && K == 128 && TS == kStreamTokens) {
    if (short_chunk_launch<VK, K, ST>(p)) return launch_mtp_stream_short<VK, K, ST>(p, stream);
  }
  auto kernel = p.g_per_channel ? decode_mtp_stream_kernel<VK, K, ST, true, false, TS> : decode_mtp_stream_kernel<VK, K, ST, false, false, TS>;
  const int64_t sms = rule_sms(p);
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
  // A warp a chunk (at most 16: the launch bound; fp32 requests of at most two tokens, 8) while the
  // grid's warps number at most 16 an SM; past that, 8 or 4 warps a block (stream_block_warps).
  const int64_t grid_warps = p.N * p.HV * head_chunks;
  const int widest = std::is_same_v<ST, float> && p.L <= 2 * p.N ? kMtpShortWideWarps : 16;
  const int wide = chunks < widest ? chunks : widest;
  auto ring_bytes = [&](int w) { return size_t(w) * stream_ring_depth(chunks, w, chunk_bytes) * chunk_bytes; };
  auto resident = [&](int w) {
    if (allow_dynamic_smem<decode_mtp_stream_kernel<VK, K, ST, false, false, TS>>(p.device, ring_bytes(w)) != 0 ||
        allow_dynamic_smem<decode_mtp_stream_kernel<VK, K, ST, true, false, TS>>(p.device, ring_bytes(w)) != 0) {
      (void)cudaGetLastError();
      return 0;
    }
    return p.g_per_channel ? resident_blocks_of<decode_mtp_stream_kernel<VK, K, ST, true, false, TS>>(p.device, w * 32, ring_bytes(w))
                           : resident_blocks_of<decode_mtp_stream_kernel<VK, K, ST, false, false, TS>>(p.device, w * 32, ring_bytes(w));
  };
  int warps = wide;
  if (grid_warps > 16 * sms) {
    const int w8 = wide < 8 ? wide : 8, w4 = wide < 4 ? wide : 4;
    warps = w8 == w4 ? w4
                     : stream_block_warps(p.N * p.HV * groups, chunks, sms, p.L > 4 * p.N, w8, resident(w8), w4, resident(w4));
  }
  const size_t ring = ring_bytes(warps);
  const dim3 grid = request_head_grid(p, static_cast<unsigned>(groups)), block(static_cast<unsigned>(warps) * 32);
  const dim3 cluster(1, 1, epilogue ? static_cast<unsigned>(groups) : 1u);
  if constexpr (kStreamStageFirstBuild<VK, K, ST> && TS == kStreamTokens) {
    if (!p.g_per_channel && groups == 1 && grid_warps <= kStreamStageFirstSmWarps * sms) {
      constexpr auto generic = decode_mtp_stream_kernel<VK, K, ST, false, true>;
      constexpr auto fixed = decode_mtp_stream_kernel<VK, K, ST, false, true, kStreamTokens, kStreamRows, true>;
      return launch_profile_or_generic<generic, fixed>(p, grid, block, stream, ring, cluster);
    }
  }
  if constexpr (kStreamSendsBuild<VK, K, TS>) {
    if (stream_sends_launch<VK, K, TS>(p, static_cast<unsigned>(groups))) {
      constexpr auto sends = decode_mtp_stream_kernel<VK, K, ST, false, false, TS, kStreamRows, false, true>;
      if (const int err = allow_dynamic_smem<sends>(p.device, ring)) return err;
      return launch_decode(sends, grid, block, p, stream, ring, cluster);
    }
  }
  if (const int err = allow_dynamic_smem<decode_mtp_stream_kernel<VK, K, ST, false, false, TS>>(p.device, ring)) return err;
  if (const int err = allow_dynamic_smem<decode_mtp_stream_kernel<VK, K, ST, true, false, TS>>(p.device, ring)) return err;
  return launch_decode(kernel, grid, block, p, stream, ring, cluster);
}

}  // namespace
}  // namespace cudelta
