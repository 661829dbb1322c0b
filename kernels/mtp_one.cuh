// The one-token kernels of the multi-token contract (layout vk, K = 128: vLLM's call at T = 1) and
// the separate gated RMSNorm epilogue, with the rule that picks among their builds.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "mtp_common.cuh"
#include "warp_vk.cuh"

namespace cudelta {
namespace {

// The one-token kernel's largest V (its outputs wait in shared memory for the epilogue).
constexpr int kMaxOneRows = 128;

// The one-token kernels of layout vk: at most one token a request (idx [N] with one token a
// request, or idx [N, 1]: one column bounds a request's tokens to one, request_span skips longer
// ones), the epilogue or not. Both run the warp kernel's step (warp_vk.cuh, warp_step: the state kept
// as loaded, never widened into registers of fp32 between tokens) on the slots the multi-token
// contract names (request_span); they differ in where the epilogue's mean over V is taken. The
// state goes back to the slot it came from: with one column, request_span accepts only
// num_accepted_tokens 1, so the start slot is idx[n, 0], the one the token's state is stored at
// (no second load of it, no second validity check).
//
// decode_vk_one_kernel: a block of V / (BW * TPW) warps a (request, value head), each TPW tiles of
// BW rows. The warps keep their outputs in shared memory and meet once, after their state stores are
// issued; the barrier waits on the block's slowest warp, not on memory traffic. One launch: the
// latency regime's choice, and with a bf16 state and the epilogue every batch's from half a pair an
// SM (launch_vk_one).
// The blocks an SM decode_vk_one_kernel's launch bound asks ptxas for: none (0: the bound's thread
// count alone) but for the bf16 build of 16 warps (BW = 8) on sm_100 and later, where ptxas kept it
// at 64 registers and spilled 4 bytes a thread without it, and for the bf16 build of two 16-row
// tiles (BW = 16, TPW = 2) on sm_80, where it kept one of them at 128 and spilled 4 bytes (3 blocks of
// 4 warps: up to 168 registers); sm_90a does not spill, and its cubins are the same with or without
// them.
template <typename ST, int BW, int TPW = 1>
__host__ __device__ constexpr int one_kernel_min_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
  return !std::is_same_v<ST, float> && BW == 8 ? 1 : 0;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return !std::is_same_v<ST, float> && BW == 16 && TPW == 2 ? 3 : 0;
#else
  return 0;
#endif
}

// The launch bound of decode_vk_one_kernel: 512 threads for the warps of one tile (BW rows), the
// bound their builds were measured with; the warps of TPW tiles at their block's own size (sm_90a,
// no spill: fp32, two 8-row tiles, 8 warps, 119-128 registers; bf16, two 16-row tiles, 4 warps, up
// to 148).
template <int BW, int TPW>
__host__ __device__ constexpr int one_kernel_threads() {
  return TPW == 1 ? 512 : 32 * kMaxOneRows / (BW * TPW);
}

// The outputs of the block kernels (blockDim >= V: thread v owns output v): the epilogue's z and w
// of this thread's output, loaded before the step (one_block_inputs), then, after the step has left
// the outputs in shared memory, each warp's sum of squares, one barrier, and the outputs, normed
// when the epilogue is on (one_block_store).
struct OneBlockOutput {
  bool epilogue, mine;
  uint32_t z_bits, w_bits;
};

__device__ __forceinline__ OneBlockOutput one_block_inputs(const GdnDecodeParams& p, int V, int64_t bos, int64_t hv) {
  const bool epilogue = p.gate_activation > 0, mine = threadIdx.x < V;
  const uint32_t z_bits = epilogue && mine ? load_bits(p.z, p.z_dtype, bos * p.z_stride_n + hv * p.z_stride_h + threadIdx.x) : 0u;
  const uint32_t w_bits = epilogue && mine ? load_bits(p.norm_weight, p.norm_weight_dtype, threadIdx.x) : 0u;
  return {epilogue, mine, z_bits, w_bits};
}

__device__ __forceinline__ void one_block_store(const GdnDecodeParams& p, const OneBlockOutput& out, int warp, int warps,
                                                int64_t bos, int64_t hv, const float* s_o, float* s_sumsq, float sumsq) {
  if (threadIdx.x % 32 == 0) s_sumsq[warp] = sumsq;
  __syncthreads();
  if (!out.mine) return;
  float o = s_o[threadIdx.x];
  if (out.epilogue) {
    float total = 0.f;
    for (int i = 0; i < warps; ++i) total += s_sumsq[i];
    o = gated_rms_norm(p, o, total, widen_bits(out.w_bits, p.norm_weight_dtype), widen_bits(out.z_bits, p.z_dtype));
  }
  store_out(p, bos * p.out_stride_n + hv * p.out_stride_h + threadIdx.x, o);
}

template <int K, typename ST, int BW, bool PER_CHANNEL, bool STREAM, int TPW>
__device__ __forceinline__ void one_block_step(const GdnDecodeParams& p, float* s_o, float* s_sumsq) {
  pdl_wait_early(p);  // and pdl_wait_late in warp_step
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t n = block_request(p), hv = block_head(p);
  const int V = static_cast<int>(p.V);
  int64_t bos, len, start;
  if (!head_request_span(p, n, hv, bos, len, start)) return;
  const OneBlockOutput out = one_block_inputs(p, V, bos, hv);
  TileEpilogue epi{s_o, 0.f};
  warp_step<K, ST, BW, PER_CHANNEL, TPW, STREAM, true, false>(p, warp, hv, qk_head(p, static_cast<uint32_t>(hv)), bos, start,
                                                            start, &epi);
  one_block_store(p, out, warp, warps, bos, hv, s_o, s_sumsq, epi.sumsq);
}

// VP: the build of vLLM's call (vllm_profile, GDN only): its dtypes, index widths and V = 128 as
// constants, as the few-token kernel's (from sm_100 the generic body, as there).
template <int K, typename ST, int BW, bool PER_CHANNEL, bool STREAM, int TPW = 1, bool VP = false>
__global__ void __launch_bounds__((one_kernel_threads<BW, TPW>()), (one_kernel_min_blocks<ST, BW, TPW>()))
    decode_vk_one_kernel(const GdnDecodeParams p) {
  static_assert(BW * TPW >= kMaxOneRows / 16, "at most 16 warps a head");
  static_assert(!VP || !PER_CHANNEL, "vLLM's profile is GDN's call");
  __shared__ float s_o[kMaxOneRows];
  __shared__ float s_sumsq[16];
  if constexpr (VP && kProfileBodies) {
    one_block_step<K, ST, BW, PER_CHANNEL, STREAM, TPW>(vllm_profile_params<K, true>(p), s_o, s_sumsq);
  } else {
    one_block_step<K, ST, BW, PER_CHANNEL, STREAM, TPW>(p, s_o, s_sumsq);
  }
}

// decode_vk_one_staged_kernel: decode_vk_one_kernel's build of 8 warps of two 8-row tiles, the
// second tile of each warp copied to shared memory (cp.async, issued first) and read from there
// where it is used: registers for one tile a thread, so MIN_BLOCKS blocks (pairs) an SM are resident
// instead of 2 (3 or 4: staged_min_blocks). With two, a grid past 2 pairs an SM ran a second wave
// (H200, KDA fp32, 12 heads: 264 pairs 12.1 µs, 276 pairs 14.9; vLLM's fused op holds 4:
// benchmarks/ncu_kda.py).
template <int K, typename ST, bool PER_CHANNEL, bool STREAM, int MIN_BLOCKS>
__global__ void __launch_bounds__(32 * kMaxOneRows / 16, MIN_BLOCKS) decode_vk_one_staged_kernel(const GdnDecodeParams p) {
  constexpr int BW = 8;
  using Raw = typename Chunk<ST>::Raw;
  using Sh = WarpShape<K, ST, BW>;
  __shared__ float s_o[kMaxOneRows];
  __shared__ float s_sumsq[16];
  __shared__ Raw s_tile[kMaxOneRows / (2 * BW)][BW * Sh::KC];
  pdl_wait_early(p);  // and pdl_wait_late in warp_step
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int64_t n = block_request(p), hv = block_head(p);
  const int V = static_cast<int>(p.V);
  int64_t bos, len, start;
  if (!head_request_span(p, n, hv, bos, len, start)) return;
  {
    // The lane copies the chunks warp_step reads back in it, so it waits for its own copies alone.
    const Raw* S = reinterpret_cast<const Raw*>(static_cast<const ST*>(p.state) + start * p.state_stride_p +
                                                (hv * p.V + int64_t(2 * warp + 1) * BW) * K);
    const int l = lane % Sh::LPR, r = lane / Sh::LPR;
#pragma unroll
    for (int j = 0; j < Sh::NP; ++j) {
#pragma unroll
      for (int i = 0; i < Sh::CPL; ++i) {
        const int at = (r + Sh::RPP * j) * Sh::KC + i * Sh::LPR + l;
        cp_async16(&s_tile[warp][at], S + at);
      }
    }
    cp_async_commit();
  }
  const OneBlockOutput out = one_block_inputs(p, V, bos, hv);
  TileEpilogue epi{s_o, 0.f};
  warp_step<K, ST, BW, PER_CHANNEL, 2, STREAM, true, false, true>(p, warp, hv, qk_head(p, static_cast<uint32_t>(hv)), bos,
                                                                  start, start, &epi, s_tile[warp]);
  one_block_store(p, out, warp, warps, bos, hv, s_o, s_sumsq, epi.sumsq);
}

// The blocks an SM decode_vk_one_warp_kernel's launch bound asks for: the warp kernel's count
// (warp_min_blocks, one-warp blocks) shared among blocks of WPB warps.
template <int K, typename ST, int BW, int TPW, int WPB>
constexpr int one_warp_min_blocks() {
  return warp_min_blocks<K, ST, BW, TPW>() / WPB > 0 ? warp_min_blocks<K, ST, BW, TPW>() / WPB : 1;
}

// decode_vk_one_warp_kernel, larger grids: the warp kernel's grid of one-warp blocks (no barrier, so
// an SM's warps never wait on each other), its outputs stored rounded; the epilogue follows as
// gated_rms_norm_kernel, which reads them back (a few MB beside the state's hundreds).
// CLUSTER_EPI: the epilogue in the same launch instead: a head's V / (BW * TPW * WPB) blocks (at
// most 8, the portable size) of WPB warps are a thread block cluster, and each warp sends the sum of
// its rows' squares to every block of it through distributed shared memory, so that each block takes
// the mean over V itself (sm_90+ images). WPB > 1 gives the cluster more warps than blocks. It
// saves the second launch, which dominates small grids (H100, T=1, B=1, 16/32 heads: bf16
// 6.3 -> 5.4 µs with the evict-first state (6.0 without), fp32 7.2 -> 6.4); in large ones the
// clusters of one-warp blocks cost far more than it (bf16 B=512: 388 -> 580 µs; B=4 already
// 6.7 -> 9.9 against the block kernel), so launch_vk_one takes it only below half a (request, head)
// pair an SM.
template <int K, typename ST, int BW, bool PER_CHANNEL, int TPW, bool STREAM, bool CLUSTER_EPI, int WPB>
__device__ __forceinline__ void one_warp_step(const GdnDecodeParams& p) {
  constexpr int ROWS = BW * TPW;
  __shared__ float s_o[CLUSTER_EPI ? kMaxOneRows : 1];
  __shared__ float s_ss[CLUSTER_EPI ? kMaxOneRows / ROWS : 1];
  __shared__ uint64_t s_sent;
  pdl_wait_early(p);  // and pdl_wait_late in warp_step
  const int64_t n = blockIdx.z, hv = blockIdx.y;
  // The warp's tile group: WPB warps a block, blocks along x.
  const uint32_t g = blockIdx.x * WPB + threadIdx.x / 32;
  const int64_t row0 = int64_t(g) * ROWS;
  auto zero_rows = [&](int64_t first, int64_t end) {
    for (int64_t tok = first; tok < end; ++tok) {
      for (int r = threadIdx.x % 32; r < ROWS; r += 32) store_out_zero(p, tok * p.out_stride_n + hv * p.out_stride_h + row0 + r);
    }
  };
  int64_t bos, len, start;
  // A cluster's blocks share the request, so they all return here or none does.
  if (!request_span(p, n, zero_rows, bos, len, start)) return;
  const int64_t h = qk_head(p, static_cast<uint32_t>(hv));
  if constexpr (!CLUSTER_EPI) {
    warp_step<K, ST, BW, PER_CHANNEL, TPW, STREAM>(p, g, hv, h, bos, start, start);
  } else {
    // Distributed shared memory is written only once every block of the cluster runs, its barrier
    // for the sums initialised: this arrival is waited for after the step.
    const unsigned blocks = gridDim.x;
    if (threadIdx.x == 0) expect_sends(&s_sent, blocks * WPB * sizeof(float));
    cluster_arrive_relaxed();
    const int lane = static_cast<int>(threadIdx.x % 32);
    const bool mine = lane < ROWS;
    const uint32_t z_bits = mine ? load_bits(p.z, p.z_dtype, bos * p.z_stride_n + hv * p.z_stride_h + row0 + lane) : 0u;
    const uint32_t w_bits = mine ? load_bits(p.norm_weight, p.norm_weight_dtype, row0 + lane) : 0u;
    TileEpilogue epi{s_o, 0.f};
    warp_step<K, ST, BW, PER_CHANNEL, TPW, STREAM, true, false>(p, g, hv, h, bos, start, start, &epi);
    cluster_wait();
    // Warp g's sum goes to slot g of every block; each adds them in slot order (outputs do not
    // depend on which warp finished first).
    if (static_cast<unsigned>(lane) < blocks) send_cluster(&s_ss[g], static_cast<unsigned>(lane), epi.sumsq, &s_sent);
    wait_sends(&s_sent);
    if (!mine) return;
    float total = 0.f;
    for (unsigned i = 0; i < blocks * WPB; ++i) total += s_ss[i];
    const float o = gated_rms_norm(p, s_o[row0 + lane], total, widen_bits(w_bits, p.norm_weight_dtype),
                                   widen_bits(z_bits, p.z_dtype));
    store_out(p, bos * p.out_stride_n + hv * p.out_stride_h + row0 + lane, o);
  }
}

// VP: the build of vLLM's call (vllm_profile, GDN only), as decode_vk_one_kernel's; only the
// clustered build is launched with it (launch_vk_one_cluster).
template <int K, typename ST, int BW, bool PER_CHANNEL, int TPW, bool STREAM, bool CLUSTER_EPI = false, int WPB = 1,
          bool VP = false>
__global__ void __launch_bounds__(32 * WPB, (one_warp_min_blocks<K, ST, BW, TPW, WPB>()))
    decode_vk_one_warp_kernel(const GdnDecodeParams p) {
  static_assert(WPB == 1 || CLUSTER_EPI, "blocks of several warps only in clusters");
  static_assert(!VP || (CLUSTER_EPI && !PER_CHANNEL), "vLLM's profile is GDN's call, clustered");
  if constexpr (VP && kProfileBodies) {
    one_warp_step<K, ST, BW, PER_CHANNEL, TPW, STREAM, CLUSTER_EPI, WPB>(vllm_profile_params<K, true>(p));
  } else {
    one_warp_step<K, ST, BW, PER_CHANNEL, TPW, STREAM, CLUSTER_EPI, WPB>(p);
  }
}

// The epilogue on outputs already stored (rounded to out's dtype): one warp a (token row, value head),
// every row of the call (rows left zero stay zero). V <= kMaxOneRows: 4 values a lane. z and w are
// loaded before griddepcontrol.wait, so that their round trip overlaps the decode's tail: no kernel of
// this call writes them, and the kernel before the decode has completed before any decode block
// lets this grid start (each waits for it first, pdl_enter). H200, 16/32 heads, T = 1, µs: bf16
// B=64 / 128 / 512 42.2 / 76.3 / 287.1 -> 41.0 / 75.2 / 285.85, fp32 B=128 140.75 -> 139.65; two or
// four rows a warp, their loads together, gained less or lost (benchmarks/results-h200-mtp.md).
__global__ void __launch_bounds__(128) gated_rms_norm_kernel(const GdnDecodeParams p) {
  const int64_t item = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const bool live = item < p.L * p.HV;
  const int lane = threadIdx.x % 32, V = static_cast<int>(p.V);
  const int64_t tok = item / p.HV, hv = item % p.HV;
  const int64_t o_at = tok * p.out_stride_n + hv * p.out_stride_h, z_at = tok * p.z_stride_n + hv * p.z_stride_h;
  constexpr int PER = kMaxOneRows / 32;
  uint32_t o_bits[PER], z_bits[PER], w_bits[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const bool mine = live && lane + 32 * j < V;
    z_bits[j] = mine ? load_bits(p.z, p.z_dtype, z_at + lane + 32 * j) : 0u;
    w_bits[j] = mine ? load_bits(p.norm_weight, p.norm_weight_dtype, lane + 32 * j) : 0u;
  }
  pdl_enter();
  if (!live) return;
#pragma unroll
  for (int j = 0; j < PER; ++j) o_bits[j] = lane + 32 * j < V ? load_bits(p.out, p.dtype, o_at + lane + 32 * j) : 0u;
  float o[PER], ss = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    o[j] = widen_bits(o_bits[j], p.dtype);
    ss += o[j] * o[j];
  }
  ss = warp_sum(ss);
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int v = lane + 32 * j;
    if (v < V) {
      store_f(p.out, p.dtype, o_at + v,  // never with the FP8 output: launch_vk_one takes another kernel
              gated_rms_norm(p, o[j], ss, widen_bits(w_bits[j], p.norm_weight_dtype), widen_bits(z_bits[j], p.z_dtype)));
    }
  }
}

template <int K, typename ST, int BW, bool STREAM, int TPW = 1>
int launch_vk_one_rows(const GdnDecodeParams& p, cudaStream_t stream) {
  const dim3 grid = request_head_grid(p), block(static_cast<unsigned>(p.V / (BW * TPW)) * 32);
  if (p.g_per_channel) return launch_decode(decode_vk_one_kernel<K, ST, BW, true, STREAM, TPW>, grid, block, p, stream);
  // No profile twin for bf16's two-tile build (past eight pairs an SM, bandwidth-bound): ptxas gave
  // it 150 registers against the generic build's 128 (ptxas -v, sm_90a), three blocks an SM, not four;
  // held to 128 by a launch bound of four blocks an SM, it spills (28 bytes a thread).
  if constexpr (TPW > 1 && !std::is_same_v<ST, float>) {
    return launch_decode(decode_vk_one_kernel<K, ST, BW, false, STREAM, TPW>, grid, block, p, stream);
  } else {
    return launch_profile_or_generic<decode_vk_one_kernel<K, ST, BW, false, STREAM, TPW>,
                                     decode_vk_one_kernel<K, ST, BW, false, STREAM, TPW, true>>(p, grid, block, stream);
  }
}

// The staged build's blocks an SM by its decay: GDN's per-head gate leaves the registers for a fourth
// block (64 registers, no spill: H200, fp32 T=1 with the epilogue, 16/32 heads, B=96 / 128 / 512
// 105.6 / 138.9 / 539.7 -> 104.8 / 138.1 / 538.2 µs; 0.4-0.9% at 4/8, 32/32 and 16/64 heads at 31
// pairs an SM and beyond; GDN's conv + step in one call 0.2-0.7%, though the conv's 132 KB split,
// kConvCarveout, holds three), KDA's per-channel gates do not (it spilled 24 bytes and lost 3-15%
// past 2 pairs an SM).
template <bool PER_CHANNEL>
constexpr int staged_min_blocks() {
  return PER_CHANNEL ? 3 : 4;
}

template <int K, typename ST, bool STREAM>
int launch_vk_one_staged(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_vk_one_staged_kernel<K, ST, true, STREAM, staged_min_blocks<true>()>
                                : decode_vk_one_staged_kernel<K, ST, false, STREAM, staged_min_blocks<false>()>;
  return launch_decode(kernel, request_head_grid(p), dim3(static_cast<unsigned>(p.V / 16) * 32), p, stream);
}

// The grid decode_vk_one_warp_kernel reads: a head's V / (BW * TPW * WPB) blocks of WPB warps along
// x, heads along y, requests along z.
template <int BW, int TPW, int WPB = 1>
dim3 one_warp_grid(const GdnDecodeParams& p) {
  return dim3(static_cast<unsigned>(p.V / (BW * TPW * WPB)), static_cast<unsigned>(p.HV), request_blocks(p));
}

template <int K, typename ST, int BW, int TPW, bool STREAM>
int launch_vk_one_split(const GdnDecodeParams& p, cudaStream_t stream) {
  if (p.gate_activation > 0 && p.out_scale != nullptr) return cudaErrorInvalidValue;  // launch_vk_one's rule
  auto kernel = p.g_per_channel ? decode_vk_one_warp_kernel<K, ST, BW, true, TPW, STREAM>
                                : decode_vk_one_warp_kernel<K, ST, BW, false, TPW, STREAM>;
  int err = launch_decode(kernel, one_warp_grid<BW, TPW>(p), dim3(32), p, stream);
  if (err != 0 || p.gate_activation <= 0) return err;
  return launch_decode(gated_rms_norm_kernel, dim3(static_cast<unsigned>((p.L * p.HV + 3) / 4)), dim3(128), p, stream);
}

// The one-warp grid with the epilogue in clusters of a head's blocks (CLUSTER_EPI): sm_90+ images,
// at most 8 blocks a head (V / (BW * TPW * WPB)).
template <int K, typename ST, int BW, int TPW, bool STREAM, int WPB = 1>
int launch_vk_one_cluster(const GdnDecodeParams& p, cudaStream_t stream) {
  const dim3 grid = one_warp_grid<BW, TPW, WPB>(p), block(32 * WPB), cluster(grid.x, 1, 1);
  if (p.g_per_channel)
    return launch_decode(decode_vk_one_warp_kernel<K, ST, BW, true, TPW, STREAM, true, WPB>, grid, block, p, stream, 0, cluster);
  return launch_profile_or_generic<decode_vk_one_warp_kernel<K, ST, BW, false, TPW, STREAM, true, WPB>,
                                   decode_vk_one_warp_kernel<K, ST, BW, false, TPW, STREAM, true, WPB, true>>(
      p, grid, block, stream, 0, cluster);
}

// Whether the one-warp grid of BW * TPW rows a warp, WPB warps a block, can take the epilogue in
// clusters (at most 8 blocks a head, whole blocks).
template <int BW, int TPW, int WPB = 1>
bool one_cluster_fits(const GdnDecodeParams& p) {
  return p.gate_activation > 0 && p.clusters && p.V % (BW * TPW * WPB) == 0 && p.V / (BW * TPW * WPB) <= 8;
}

// Whether a call takes a one-token kernel: at most one token a request, layout vk, K = 128 (the head
// dim the warp kernel's extra builds are for), V whole tiles of 16 rows, at most kMaxOneRows.
inline bool one_token_call(const GdnDecodeParams& p) {
  const bool one = p.idx_columns == 1 || (p.idx_columns == 0 && p.cu_seqlens == nullptr && p.tokens == 1);
  return one && p.state_vk && p.K == 128 && p.V % 16 == 0 && p.V <= kMaxOneRows;
}

// Which one-token kernel and build, by (request, head) pairs an SM (numbers: µs, 16/32 heads unless
// said; benchmarks/results-h200-mtp.md and results-h100-mtp.md):
// - Below half a pair an SM with the epilogue, on sm_90+ images: the one-warp grid with the
//   epilogue in clusters (decode_vk_one_warp_kernel, CLUSTER_EPI): bf16 8 one-warp blocks of 16 rows
//   a head, fp32 8 blocks of two 8-row warps (H200, against one-warp blocks of two 8-row tiles: B=1
//   5.7 -> 5.45, B=2 level).
// - bf16 from there to eight pairs an SM: the block kernel (fewer leave SMs idle: a block a pair),
//   8 warps of 16 rows up to two pairs an SM, 16 warps of 8 rows beyond (H100, the compat call: B=16
//   / 32 16.5 / 28.6 -> 16.0 / 28.1; B=4 6.7 -> 7.0, B=8 even; on an H200 at an older commit 16 warps
//   had lost at B=16-32, 14.3 / 26.2 -> 15.4 / 27.1; sm_100 and later build it with
//   one_kernel_min_blocks). With the epilogue, past eight pairs an SM too: 4 warps of two 16-row
//   tiles, the evict-first state up to 32 pairs an SM (H200, against the one-warp grid and the
//   separate epilogue: B=64 / 128 / 256 / 512 41.2 / 75.5 / 144.2 / 286.65 -> 40.1 / 74.45 / 142.65
//   / 278.8; the evict-first state to 64 pairs an SM lost 0.5% at B=256). GDN (per-head gates)
//   takes that build from two and a half pairs an SM to four as well, where its four blocks an SM
//   (128 registers, 4 warps) hold the grid in one wave and the 16 warps of 8 rows (64 registers,
//   two blocks an SM) need two (H100, 16/32 / 4/8 / 16/64 / 32/32 heads at 512 pairs 0.94-0.98x
//   the time, 384 pairs 0.98x; it lost 1.1% at 288, 2-6% at 768 and 1,024; not A/B'd on an H200:
//   benchmarks/results-h100-one-token-band.md).
// - fp32 with the epilogue: the block kernel too, 16 warps of 8 rows up to a pair an SM and 8 warps
//   of two 8-row tiles (the warp kernel's build there) up to sixteen, where the separate epilogue's
//   second launch cost more than the barrier (H200, HV=32: B=4..16 0.92-0.95x -> 1.02-1.10x vLLM's
//   op at an older commit; two 8-row tiles against one 16-row tile, B=8 / 16 / 32 / 64 12.2 / 21.65 /
//   38.65 / 72.05 -> 11.65 / 21.25 / 38.25 / 71.7). For KDA from two pairs an SM to eight, its
//   staged build (decode_vk_one_staged_kernel, three blocks an SM): Kimi K3's drop-in, 12 heads,
//   step + norm 264 -> 276 pairs 12.1 -> 14.9 µs before, 13.0 -> 13.9 with it; 384 pairs 17.8 ->
//   16.8, 768 30.8 -> 30.2, 1,536 56.5 -> 56.7; 192 pairs 10.1 -> 10.4 (results-h200-kda.md).
// - fp32 with the epilogue past that, the staged build with plain state loads: KDA past eight pairs
//   an SM, GDN past sixteen, instead of the block kernel and the one-warp grid with the separate
//   epilogue (H200, the drop-in, 12/24/48/96 heads: 1,536 pairs 61.5 / 60.3 -> 60.3 / 59.4 µs, 3,072
//   115.5 / 114.3 -> 113.0 / 111.7, 6,144 224.4 / 220.9 -> 221.1 / 217.7, 49,152 1700.5 -> 1682.4;
//   GDN 16/32 B=128 / 256 / 512 140.8 / 274.1 / 544.2 -> 139.2 / 272.7 / 539.7, but B=8-64 0.3-0.8
//   µs slower). Its evict-first build lost there (1,536-6,144 pairs +0.8-2.6%), the plain one lost
//   at two to eight pairs an SM (384 pairs +0.4-0.6 µs, 768 +0.8-1.6). GDN's holds four blocks an
//   SM (staged_min_blocks); at four, its plain or evict-first build from one pair an SM to sixteen
//   was level with the block kernel or lost (B=16-64 up to +1.1%).
// - Elsewhere the warp kernel's builds, and the separate epilogue (gated_rms_norm_kernel): every call
//   without the epilogue, and with it below half a pair an SM on images without clusters (sm_80),
//   but for the FP8 output, which takes the block kernel there (not timed).
// Tried on the H200 and not kept: bf16 in two-warp cluster blocks (B=1-2 level to +1.6%) or in block
// kernels of two-tile warps to eight pairs an SM (B=16 +3.5%); fp32 in clusters of 4-warp blocks of
// 4 rows a warp (the decode alone's tile; B=1 worse than two warps of 8), in 32-warp block kernels at
// a pair an SM (B=4 +9%, +15% without the evict-first state); clusters up to a pair an SM (B=4 fp32
// +32%, bf16 +52%). Again on an H100 with the sums by st.async, clusters to two or eight pairs an SM:
// 16/32 B=4 / 8 bf16 6.5 / 9.1 -> 8.6 / 12.7 µs, fp32 9.0 / 13.9 -> 10.3 / 16.0, B=1-2 level
// (benchmarks/results-h100-one-token-clusters.md). Against the cost of slots scattered over the
// pool at two blocks an SM (H100, bf16, 4/8 heads B=32, vLLM's call: 9.26 µs, 8.46 on consecutive
// slots), the block kernel launched in clusters of a request's heads (9.85; level at B=24, where
// they fit one wave), two heads of a request a block (level on random slots, 8.81 against 8.50 on
// consecutive ones), 16 warps of 8 rows (9.41), 4 warps of two tiles (9.53), plain state loads
// (9.88), state stores plain (9.62) or st.global.wt (9.66). What it pays for is the previous call's
// write-back of its scattered slots, which the store hints did not move: under ncu, a launch at a
// time, 9.68 µs random / 8.99 consecutive with the previous call's lines in L2, 9.55 / 9.46 with
// the caches flushed (benchmarks/results-h100-t1-scatter.md, section 4).
template <typename ST>
int launch_vk_one(const GdnDecodeParams& p, cudaStream_t stream) {
  const int64_t pairs = p.N * p.HV, sms = rule_sms(p);
  const bool epilogue = p.gate_activation > 0;
  // The separate epilogue (launch_vk_one_split with it, images without clusters) reads the outputs
  // back from out in v's dtype: with the FP8 output (out_scale) those calls take the block kernel.
  // The one-warp grid holds requests on z: a call with more than it holds takes the block kernel,
  // whose grid holds them on x (launch_gdn_decode does not split multi-token calls).
  if (request_blocks(p) > kMaxGridYZ) return launch_vk_one_rows<128, ST, 16, true>(p, stream);
  if constexpr (std::is_same_v<ST, float>) {
    if (pairs < sms / 2 && one_cluster_fits<8, 1, 2>(p)) return launch_vk_one_cluster<128, ST, 8, 1, true, 2>(p, stream);
    if (epilogue && pairs >= sms / 2 && pairs <= sms) return launch_vk_one_rows<128, ST, 8, true>(p, stream);
    if (epilogue && p.g_per_channel && pairs > 2 * sms && pairs <= 8 * sms)
      return launch_vk_one_staged<128, ST, true>(p, stream);
    if (epilogue && p.g_per_channel && pairs > 8 * sms) return launch_vk_one_staged<128, ST, false>(p, stream);
    if (epilogue && pairs > sms && pairs <= 16 * sms) return launch_vk_one_rows<128, ST, 8, true, 2>(p, stream);
    if (epilogue && !p.g_per_channel && pairs > 16 * sms) return launch_vk_one_staged<128, ST, false>(p, stream);
    if (epilogue && p.out_scale != nullptr && pairs <= sms) return launch_vk_one_rows<128, ST, 8, true>(p, stream);
    if (pairs <= sms) return launch_vk_one_split<128, ST, 4, 1, false>(p, stream);
    if (pairs <= 16 * sms) return launch_vk_one_split<128, ST, 8, 2, true>(p, stream);
    return launch_vk_one_split<128, ST, 8, 1, false>(p, stream);
  } else {
    if (pairs <= sms / 2 && one_cluster_fits<16, 1>(p)) return launch_vk_one_cluster<128, ST, 16, 1, true>(p, stream);
    if (pairs <= sms / 2 && !(epilogue && p.out_scale != nullptr)) return launch_vk_one_split<128, ST, 8, 1, false>(p, stream);
    if (pairs <= 2 * sms) return launch_vk_one_rows<128, ST, 16, true>(p, stream);
    if (epilogue && !p.g_per_channel && 2 * pairs > 5 * sms && pairs <= 4 * sms)
      return launch_vk_one_rows<128, ST, 16, true, 2>(p, stream);
    if (pairs <= 8 * sms) return launch_vk_one_rows<128, ST, 8, true>(p, stream);
    if (epilogue && pairs <= 32 * sms) return launch_vk_one_rows<128, ST, 16, true, 2>(p, stream);
    if (epilogue) return launch_vk_one_rows<128, ST, 16, false, 2>(p, stream);
    if (pairs <= 64 * sms) return launch_vk_one_split<128, ST, 16, 1, true>(p, stream);
    return launch_vk_one_split<128, ST, 16, 1, false>(p, stream);
  }
}

}  // namespace
}  // namespace cudelta
