// Gated DeltaNet / Kimi Delta Attention decode step over a pool of recurrent states, updated in
// place. The two differ only in the decay: one per head (GDN) or one per key channel (KDA).
//
// One block of 128 threads owns one (request n, value head hv) pair and a 32-wide tile of its
// value columns. The step is bandwidth bound (one read and one write of the state), so every
// option that costs no bytes is a run-time value (q/k/v dtype, raw or precomputed gates, the
// invalid-slot rule, strides) and only what shapes the state access is a template: the layout,
// the state dtype, K, the way the tile reaches the SM, and the per-channel decay.
//
//   layout "kv" [K, V]: thread t holds 4 columns 4*(t%8)..+3 of rows t/8 + 16 j, so a warp's
//                       vector accesses cover whole 32-column row segments; the reduction over k
//                       crosses warps (shuffles, then shared memory).
//   layout "vk" [V, K]: the tile is 32 contiguous rows of K; a row belongs to 32 lanes (16 for
//                       K=64), each holding K/32 consecutive k, so the reduction over k is a
//                       shuffle within the warp and nothing else.
//
// How the tile reaches the SM (variants; each issues it before the q/k prologue so the two overlap):
//   generic  vector loads straight into registers (any arch)
//   sm90     the same device code, launched as thread-block clusters of one head's column tiles,
//            co-scheduled on one GPC
//   sm80     cp.async into shared memory in two commit groups, so the first half is reduced
//            while the second is in flight
//   sm90tma  clusters, and cp.async.bulk (the TMA engine) row copies completing on two mbarriers
//   warp     its own kernels, one warp per tile held in registers, no block sync
//            (decode_vk_warp_kernel, decode_kv_warp_kernel below; kv with K = 256 runs generic)
// Which one auto picks is decided by measurement (auto_variant in probe.cu).
//
// Both reductions of the step (pred = h'^T k and h'^T q) are done in one pass over the decayed
// state h': with u = beta * (v - pred), the output of the updated state is
// o = (h' + k u^T)^T q = h'^T q + u * (k . q), so the updated state never has to be re-read.
// The state stays in registers in its storage type (bf16 halves the registers) and is widened to
// fp32 where it is used.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "launch.h"

namespace cudelta {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Value columns (kv) or rows (vk) per block. 16 (more, smaller blocks) measured 1.4-1.7x slower
// at B <= 8.
constexpr int kTileV = 32;
// Each K <= 128 kernel is built twice: with the registers it wants, and squeezed to eight resident
// blocks per SM (<= 64 registers). At 72 registers seven fit, and a batch of 8 requests x 32 heads
// (1024 blocks) spilled into a second, nearly empty wave (ncu: 1.11 waves): squeezed it ran 13.8 us
// instead of 15.4, while large batches lose 3% to the spills. The launch takes the squeezed build
// only when that saves a wave of a launch of at most two. K = 256 holds 64 state values per thread:
// squeezing it would spill the state itself, so it has one build.
constexpr int kSqueezedBlocksPerSm = 8;

enum class Load { kRegisters, kCpAsync, kBulk };
constexpr Load load_of(Variant v) {
  return v == Variant::kSm80 ? Load::kCpAsync : v == Variant::kSm90Tma ? Load::kBulk : Load::kRegisters;
}

// --- run-time dtypes: a uniform branch on the dtype, cheaper than another set of kernels -------
__device__ __forceinline__ void store_f(void* p, DType t, int64_t i, float x) {
  switch (t) {
    case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}

// --- loads apart from their widening (the warp kernels) -----------------------------------------
// A load inside a run-time dtype switch gets its first use (the widening to float) inside the same
// case, so the warp waits for it there, before it issues the next load: ncu on the vk warp kernel
// (bf16 state, B=1024) put 70% of the stall samples on the widenings right after the v, q, k and gate
// loads, each a round trip of its own. These load raw bits (the dtype picks a predicated load, no
// use) and widen later, branch-free, so a warp issues every load first and waits once.

// One element's bits: fp32's 32, or a 16-bit dtype's in the low half.
__device__ __forceinline__ uint32_t load_bits(const void* p, DType t, int64_t i) {
  uint32_t b;
  if (t == DType::kFloat32) b = static_cast<const uint32_t*>(p)[i];
  else b = static_cast<const uint16_t*>(p)[i];
  return b;
}
// N elements' bits to float, one dtype branch for all of them. The compiler turns a dtype choice
// into a branch even when written as selects; taken per element, those branches kept it from
// interleaving the elements' math (ncu, KDA's per-channel gates: one channel after the other).
template <int N>
__device__ __forceinline__ void widen_all(const uint32_t* b, DType t, float* x) {
  if (t == DType::kFloat32) {
#pragma unroll
    for (int m = 0; m < N; ++m) x[m] = __uint_as_float(b[m]);
  } else if (t == DType::kBFloat16) {
#pragma unroll
    for (int m = 0; m < N; ++m) x[m] = __uint_as_float(b[m] << 16);
  } else {
#pragma unroll
    for (int m = 0; m < N; ++m) x[m] = __half2float(__ushort_as_half(static_cast<unsigned short>(b[m])));
  }
}
__device__ __forceinline__ float widen_bits(uint32_t b, DType t) {
  float x;
  widen_all<1>(&b, t, &x);
  return x;
}

// Load and widen at once, where nothing else is in flight to wait with (the block kernels).
__device__ __forceinline__ float load_f(const void* p, DType t, int64_t i) { return widen_bits(load_bits(p, t, i), t); }

// E consecutive elements' bits: vector loads where aligned (fp32: one word an element; 16-bit dtypes:
// two), else one load each (one element a word).
template <int E>
struct RunBits {
  uint32_t w[E];
};
template <int E>
__device__ __forceinline__ RunBits<E> load_run_bits(const void* p, DType t, int64_t at, bool aligned) {
  static_assert(E == 4 || E == 8, "runs of 4 or 8");
  RunBits<E> r;
  if (aligned && t == DType::kFloat32) {
    const uint4* v = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(p) + at);
#pragma unroll
    for (int i = 0; i < E / 4; ++i) {
      const uint4 x = v[i];
      r.w[4 * i] = x.x; r.w[4 * i + 1] = x.y; r.w[4 * i + 2] = x.z; r.w[4 * i + 3] = x.w;
    }
  } else if (aligned) {
    if constexpr (E == 8) {
      const uint4 x = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + at);
      r.w[0] = x.x; r.w[1] = x.y; r.w[2] = x.z; r.w[3] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + at);
      r.w[0] = x.x; r.w[1] = x.y;
    }
  } else {
#pragma unroll
    for (int m = 0; m < E; ++m) r.w[m] = load_bits(p, t, at + m);
  }
  return r;
}
template <int E>
__device__ __forceinline__ void widen_run(const RunBits<E>& r, DType t, bool aligned, float* x) {
  if (aligned && t != DType::kFloat32) {
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      const float2 f = t == DType::kBFloat16 ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.w[i]))
                                             : __half22float2(*reinterpret_cast<const __half2*>(&r.w[i]));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int m = 0; m < E; ++m) x[m] = widen_bits(r.w[m], t);
  }
}

// Programmatic dependent launch (sm_90+). Launched with the attribute (GdnDecodeParams::pdl), a
// kernel's blocks may become resident while the previous kernel of the stream still runs:
// griddepcontrol.wait holds them until that kernel has completed and its writes are visible, so
// every kernel here calls this before its first global access. It then lets the next kernel's
// blocks do the same. Without the attribute both instructions are no-ops.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// --- state vectors: 4 consecutive elements, 16 bytes of fp32 or 8 of bf16 ----------------------
template <typename ST>
struct Vec4;
template <>
struct Vec4<float> {
  using Raw = float4;
  static __device__ __forceinline__ float4 widen(float4 r) { return r; }
  static __device__ __forceinline__ float4 narrow(float4 x) { return x; }
};
template <>
struct Vec4<__nv_bfloat16> {
  using Raw = uint2;
  static __device__ __forceinline__ float4 widen(uint2 r) {
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
  static __device__ __forceinline__ uint2 narrow(float4 x) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(x.z, x.w);
    uint2 r;
    r.x = *reinterpret_cast<const uint32_t*>(&lo);
    r.y = *reinterpret_cast<const uint32_t*>(&hi);
    return r;
  }
};

// --- 16-byte state chunks: 4 fp32 or 8 bf16 (the vk kernel's unit) ----------------------------
template <typename ST>
struct Chunk;
template <>
struct Chunk<float> {
  static constexpr int E = 4;
  using Raw = float4;
  static __device__ __forceinline__ void widen(const float4& r, float* x) {
    x[0] = r.x; x[1] = r.y; x[2] = r.z; x[3] = r.w;
  }
  static __device__ __forceinline__ float4 narrow(const float* x) { return make_float4(x[0], x[1], x[2], x[3]); }
};
template <>
struct Chunk<__nv_bfloat16> {
  static constexpr int E = 8;
  using Raw = uint4;
  static __device__ __forceinline__ void widen(const uint4& r, float* x) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  }
  static __device__ __forceinline__ uint4 narrow(const float* x) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- sm_80: cp.async ------------------------------------------------------------------------
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
  } else {  // .cg (L2 only) takes 16 bytes alone
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES)
                 : "memory");
  }
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// --- sm_90: cp.async.bulk + mbarrier ----------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_fence_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(phase)
        : "memory");
  }
#endif
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// softplus with PyTorch's threshold: linear above 20.
// The fast intrinsics (as vLLM's Triton kernel): about 60 instructions fewer per tile than the
// IEEE expf/log1pf/division, within 1e-6 relative of them over the gates' range; where 1 + e^x
// rounds to 1 (x < -17) softplus gives 0 instead of e^x < 4e-8.
// Branch-free, so the gates of several channels interleave: written as `x > 20 ? x : log(1 + e^x)`
// the compiler moves the exponential and the log into a branch of their own per channel (SASS of
// the KDA warp kernels: eight of them in a row). The select is asm so it must have both values.
__device__ __forceinline__ float softplus20(float x) {
  const float soft = __logf(1.f + __expf(fminf(x, 20.f)));
  float y;
  asm("{\n\t.reg .pred big;\n\tsetp.gt.f32 big, %1, 0f41A00000;\n\tselp.f32 %0, %1, %2, big;\n\t}"
      : "=f"(y)
      : "f"(x), "f"(soft));
  return y;
}

// The gates in two phases: the bits of their inputs, then the value. The warp kernels issue the
// loads of every input of the step before they widen any (load_bits); the block kernels take both
// phases at once (load_decay, load_beta below). The decay is exp of the log-decay: the precomputed g,
// or -exp(A_log) * softplus(a + dt_bias) of the raw gate, per head (channel < 0) or per key channel
// (KDA). A_log is one per head (a_log_bits: 0 with precomputed gates).
struct DecayBits {
  uint32_t x, bias;
};
__device__ __forceinline__ DecayBits load_decay_bits(const GdnDecodeParams& p, int64_t n, int64_t hv, int channel) {
  DecayBits b;
  b.x = load_bits(p.g, p.g_dtype, n * p.g_stride_n + hv * p.g_stride_h + (channel >= 0 ? channel : 0));
  b.bias = p.gate_raw ? load_bits(p.dt_bias, p.dt_bias_dtype, channel >= 0 ? hv * p.K + channel : hv) : 0u;
  return b;
}
__device__ __forceinline__ uint32_t load_a_log_bits(const GdnDecodeParams& p, int64_t hv) {
  return p.gate_raw ? load_bits(p.A_log, p.A_log_dtype, hv) : 0u;
}
// The decays of N gates of one head (its key channels, for KDA), straight-line over N.
template <int N>
__device__ __forceinline__ void decays(const GdnDecodeParams& p, const DecayBits* b, uint32_t a_log_bits, float* out) {
  uint32_t xb[N], bb[N];
#pragma unroll
  for (int m = 0; m < N; ++m) {
    xb[m] = b[m].x;
    bb[m] = b[m].bias;
  }
  widen_all<N>(xb, p.g_dtype, out);  // the log-decays
  if (p.gate_raw) {
    float bias[N];
    widen_all<N>(bb, p.dt_bias_dtype, bias);
    const float neg_a = -__expf(widen_bits(a_log_bits, p.A_log_dtype));
#pragma unroll
    for (int m = 0; m < N; ++m) out[m] = neg_a * softplus20(out[m] + bias[m]);
  }
#pragma unroll
  for (int m = 0; m < N; ++m) out[m] = __expf(out[m]);
}
__device__ __forceinline__ float decay_of(const GdnDecodeParams& p, const DecayBits& b, uint32_t a_log_bits) {
  float d;
  decays<1>(p, &b, a_log_bits, &d);
  return d;
}
__device__ __forceinline__ uint32_t load_beta_bits(const GdnDecodeParams& p, int64_t n, int64_t hv) {
  return load_bits(p.beta, p.beta_dtype, n * p.beta_stride_n + hv * p.beta_stride_h);
}
__device__ __forceinline__ float beta_of(const GdnDecodeParams& p, uint32_t bits) {
  const float x = widen_bits(bits, p.beta_dtype);
  return p.beta_raw ? __frcp_rn(1.f + __expf(-x)) : x;
}

__device__ __forceinline__ float load_decay(const GdnDecodeParams& p, int64_t n, int64_t hv, int channel) {
  return decay_of(p, load_decay_bits(p, n, hv, channel), load_a_log_bits(p, hv));
}
__device__ __forceinline__ float load_beta(const GdnDecodeParams& p, int64_t n, int64_t hv) {
  return beta_of(p, load_beta_bits(p, n, hv));
}

// q and k of head h to shared memory as float, with the three dot products the step needs
// (|q|^2, |k|^2, q.k) reduced over the block. Every thread gets the same scales back. Its
// __syncthreads also publishes whatever the block wrote to shared memory before it.
struct QkScales {
  float q;   // multiplies raw q: l2-normalisation and the attention scale
  float k;   // multiplies raw k: l2-normalisation
  float qk;  // (k . q) after scaling, for o = h'^T q + u (k . q)
};

// The scales from |q|^2, |k|^2 and q.k summed over the head's K channels.
__device__ __forceinline__ QkScales qk_scales(const GdnDecodeParams& p, float sqq, float skk, float sqk) {
  QkScales sc;
  sc.k = p.use_qk_l2norm ? rsqrtf(skk + 1e-6f) : 1.f;
  sc.q = (p.use_qk_l2norm ? rsqrtf(sqq + 1e-6f) : 1.f) * p.scale;
  sc.qk = sqk * sc.k * sc.q;
  return sc;
}

// The warp kernels' three sums, added across the lanes that differ in lane bits FIRST .. END / 2.
template <int FIRST, int END>
__device__ __forceinline__ QkScales warp_qk_scales(const GdnDecodeParams& p, float sqq, float skk, float sqk) {
#pragma unroll
  for (int o = FIRST; o < END; o <<= 1) {
    sqq += __shfl_xor_sync(0xffffffffu, sqq, o);
    skk += __shfl_xor_sync(0xffffffffu, skk, o);
    sqk += __shfl_xor_sync(0xffffffffu, sqk, o);
  }
  return qk_scales(p, sqq, skk, sqk);
}

template <int K, int THREADS = kThreads>
__device__ __forceinline__ QkScales load_qk(const GdnDecodeParams& p, int64_t n, int64_t h, float* qs, float* ks,
                                            float (*red3)[3]) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t qo = n * p.q_stride_n + h * p.q_stride_h, ko = n * p.k_stride_n + h * p.k_stride_h;
  float sqq = 0.f, skk = 0.f, sqk = 0.f;
  for (int i = t; i < K; i += THREADS) {
    const float qv = load_f(p.q, p.dtype, qo + i);
    const float kv = load_f(p.k, p.dtype, ko + i);
    qs[i] = qv;
    ks[i] = kv;
    sqq += qv * qv;
    skk += kv * kv;
    sqk += qv * kv;
  }
  sqq = warp_sum(sqq);
  skk = warp_sum(skk);
  sqk = warp_sum(sqk);
  if (lane == 0) {
    red3[warp][0] = sqq;
    red3[warp][1] = skk;
    red3[warp][2] = sqk;
  }
  __syncthreads();
  sqq = skk = sqk = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) {
    sqq += red3[w][0];
    skk += red3[w][1];
    sqk += red3[w][2];
  }
  return qk_scales(p, sqq, skk, sqk);
}

// The q/k head value head hv reads: HV is a multiple of H (grouped value heads), so this is
// hv / (HV / H). 32-bit: it is on the path to the q/k loads, and head counts are small.
__device__ __forceinline__ uint32_t qk_head(const GdnDecodeParams& p, uint32_t hv) {
  return hv * static_cast<uint32_t>(p.H) / static_cast<uint32_t>(p.HV);
}

// Where a block works: request n, value head hv, qk head h, and its tile of V.
struct Site {
  int64_t n, hv, h, tile;
  int64_t slot;
};

__device__ __forceinline__ Site site_of(const GdnDecodeParams& p) {
  // Consecutive blocks take the tiles of one head: their interleaved rows then reach DRAM together
  // instead of a whole grid apart.
  const int64_t tiles = p.V / kTileV;
  const int64_t nh = blockIdx.x / tiles;
  Site s;
  s.tile = blockIdx.x - nh * tiles;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as one cluster per head (sm90, sm90tma), the tile is the block's rank in its cluster;
  // launched without, a block is a cluster of one and this changes nothing.
  uint32_t rank, size;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
  if (size == tiles) s.tile = rank;
#endif
  s.n = nh / p.HV;
  s.hv = nh - s.n * p.HV;
  s.h = qk_head(p, static_cast<uint32_t>(s.hv));
  s.slot = p.idx_is_int64 ? static_cast<const int64_t*>(p.idx)[s.n] : static_cast<const int32_t*>(p.idx)[s.n];
  return s;
}

__device__ __forceinline__ bool slot_valid(const GdnDecodeParams& p, int64_t slot) {
  return slot >= p.min_slot && slot < p.P;
}

__device__ __forceinline__ int64_t out_at(const GdnDecodeParams& p, const Site& s, int64_t col) {
  return s.n * p.out_stride_n + s.hv * p.out_stride_h + col;
}

template <Load LD>
__device__ __forceinline__ void trap_below_arch() {
#if defined(__CUDA_ARCH__)
  // The host never selects a variant above the image's arch; the helpers compile to nothing there.
  if constexpr (LD == Load::kCpAsync) {
    if (__CUDA_ARCH__ < 800) __trap();
  }
  if constexpr (LD == Load::kBulk) {
    if (__CUDA_ARCH__ < 900) __trap();
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Layout "kv": thread t owns column group c = t % 8 (4 columns) of rows r + 16 j.
template <int K, typename ST, Load LD, int MIN_BLOCKS, bool PER_CHANNEL>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) decode_kv_kernel(const GdnDecodeParams p) {
  using V4 = Vec4<ST>;
  using Raw = typename V4::Raw;
  constexpr int BV = kTileV;
  constexpr int CG = BV / 4;         // column groups
  constexpr int RG = kThreads / CG;  // row groups
  constexpr int R = K / RG;          // rows per thread
  trap_below_arch<LD>();
  pdl_enter();
  __shared__ float qs[K];
  __shared__ float ks[K];
  __shared__ float red3[kWarps][3];
  __shared__ float ds[PER_CHANNEL ? K : 1];
  __shared__ float red[kWarps][CG][8];
  __shared__ uint64_t bars[2];
  extern __shared__ __align__(16) unsigned char smem[];  // sm80, sm90tma: the tile, [K][CG] Raw
  Raw* tile = reinterpret_cast<Raw*>(smem);

  const int t = threadIdx.x;
  const int c = t % CG;
  const int r = t / CG;
  const int lane = t & 31;
  const int warp = t >> 5;
  const Site site = site_of(p);
  const int64_t col = site.tile * BV + 4 * c;
  if (!slot_valid(p, site.slot)) {
    if (r == 0) {
#pragma unroll
      for (int m = 0; m < 4; ++m) store_f(p.out, p.dtype, out_at(p, site, col + m), 0.f);
    }
    return;
  }
  ST* S = static_cast<ST*>(p.state) + (site.slot * p.HV + site.hv) * int64_t(K) * p.V + site.tile * BV;

  // The state tile goes first: its loads are in flight while the gates, q and k are read.
  Raw s[R] = {};
  if constexpr (LD == Load::kRegisters) {
#pragma unroll
    for (int j = 0; j < R; ++j) s[j] = *reinterpret_cast<const Raw*>(S + int64_t(r + RG * j) * p.V + 4 * c);
  } else if constexpr (LD == Load::kCpAsync) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int row = r + RG * j;
      cp_async<sizeof(Raw)>(&tile[row * CG + c], S + int64_t(row) * p.V + 4 * c);
      if (j == R / 2 - 1) cp_async_commit();
    }
    cp_async_commit();
  } else if (warp == 0) {
    // Warp 0 hands the TMA engine one bulk copy per row; each half of the rows completes on its
    // own mbarrier. The other warps first touch the barriers after load_qk's __syncthreads.
    constexpr uint32_t kHalfBytes = (K / 2) * BV * sizeof(ST);
    if (lane == 0) {
      mbar_init(&bars[0], 1);
      mbar_init(&bars[1], 1);
      mbar_fence_init();
      mbar_arrive_expect_tx(&bars[0], kHalfBytes);
      mbar_arrive_expect_tx(&bars[1], kHalfBytes);
    }
    __syncwarp();
    for (int row = lane; row < K; row += 32) {
      bulk_g2s(&tile[row * CG], S + int64_t(row) * p.V, BV * sizeof(ST), &bars[row < K / 2 ? 0 : 1]);
    }
  }

  float vv[4];
  const int64_t v_at = site.n * p.v_stride_n + site.hv * p.v_stride_h + col;
#pragma unroll
  for (int m = 0; m < 4; ++m) vv[m] = load_f(p.v, p.dtype, v_at + m);
  // GDN: one decay for the head, in a register. KDA: one per key channel (row), staged in shared
  // memory (load_qk's barrier publishes them). A template flag keeps GDN free of the staging,
  // which measured 14% at B=1024 when it was a run-time branch.
  const float head_decay = PER_CHANNEL ? 1.f : load_decay(p, site.n, site.hv, -1);
  if constexpr (PER_CHANNEL) {
    for (int i = t; i < K; i += kThreads) ds[i] = load_decay(p, site.n, site.hv, i);
  }
  const float beta = load_beta(p, site.n, site.hv);
  const QkScales sc = load_qk<K>(p, site.n, site.h, qs, ks, red3);

  // Decay the tile and reduce both dot products in one pass.
  float pk[4] = {0.f, 0.f, 0.f, 0.f};
  float pq[4] = {0.f, 0.f, 0.f, 0.f};
  auto accumulate = [&](int j) {
    const int row = r + RG * j;
    const float decay = PER_CHANNEL ? ds[row] : head_decay;
    const float4 x = V4::widen(s[j]);
    const float kr = ks[row] * decay, qr = qs[row] * decay;
    pk[0] += x.x * kr; pk[1] += x.y * kr; pk[2] += x.z * kr; pk[3] += x.w * kr;
    pq[0] += x.x * qr; pq[1] += x.y * qr; pq[2] += x.z * qr; pq[3] += x.w * qr;
  };
  if constexpr (LD == Load::kRegisters) {
#pragma unroll
    for (int j = 0; j < R; ++j) accumulate(j);
  } else {
    // cp.async: a thread reads back only what it copied itself, so its own wait_group suffices.
    if constexpr (LD == Load::kCpAsync) cp_async_wait<1>(); else mbar_wait(&bars[0], 0);
#pragma unroll
    for (int j = 0; j < R / 2; ++j) {
      s[j] = tile[(r + RG * j) * CG + c];
      accumulate(j);
    }
    if constexpr (LD == Load::kCpAsync) cp_async_wait<0>(); else mbar_wait(&bars[1], 0);
#pragma unroll
    for (int j = R / 2; j < R; ++j) {
      s[j] = tile[(r + RG * j) * CG + c];
      accumulate(j);
    }
  }

#pragma unroll
  for (int m = 0; m < 4; ++m) {
    // Lanes that share a column group (lane % CG) hold different rows: fold the lane bits above.
#pragma unroll
    for (int o = CG; o < 32; o <<= 1) {
      pk[m] += __shfl_xor_sync(0xffffffffu, pk[m], o);
      pq[m] += __shfl_xor_sync(0xffffffffu, pq[m], o);
    }
  }
  if (lane < CG) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      red[warp][c][m] = pk[m];
      red[warp][c][4 + m] = pq[m];
    }
  }
  __syncthreads();
  float u[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    float tk = 0.f, tq = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      tk += red[w][c][m];
      tq += red[w][c][4 + m];
    }
    u[m] = beta * (vv[m] - tk * sc.k);
    if (r == 0) store_f(p.out, p.dtype, out_at(p, site, col + m), tq * sc.q + u[m] * sc.qk);
  }
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int row = r + RG * j;
    const float decay = PER_CHANNEL ? ds[row] : head_decay;
    const float kr = ks[row] * sc.k;
    float4 x = V4::widen(s[j]);
    x.x = x.x * decay + kr * u[0];
    x.y = x.y * decay + kr * u[1];
    x.z = x.z * decay + kr * u[2];
    x.w = x.w * decay + kr * u[3];
    *reinterpret_cast<Raw*>(S + int64_t(row) * p.V + 4 * c) = V4::narrow(x);
  }
}

// ---------------------------------------------------------------------------------------------
// Layout "vk": the block's tile is 32 contiguous rows (one per value column) of K elements, moved
// in 16-byte chunks (4 fp32 or 8 bf16). LPR lanes share a row, each holding CPL consecutive chunks
// of it, so the reduction over k is a shuffle within the warp. The block is sized so that each
// thread holds 16 chunks (256 bytes) of state: what bounds this kernel is the bytes in flight per
// SM (ncu, H100, B=256: 128-thread blocks of 8 chunks each reached 66% of DRAM bandwidth at 5 blocks
// per SM, register-limited), and fewer threads per tile with more state each keeps as many
// blocks, so as many tiles, for small batches. A batch too small to fill the GPU once takes a
// second build, 4 chunks per thread: there the time is latency, and a thread's 16 passes of
// shuffles cost more than the bandwidth gained (H100, B=1: 8.0 us at 16 chunks, 5.3 at 4).
constexpr int kVkChunks = 16;
constexpr int kVkChunksSmallBatch = 4;

template <int K, typename ST, int CHUNKS = kVkChunks>
struct VkShape {
  static constexpr int E = Chunk<ST>::E;
  static constexpr int KC = K / E;                                                  // chunks per row
  static constexpr int T = kTileV * KC / CHUNKS > 32 ? kTileV * KC / CHUNKS : 32;  // threads per block
  static constexpr int LPR = KC < 32 ? KC : 32;                             // lanes per row
  static constexpr int CPL = KC / LPR;                                      // chunks per lane in a row
  static constexpr int RPP = T / LPR;                                       // rows per pass
  static constexpr int NP = kTileV / RPP;                                   // passes
};

template <int K, typename ST, Load LD, int CHUNKS, bool PER_CHANNEL>
__global__ void __launch_bounds__(VkShape<K, ST, CHUNKS>::T) decode_vk_kernel(const GdnDecodeParams p) {
  using C = Chunk<ST>;
  using Raw = typename C::Raw;
  using Sh = VkShape<K, ST, CHUNKS>;
  constexpr int BV = kTileV, E = Sh::E, KC = Sh::KC, T = Sh::T, LPR = Sh::LPR, CPL = Sh::CPL, RPP = Sh::RPP,
                NP = Sh::NP;
  trap_below_arch<LD>();
  pdl_enter();
  __shared__ float qs[K];
  __shared__ float ks[K];
  __shared__ float red3[T / 32][3];
  __shared__ uint64_t bars[2];
  extern __shared__ __align__(16) unsigned char smem[];  // sm80, sm90tma: the tile, [BV][KC] Raw
  Raw* tile = reinterpret_cast<Raw*>(smem);

  const int t = threadIdx.x;
  const int l = t % LPR;
  const int r = t / LPR;
  const int lane = t & 31;
  const int warp = t >> 5;
  const Site site = site_of(p);
  const int64_t row0 = site.tile * BV;
  if (!slot_valid(p, site.slot)) {
    if (l == 0) {
#pragma unroll
      for (int j = 0; j < NP; ++j) store_f(p.out, p.dtype, out_at(p, site, row0 + r + RPP * j), 0.f);
    }
    return;
  }
  ST* S = static_cast<ST*>(p.state) + ((site.slot * p.HV + site.hv) * p.V + row0) * int64_t(K);

  Raw s[NP][CPL] = {};
  if constexpr (LD == Load::kRegisters) {
#pragma unroll
    for (int j = 0; j < NP; ++j) {
#pragma unroll
      for (int i = 0; i < CPL; ++i) s[j][i] = reinterpret_cast<const Raw*>(S)[(r + RPP * j) * KC + l * CPL + i];
    }
  } else if constexpr (LD == Load::kCpAsync) {
#pragma unroll
    for (int j = 0; j < NP; ++j) {
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        const int at = (r + RPP * j) * KC + l * CPL + i;
        cp_async<16>(&tile[at], reinterpret_cast<const Raw*>(S) + at);
      }
      if (j == NP / 2 - 1) cp_async_commit();
    }
    cp_async_commit();
  } else if (warp == 0) {
    // One bulk copy per row, by lane = row (BV = 32 rows); each half completes on its own mbarrier.
    constexpr uint32_t kHalfBytes = (BV / 2) * K * sizeof(ST);
    if (lane == 0) {
      mbar_init(&bars[0], 1);
      mbar_init(&bars[1], 1);
      mbar_fence_init();
      mbar_arrive_expect_tx(&bars[0], kHalfBytes);
      mbar_arrive_expect_tx(&bars[1], kHalfBytes);
    }
    __syncwarp();
    // Pass j covers rows RPP*j .. RPP*(j+1)-1, so the first NP/2 passes are the first BV/2 rows.
    bulk_g2s(&tile[lane * KC], S + lane * K, K * sizeof(ST), &bars[lane < BV / 2 ? 0 : 1]);
  }

  float vv[NP];
  const int64_t v_at = site.n * p.v_stride_n + site.hv * p.v_stride_h + row0 + r;
#pragma unroll
  for (int j = 0; j < NP; ++j) vv[j] = load_f(p.v, p.dtype, v_at + RPP * j);
  // The thread's k channels are the same in every pass: their decays live in registers.
  float decay[CPL * E];  // channel E * (l * CPL + i) + m at i * E + m
  if constexpr (PER_CHANNEL) {
    DecayBits d_bits[CPL * E];
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
#pragma unroll
      for (int m = 0; m < E; ++m) d_bits[i * E + m] = load_decay_bits(p, site.n, site.hv, E * (l * CPL + i) + m);
    }
    decays<CPL * E>(p, d_bits, load_a_log_bits(p, site.hv), decay);
  } else {
    const float d = load_decay(p, site.n, site.hv, -1);
#pragma unroll
    for (int i = 0; i < CPL * E; ++i) decay[i] = d;
  }
  const float beta = load_beta(p, site.n, site.hv);
  const QkScales sc = load_qk<K, T>(p, site.n, site.h, qs, ks, red3);
  float kd[CPL][E], qd[CPL][E], ku[CPL][E];  // decay folded into k and q; k scaled for the update
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
#pragma unroll
    for (int m = 0; m < E; ++m) {
      const int kk = E * (l * CPL + i) + m;
      kd[i][m] = ks[kk] * decay[i * E + m];
      qd[i][m] = qs[kk] * decay[i * E + m];
      ku[i][m] = ks[kk] * sc.k;
    }
  }

#pragma unroll
  for (int j = 0; j < NP; ++j) {
    if constexpr (LD != Load::kRegisters) {
      if (j == 0) {
        if constexpr (LD == Load::kCpAsync) cp_async_wait<1>(); else mbar_wait(&bars[0], 0);
      }
      if (j == NP / 2) {
        if constexpr (LD == Load::kCpAsync) cp_async_wait<0>(); else mbar_wait(&bars[1], 0);
      }
#pragma unroll
      for (int i = 0; i < CPL; ++i) s[j][i] = tile[(r + RPP * j) * KC + l * CPL + i];
    }
    float pk = 0.f, pq = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      float x[E];
      C::widen(s[j][i], x);
#pragma unroll
      for (int m = 0; m < E; ++m) {
        pk += x[m] * kd[i][m];
        pq += x[m] * qd[i][m];
      }
    }
#pragma unroll
    for (int o = 1; o < LPR; o <<= 1) {
      pk += __shfl_xor_sync(0xffffffffu, pk, o);
      pq += __shfl_xor_sync(0xffffffffu, pq, o);
    }
    const float u = beta * (vv[j] - pk * sc.k);
    if (l == 0) store_f(p.out, p.dtype, out_at(p, site, row0 + r + RPP * j), pq * sc.q + u * sc.qk);
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      float x[E];
      C::widen(s[j][i], x);
#pragma unroll
      for (int m = 0; m < E; ++m) x[m] = x[m] * decay[i * E + m] + ku[i][m] * u;
      reinterpret_cast<Raw*>(S)[(r + RPP * j) * KC + l * CPL + i] = C::narrow(x);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Variant "warp", layout vk: one warp, alone in its block, owns a tile of BW rows x the whole
// K and keeps it in registers (at most 512 bytes a lane), so nothing crosses warps: the q/k norms
// and the gates are computed by every warp with shuffles, there is no __syncthreads and no shared
// memory, and an SM holds as many independent tiles as its registers allow (the whole decode step
// is one read and one write of the state, so what bounds it is the bytes in flight per SM). Lane
// l of a row holds chunks i*LPR + l (16 bytes each), so each load instruction of the warp covers
// 512 contiguous bytes. The two row dot-products (h'^T k, h'^T q) are reduced by a transposing
// butterfly: each level halves the rows a lane carries, so a 32-row tile costs 31 shuffles per
// product instead of 32 x 5, and each lane ends with the sums of one row, whose u and output it
// computes (the output store is one coalesced line); u comes back to the row's lanes by shuffle.
// Rows per tile (BW) and tiles per warp (TPW) are build parameters: a warp holds at most 32 rows,
// 128 state registers a lane. Small batches take short tiles (more warps, each with less dependent
// work), large ones long tiles; launch_vk_warp below holds the rule and its measurements.
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

// The transposing butterfly from lane offset O down to LO: N sums per lane, halved at each level
// until one is left, then plain xor-sums for the remaining offsets. At each halving level the lanes
// with the offset's bit set keep the upper half.
template <int N, int O, int LO = 1>
__device__ __forceinline__ void butterfly(float* a, float* b, int lane) {
  if constexpr (O >= LO) {
    if constexpr (N > 1) {
      constexpr int H = N / 2;
      const bool hi = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float sa = hi ? a[i] : a[i + H], ka = hi ? a[i + H] : a[i];
        const float sb = hi ? b[i] : b[i + H], kb = hi ? b[i + H] : b[i];
        a[i] = ka + __shfl_xor_sync(0xffffffffu, sa, O);
        b[i] = kb + __shfl_xor_sync(0xffffffffu, sb, O);
      }
      butterfly<H, O / 2, LO>(a, b, lane);
    } else {
      a[0] += __shfl_xor_sync(0xffffffffu, a[0], O);
      b[0] += __shfl_xor_sync(0xffffffffu, b[0], O);
      butterfly<1, O / 2, LO>(a, b, lane);
    }
  }
}

// The warp kernels' state chunks, each read and written once per step. STREAM: with the
// evict-first ("streaming") cache hint (ld.global.cs / st.global.cs), so the state passing through
// does not displace what L2 holds for longer. A launch-rule choice (launch_vk_warp, launch_kv_warp):
// on H100 it gained 2-7% at mid batches, and lost where a step's state stays in L2 between calls
// (B = 1 in the benchmark) or at B = 1024.
template <bool STREAM, typename T>
__device__ __forceinline__ T state_load(const T* p) {
  if constexpr (STREAM) return __ldcs(p);
  else return *p;
}
template <bool STREAM, typename T>
__device__ __forceinline__ void state_store(T* p, const T& x) {
  if constexpr (STREAM) __stcs(p, x);
  else *p = x;
}

// Hides a chunk's value from the compiler, so the widened copy made for the reduction is not kept
// live until the update (that doubled the registers of a bf16 tile); the update widens it again.
__device__ __forceinline__ void opaque(float4& x) {
  asm volatile("" : "+f"(x.x), "+f"(x.y), "+f"(x.z), "+f"(x.w));
}
__device__ __forceinline__ void opaque(uint4& x) {
  asm volatile("" : "+r"(x.x), "+r"(x.y), "+r"(x.z), "+r"(x.w));
}

// Resident warps per SM the register cap aims at. A warp lives on one of the SM's four 16K-register
// quarters, so the useful counts are 8 (255 registers), 12 (168) and 16 (128): a 128-register tile
// takes 8 (at 12 it spilled), a 64-register one 12 (at 16 it spilled), smaller ones 16.
template <int K, typename ST, int BW, int TPW = 1>
constexpr int warp_min_blocks() {
  using Sh = WarpShape<K, ST, BW>;
  constexpr int tile_regs = Sh::NP * Sh::CPL * 4 * TPW;
  return tile_regs >= 128 ? 8 : tile_regs >= 64 ? 12 : 16;
}

// One work item of the warp kernel: request n32, value head hv32, group g of TPW tiles.
template <int K, typename ST, int BW, bool PER_CHANNEL, int TPW, bool STREAM>
__device__ __forceinline__ void warp_tile(const GdnDecodeParams& p, uint32_t g, uint32_t hv32, uint32_t n32) {
  using C = Chunk<ST>;
  using Raw = typename C::Raw;
  using Sh = WarpShape<K, ST, BW>;
  constexpr int E = Sh::E, KC = Sh::KC, LPR = Sh::LPR, CPL = Sh::CPL, RPP = Sh::RPP, NP = Sh::NP, F = Sh::F;
  const int lane = threadIdx.x;
  const int l = lane % LPR;
  const int r = lane / LPR;
  const int64_t row0 = int64_t(g) * (BW * TPW);
  // The qk head: off the path to the slot's load, which needs n alone.
  const int64_t n = n32, hv = hv32, h = qk_head(p, hv32);
  const int64_t slot = p.idx_is_int64 ? static_cast<const int64_t*>(p.idx)[n] : static_cast<const int32_t*>(p.idx)[n];
  const int64_t o_at = n * p.out_stride_n + hv * p.out_stride_h + row0;
  if (!slot_valid(p, slot)) {
    for (int row = lane; row < BW * TPW; row += 32) store_f(p.out, p.dtype, o_at + row, 0.f);
    return;
  }
  Raw* S = reinterpret_cast<Raw*>(static_cast<ST*>(p.state) + ((slot * p.HV + hv) * p.V + row0) * int64_t(K));

  // The tiles first: all of their loads are in flight while the gates, q and k are read.
  Raw s[TPW][NP][CPL];
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
#pragma unroll
    for (int j = 0; j < NP; ++j) {
#pragma unroll
      for (int i = 0; i < CPL; ++i) s[t][j][i] = state_load<STREAM>(S + (t * BW + r + RPP * j) * KC + i * LPR + l);
    }
  }
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
  float sqq = 0.f, skk = 0.f, sqk = 0.f;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    widen_run<E>(q_bits[i], p.dtype, p.qk_aligned, qv[i]);
    widen_run<E>(k_bits[i], p.dtype, p.qk_aligned, kv[i]);
  }
  if constexpr (PER_CHANNEL) {
    decays<CPL * E>(p, d_bits, a_log_bits, decay);
  } else {
    const float d = decay_of(p, d_bits[0], a_log_bits);
#pragma unroll
    for (int i = 0; i < CPL * E; ++i) decay[i] = d;
  }
  const float beta = beta_of(p, beta_bits);
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
#pragma unroll
    for (int m = 0; m < E; ++m) {
      sqq += qv[i][m] * qv[i][m];
      skk += kv[i][m] * kv[i][m];
      sqk += qv[i][m] * kv[i][m];
    }
  }
  const QkScales sc = warp_qk_scales<1, LPR>(p, sqq, skk, sqk);
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

  // Per tile: row partial sums, pairs (j, j + NP/2) folded at once into the butterfly's first
  // level, so only NP/2 accumulators per product are ever live beside the tiles.
  constexpr int H0 = NP / 2;
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    auto partial = [&](int j, float& pk, float& pq) {
      pk = 0.f;
      pq = 0.f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        float x[E];
        C::widen(s[t][j][i], x);
#pragma unroll
        for (int m = 0; m < E; ++m) {
          pk += x[m] * kd[i][m];
          pq += x[m] * qd[i][m];
        }
      }
    };
    float ak[H0], aq[H0];
    {
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
    }
    butterfly<H0, LPR / 4>(ak, aq, lane);
    const float u_mine = beta * (vv[t] - ak[0] * (sum_decay * sc.k));
    if (l % F == 0) store_f(p.out, p.dtype, o_at + t * BW + my_row, aq[0] * (sum_decay * sc.q) + u_mine * sc.qk);

#pragma unroll
    for (int j = 0; j < NP; ++j) {
#pragma unroll
      for (int i = 0; i < CPL; ++i) opaque(s[t][j][i]);
    }
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const float us = sc.k * __shfl_sync(0xffffffffu, u_mine, r * LPR + j * F);
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        float x[E];
        C::widen(s[t][j][i], x);
#pragma unroll
        for (int m = 0; m < E; ++m) x[m] = x[m] * decay[i * E + m] + kv[i][m] * us;
        state_store<STREAM>(S + (t * BW + r + RPP * j) * KC + i * LPR + l, C::narrow(x));
      }
    }
  }
}

// PERSIST: a grid of one wave whose warps loop over the work items, so a warp's stores drain while
// it loads its next tile instead of holding its registers at exit, and no block is launched per
// tile (H100, bf16 state, 32-row tiles: 2-4% faster at B = 64-256 than the plain grid, but slower
// than the plain grid with the evict-first state, so the launch rule no longer takes it; the sweep
// still times it).
// STREAM: the state loads and stores carry the evict-first hint (state_load).
template <int K, typename ST, int BW, bool PER_CHANNEL, int TPW = 1, bool PERSIST = false, bool STREAM = false>
__global__ void __launch_bounds__(32, (warp_min_blocks<K, ST, BW, TPW>())) decode_vk_warp_kernel(const GdnDecodeParams p) {
  pdl_enter();
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

// Resident blocks per SM of `Kernel` on `device` with `threads` threads and `smem` bytes of dynamic
// shared memory: asked of the driver once per kernel and device, then cached.
template <auto Kernel>
int resident_blocks_of(int device, int threads, size_t smem) {
  static int cached[64] = {};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int blocks = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, threads, smem);
  if (device >= 0 && device < 64 && blocks > 0) cached[device] = blocks;
  return blocks;
}

// Appends the programmatic-dependent-launch attribute where the params ask for it (every kernel
// here starts with pdl_enter); returns the attribute count.
inline unsigned add_pdl(const GdnDecodeParams& p, cudaLaunchAttribute* attr, int n) {
  if (p.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  return static_cast<unsigned>(n);
}

template <int K, typename ST, int BW, int TPW = 1, bool PERSIST = false, bool STREAM = false>
int launch_vk_warp_rows(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_vk_warp_kernel<K, ST, BW, true, TPW, PERSIST, STREAM>
                                : decode_vk_warp_kernel<K, ST, BW, false, TPW, PERSIST, STREAM>;
  int64_t grid = p.N * p.HV * (p.V / (BW * TPW));
  if constexpr (PERSIST) {
    // One wave of resident warps (the GDN build stands for both, as for the block kernels).
    const int per_sm = resident_blocks_of<decode_vk_warp_kernel<K, ST, BW, false, TPW, true, STREAM>>(p.device, 32, 0);
    const int64_t wave = int64_t(per_sm > 0 ? per_sm : 1) * (p.sm_count > 0 ? p.sm_count : 1);
    grid = grid < wave ? grid : wave;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = PERSIST ? dim3(static_cast<unsigned>(grid))
                        : dim3(static_cast<unsigned>(p.V / (BW * TPW)), static_cast<unsigned>(p.HV),
                               static_cast<unsigned>(p.N));
  cfg.blockDim = dim3(32);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  cfg.attrs = attr;
  cfg.numAttrs = add_pdl(p, attr, 0);
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, p));
}

// The SM count the warp launch rules scale their thresholds by (the probe always fills it; the
// H100's 132, the GPU they were measured on, otherwise).
inline int64_t rule_sms(const GdnDecodeParams& p) { return p.sm_count > 0 ? p.sm_count : 132; }

// Which build a launch of `pairs` (request, value head) pairs takes, from the sweep of every shape
// (benchmarks/warp_sweep.cu, H100, K = V = 128; results in benchmarks/results-h100-kernel.md;
// checked on an H200, same SM count, 1.2x the memory bandwidth).
// Small batches are latency: short tiles, many warps, each with little dependent work. From a few
// pairs per SM the bytes in flight per warp decide: fp32 two 8-row tiles per warp, then one 8-row
// tile from 16 pairs per SM (on the H200 the fastest build there, 1.0-1.9% ahead of two 8-row
// tiles and of 32-row tiles at B=1024; on the H100 within 0.1-0.5% of them); bf16 16-row tiles.
// At mid batches (a few to 64 pairs per SM) the evict-first state (STREAM) gained 1-7%; it lost
// at B=1 (where the benchmark's state stays in L2 between steps) and at B >= 256 (fp32) or 512
// (bf16). Programmatic dependent launch (where the params allow it) gained 0.1-0.7 us per step on
// every build chosen here. The persistent grid (PERSIST) and the 32-row bf16 builds stay in the
// sweep: since the loads are issued before any is used (load_bits), 16-row bf16 tiles are as fast
// or faster from B=4 (B=32 26.5 us against 27.0).
// The extra builds are for K = 128 only (Qwen3-Next, Kimi-Linear): each costs release compile time.
template <int K, typename ST>
int launch_vk_warp(const GdnDecodeParams& p, cudaStream_t stream) {
  if constexpr (K == 128) {
    const int64_t pairs = p.N * p.HV, sms = rule_sms(p);
    if constexpr (std::is_same_v<ST, float>) {
      // us per step, H100 / H200: B=1 2.7 / 2.5, B=8 12.3 / 9.9, B=32 47.8 / 36.3, B=128 185.7 / 135.8,
      // B=1024 1464.8 / 1063.8
      if (pairs <= sms) return launch_vk_warp_rows<K, ST, 4>(p, stream);
      if (pairs <= 16 * sms) return launch_vk_warp_rows<K, ST, 8, 2, false, true>(p, stream);
      return launch_vk_warp_rows<K, ST, 8>(p, stream);
    } else {
      // H100, us per step: B=1 2.4, B=8 7.6, B=32 26.5, B=128 96.5, B=1024 746
      if (pairs <= sms / 2) return launch_vk_warp_rows<K, ST, 8>(p, stream);
      if (pairs <= 64 * sms) return launch_vk_warp_rows<K, ST, 16, 1, false, true>(p, stream);
      return launch_vk_warp_rows<K, ST, 16>(p, stream);
    }
  }
  return launch_vk_warp_rows<K, ST, warp_rows_big<K, ST>()>(p, stream);
}

// ---------------------------------------------------------------------------------------------
// Variant "warp", layout kv: one warp owns all K rows of BW = CPR * E value columns and keeps them
// in registers. The step's reductions run over k, down the columns, so a lane holds NR consecutive
// rows of one 16-byte column chunk: it sums its rows alone, and only the RPI lanes of a column
// chunk exchange their sums, never another warp: by the transposing butterfly, after which a lane
// holds NF of the chunk's E column sums (whose u and outputs it computes) and the u of the others
// come back by shuffle. A load instruction covers RPI row segments of CPR * 16 bytes (whole 32-byte
// sectors). The lane's q, k (and KDA's decay) are its NR consecutive channels, read as vectors.
// K = 256 would hold 32 rows of q and k beside the tile; it runs the block kernel (launch_kv_warp).
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
  Raw* S = reinterpret_cast<Raw*>(static_cast<ST*>(p.state) + ((slot * p.HV + hv) * K + r * NR) * p.V + col0);
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
    decay[0] = decay_of(p, d_bits[0], a_log_bits);
  }
  const float beta = beta_of(p, beta_bits);
  float sqq = 0.f, skk = 0.f, sqk = 0.f;
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    sqq += qv[j] * qv[j];
    skk += kv[j] * kv[j];
    sqk += qv[j] * kv[j];
  }
  // Each row group's lanes hold the same sums: add across the groups only.
  const QkScales sc = warp_qk_scales<CPR, 32>(p, sqq, skk, sqk);
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
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.V / (KvWarpShape<K, ST, CPR>::BW * WPB)), static_cast<unsigned>(p.HV),
                     static_cast<unsigned>(p.N));
  cfg.blockDim = dim3(32 * WPB);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  cfg.attrs = attr;
  cfg.numAttrs = add_pdl(p, attr, 0);
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, p));
}

// ---------------------------------------------------------------------------------------------
template <bool VK, int K, typename ST, int BUILD>
constexpr int threads_of() {
  if constexpr (VK) return VkShape<K, ST, BUILD>::T;
  else return kThreads;
}

// BUILD: kv, the minimum resident blocks (1 or squeezed); vk, the chunks per thread (VkShape).
template <bool VK, int K, typename ST, Load LD, int BUILD, bool PER_CHANNEL>
constexpr auto kernel_of() {
  if constexpr (VK) return decode_vk_kernel<K, ST, LD, BUILD, PER_CHANNEL>;
  else return decode_kv_kernel<K, ST, LD, BUILD, PER_CHANNEL>;
}

template <bool VK, int K, typename ST, Load LD, int BUILD>
int launch_build(const GdnDecodeParams& p, cudaStream_t stream, bool cluster, size_t smem) {
  auto kernel = p.g_per_channel ? kernel_of<VK, K, ST, LD, BUILD, true>() : kernel_of<VK, K, ST, LD, BUILD, false>();
  const int64_t tiles = p.V / kTileV;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.N * p.HV * tiles));
  cfg.blockDim = dim3(threads_of<VK, K, ST, BUILD>());
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (cluster && tiles <= 8) {
    // sm_90 thread-block clusters: the tiles of one head run together on one GPC.
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = static_cast<unsigned>(tiles);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = add_pdl(p, attr, n);
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, p));
}

// Resident blocks per SM of one block-kernel build on the current device. The GDN build stands
// for both: the KDA build differs by a few registers or K floats.
template <bool VK, int K, typename ST, Load LD, int BUILD>
int resident_blocks(int device, size_t smem) {
  return resident_blocks_of<kernel_of<VK, K, ST, LD, BUILD, false>()>(device, threads_of<VK, K, ST, BUILD>(), smem);
}

template <bool VK, int K, typename ST, Load LD>
int launch_load(const GdnDecodeParams& p, Variant v, cudaStream_t stream) {
  const bool cluster = v == Variant::kSm90 || v == Variant::kSm90Tma;
  const size_t smem = LD == Load::kRegisters ? 0 : size_t(K) * kTileV * sizeof(ST);
  if constexpr (VK) {
    // Fewer tiles than 2 per SM: the small-batch build (register loads only; the staged variants
    // are never auto-picked there). H100, Qwen3-Next fp32: B=1 (128 tiles) 5.3 us small, 8.0 big;
    // B=4 (512 tiles) 12.5 small, the big build measured 10.4 in an earlier run.
    if constexpr (LD == Load::kRegisters) {
      const int64_t blocks = p.N * p.HV * (p.V / kTileV);
      if (p.sm_count > 0 && blocks < 2 * int64_t(p.sm_count)) {
        return launch_build<VK, K, ST, LD, kVkChunksSmallBatch>(p, stream, cluster, smem);
      }
    }
    return launch_build<VK, K, ST, LD, kVkChunks>(p, stream, cluster, smem);
  } else {
    if constexpr (K <= 128) {
      const int device = p.device, sms = p.sm_count;
      const int64_t blocks = p.N * p.HV * (p.V / kTileV);
      const int free_fit = resident_blocks<VK, K, ST, LD, 1>(device, smem);
      const int squeezed_fit = resident_blocks<VK, K, ST, LD, kSqueezedBlocksPerSm>(device, smem);
      if (sms > 0 && free_fit > 0 && squeezed_fit > free_fit) {
        const int64_t free_waves = (blocks + int64_t(sms) * free_fit - 1) / (int64_t(sms) * free_fit);
        const int64_t squeezed_waves =
            (blocks + int64_t(sms) * squeezed_fit - 1) / (int64_t(sms) * squeezed_fit);
        // Only where the tail wave is a large share of the time: over many waves the spills cost more.
        if (squeezed_waves < free_waves && squeezed_waves <= 2) {
          return launch_build<VK, K, ST, LD, kSqueezedBlocksPerSm>(p, stream, cluster, smem);
        }
      }
    }
    return launch_build<VK, K, ST, LD, 1>(p, stream, cluster, smem);
  }
}

template <bool VK, int K, typename ST>
int launch_variant(const GdnDecodeParams& p, Variant v, cudaStream_t stream) {
  switch (load_of(v)) {
    case Load::kRegisters: return launch_load<VK, K, ST, Load::kRegisters>(p, v, stream);
    case Load::kCpAsync: return launch_load<VK, K, ST, Load::kCpAsync>(p, v, stream);
    case Load::kBulk: return launch_load<VK, K, ST, Load::kBulk>(p, v, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template <bool VK, typename ST>
int launch_k(const GdnDecodeParams& p, Variant v, cudaStream_t stream) {
  switch (p.K) {
    case 64: return launch_variant<VK, 64, ST>(p, v, stream);
    case 128: return launch_variant<VK, 128, ST>(p, v, stream);
    case 256: return launch_variant<VK, 256, ST>(p, v, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

// Which kv warp build a launch takes (K = 64, 128; K = 256 runs the generic block kernel), from the
// sweep of every shape (benchmarks/warp_sweep.cu kv, H100, K = V = 128; results in
// benchmarks/results-h100-kernel.md). Four column chunks per tile (fp32 16 columns, bf16 32) for
// small batches; fp32 past one (request, head) pair per SM: 32 columns (128-byte row segments, 254
// registers) in blocks of two warps; bf16 past 4 pairs per SM: blocks of four warps (a head's
// whole rows at once). The evict-first state (STREAM) from B = 4 (bf16) or 8 (fp32) to B = 16
// (bf16) or 64 (fp32), as for vk. Programmatic dependent launch cost the 4-chunk builds 0.3-1.7 us
// once the grid passed 4 warps per SM (the next step's early warps take the slots this one still
// needs) and gained 0.1-0.4 us below; the multi-warp blocks gain or lose < 1%. Extra builds for
// K = 128 only, as for vk.
template <int K, typename ST>
int launch_kv_warp(const GdnDecodeParams& p, cudaStream_t stream) {
  const int64_t pairs = p.N * p.HV, sms = rule_sms(p);
  GdnDecodeParams small = p;
  small.pdl = p.pdl && pairs * (p.V / KvWarpShape<K, ST, 4>::BW) <= 4 * sms;
  if constexpr (K == 128 && std::is_same_v<ST, float>) {
    // H100, us per step (generic block kernel): B=1 3.4 (4.4), B=8 13.5 (18.6), B=128 189.5 (234.5), B=1024 1476 (1838)
    if (pairs <= sms) return launch_kv_warp_cols<K, ST, 4>(small, stream);
    if (pairs <= 16 * sms) return launch_kv_warp_cols<K, ST, 8, 2, true>(p, stream);
    return launch_kv_warp_cols<K, ST, 8, 2>(p, stream);
  } else if constexpr (K == 128) {
    // H100, us per step (generic block kernel): B=1 3.1 (3.8), B=8 7.9 (10.3), B=128 99.6 (160.4), B=1024 761 (1245)
    if (pairs <= sms / 2) return launch_kv_warp_cols<K, ST, 4>(small, stream);
    if (pairs <= 4 * sms) return launch_kv_warp_cols<K, ST, 4, 1, true>(small, stream);
    if (p.V % (4 * KvWarpShape<K, ST, 4>::BW) == 0) return launch_kv_warp_cols<K, ST, 4, 4>(p, stream);
  }
  return launch_kv_warp_cols<K, ST, 4>(small, stream);
}

template <typename ST>
int launch_layout(const GdnDecodeParams& p, Variant v, cudaStream_t stream) {
  if (v == Variant::kWarp) {
    switch (p.K) {
      case 64: return p.state_vk ? launch_vk_warp<64, ST>(p, stream) : launch_kv_warp<64, ST>(p, stream);
      case 128: return p.state_vk ? launch_vk_warp<128, ST>(p, stream) : launch_kv_warp<128, ST>(p, stream);
      case 256: return p.state_vk ? launch_vk_warp<256, ST>(p, stream) : launch_k<false, ST>(p, Variant::kGeneric, stream);
    }
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return p.state_vk ? launch_k<true, ST>(p, v, stream) : launch_k<false, ST>(p, v, stream);
}

// A grid's y and z dimensions hold at most 65535 blocks; the warp kernel puts requests on z.
constexpr int64_t kMaxRequestsPerLaunch = 65535;

const void* advance(const void* p, int64_t elements, DType t) {
  return static_cast<const char*>(p) + elements * (t == DType::kFloat32 ? 4 : 2);
}

}  // namespace

int launch_gdn_decode(const GdnDecodeParams& p, Variant v, void* stream) {
  if (p.N == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  if (p.N > kMaxRequestsPerLaunch) {
    // Requests are independent: launch them in chunks the grid can hold, each chunk's per-request
    // pointers advanced past the previous ones.
    for (int64_t n0 = 0; n0 < p.N; n0 += kMaxRequestsPerLaunch) {
      GdnDecodeParams c = p;
      c.N = p.N - n0 < kMaxRequestsPerLaunch ? p.N - n0 : kMaxRequestsPerLaunch;
      c.q = advance(p.q, n0 * p.q_stride_n, p.dtype);
      c.k = advance(p.k, n0 * p.k_stride_n, p.dtype);
      c.v = advance(p.v, n0 * p.v_stride_n, p.dtype);
      c.out = const_cast<void*>(advance(p.out, n0 * p.out_stride_n, p.dtype));
      c.g = advance(p.g, n0 * p.g_stride_n, p.g_dtype);
      c.beta = advance(p.beta, n0 * p.beta_stride_n, p.beta_dtype);
      c.idx = static_cast<const char*>(p.idx) + n0 * (p.idx_is_int64 ? 8 : 4);
      const int err = launch_gdn_decode(c, v, stream);
      if (err != 0) return err;
    }
    return 0;
  }
  switch (p.state_dtype) {
    case DType::kFloat32: return launch_layout<float>(p, v, s);
    case DType::kBFloat16: return launch_layout<__nv_bfloat16>(p, v, s);
    default: break;
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace cudelta
