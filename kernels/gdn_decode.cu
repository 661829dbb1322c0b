// Gated DeltaNet / Kimi Delta Attention decode step over a pool of recurrent states, updated in
// place. The two differ only in the decay: one per head (GDN) or one per key channel (KDA).
//
// One block of 128 threads owns one (request n, value head hv) pair and a BV-column tile of its
// [K, V] fp32 state (BV = 32, or 16 for small batches). Thread t holds columns 4*(t%CG)..+3 of
// rows t/CG + RG*j (CG = BV/4 column groups, RG = 128/CG row groups), so a warp's float4 accesses
// cover whole row segments, and the tiles of one head are neighbours in launch order. The step
// is bandwidth bound (one read and one write of the state), so the variants differ only in how
// the state tile reaches the SM; each issues it before the q/k prologue so the two overlap:
//
//   generic  float4 loads straight into registers (any arch)
//   sm80     cp.async into shared memory in two commit groups, so the first half is reduced
//            while the second is in flight
//   sm90     register loads, launched as thread-block clusters of one head's column tiles, so
//            they are co-scheduled on one GPC and read each DRAM page together
//   sm90tma  clusters, and cp.async.bulk (the TMA engine) row copies completing on two
//            mbarriers; the threads generate no addresses at all
// Which one auto picks is decided by measurement (auto_variant in probe.cu): on H200, generic.
//
// Both reductions of the step (pred = h'^T k and h'^T q) are done in one pass over the decayed
// state h': with u = beta * (v - pred), the output of the updated state is
// o = (h' + k u^T)^T q = h'^T q + u * (k . q), so the updated state never has to be re-read.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"

namespace cudelta {
namespace {

constexpr int kThreads = 128;
// Columns per block. 16-column tiles (more, smaller blocks) measured 1.4-1.7x slower at B <= 8.
constexpr int kWideTileV = 32;
// Each kernel is built twice: with the registers it wants, and squeezed to eight resident blocks
// per SM (<= 64 registers, a few spilled). At 72 registers seven fit, and a batch of 8 requests x
// 32 heads (1024 blocks) spilled into a second, nearly empty wave (ncu: 1.11 waves): squeezed it
// runs 13.8 us instead of 15.4, while large batches lose 3% to the spills. The launch takes the
// squeezed build only when that saves a wave of a launch of at most two.
constexpr int kSqueezedBlocksPerSm = 8;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

[[maybe_unused]] __device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- sm_80: cp.async ------------------------------------------------------------------------
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
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

template <int CG>
__device__ __forceinline__ float warp_sum_rows(float x) {
  // Lanes that share a column group (lane % CG) hold different rows: fold the lane bits above.
#pragma unroll
  for (int o = CG; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// q and k of head h to shared memory as float, with the three dot products the step needs
// (|q|^2, |k|^2, q.k) reduced over the block. Every thread gets the same scales back.
struct QkScales {
  float q;   // multiplies raw q: l2-normalisation and the attention scale
  float k;   // multiplies raw k: l2-normalisation
  float qk;  // (k . q) after scaling, for o = h'^T q + u (k . q)
};

template <typename T, int K, int kWarps>
__device__ __forceinline__ QkScales load_qk(const GdnDecodeParams& p, int64_t n, int64_t h, float* qs, float* ks,
                                            float (*red3)[3]) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const T* qp = static_cast<const T*>(p.q) + n * p.q_stride_n + h * p.q_stride_h;
  const T* kp = static_cast<const T*>(p.k) + n * p.k_stride_n + h * p.k_stride_h;
  float sqq = 0.f, skk = 0.f, sqk = 0.f;
  for (int i = t; i < K; i += kWarps * 32) {
    const float qv = to_float<T>(qp[i]);
    const float kv = to_float<T>(kp[i]);
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
  for (int w = 0; w < kWarps; ++w) {
    sqq += red3[w][0];
    skk += red3[w][1];
    sqk += red3[w][2];
  }
  QkScales sc;
  sc.k = p.use_qk_l2norm ? rsqrtf(skk + 1e-6f) : 1.f;
  sc.q = (p.use_qk_l2norm ? rsqrtf(sqq + 1e-6f) : 1.f) * p.scale;
  sc.qk = sqk * sc.k * sc.q;
  return sc;
}

__device__ __forceinline__ int64_t load_slot(const GdnDecodeParams& p, int64_t n) {
  return p.idx_is_int64 ? static_cast<const int64_t*>(p.idx)[n] : static_cast<const int32_t*>(p.idx)[n];
}

// generic and sm80: one block per (n, hv, 32-column tile); thread t owns column group t % 8 of
// rows t / 8 + 16 j, so each warp's float4 accesses cover four whole 128-byte rows.
// generic and sm90 read the state tile straight into registers; sm80 and sm90tma stage it in
// shared memory.
constexpr bool tile_in_registers(Variant v) { return v == Variant::kGeneric || v == Variant::kSm90; }

template <typename T, int K, int BV, Variant VAR, int MIN_BLOCKS, bool PER_CHANNEL>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) gdn_decode_tiled_kernel(const GdnDecodeParams p) {
  constexpr int CG = BV / 4;           // float4 column groups
  constexpr int RG = kThreads / CG;    // row groups
  constexpr int R = K / RG;            // rows per thread
  constexpr int kWarps = kThreads / 32;
#if defined(__CUDA_ARCH__)
  // The host never selects a variant above the image's arch; the helpers compile to nothing there.
  if constexpr (VAR == Variant::kSm80) {
    if (__CUDA_ARCH__ < 800) __trap();
  }
  if constexpr (VAR == Variant::kSm90Tma || VAR == Variant::kSm90) {
    if (__CUDA_ARCH__ < 900) __trap();
  }
#endif
  __shared__ float qs[K];
  __shared__ float ks[K];
  __shared__ float red3[kWarps][3];
  __shared__ float ds[PER_CHANNEL ? K : 1];
  __shared__ float red[kWarps][CG][8];
  __shared__ uint64_t bars[2];
  extern __shared__ float4 tile[];  // sm80, sm90: [K][CG] float4

  const int t = threadIdx.x;
  const int c = t % CG;
  const int r = t / CG;
  const int lane = t & 31;
  const int warp = t >> 5;

  // Consecutive blocks take the column tiles of one head: their interleaved 128-byte row
  // segments then reach DRAM together instead of a whole grid apart.
  const int64_t tiles = p.V / BV;
  const int64_t nh = blockIdx.x / tiles;
  int64_t tile_v = blockIdx.x - nh * tiles;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (VAR == Variant::kSm90 || VAR == Variant::kSm90Tma) {
    // Launched as one cluster per head, the tile is the block's rank within its cluster.
    uint32_t rank, size;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
    if (size == tiles) tile_v = rank;
  }
#endif
  const int64_t n = nh / p.HV;
  const int64_t hv = nh - n * p.HV;
  const int64_t h = hv / (p.HV / p.H);
  const int64_t col = tile_v * BV + 4 * c;

  const int64_t slot = load_slot(p, n);
  T* out = static_cast<T*>(p.out) + nh * p.V + col;
  if (slot < 0 || slot >= p.P) {
    if (r == 0) {
#pragma unroll
      for (int m = 0; m < 4; ++m) out[m] = from_float<T>(0.f);
    }
    return;
  }
  float* S = p.state + (slot * p.HV + hv) * int64_t(K) * p.V + tile_v * BV;

  // The state tile goes first: its loads are in flight while q and k are reduced.
  float4 s[R] = {};
  if constexpr (tile_in_registers(VAR)) {
#pragma unroll
    for (int j = 0; j < R; ++j) s[j] = *reinterpret_cast<const float4*>(S + int64_t(r + RG * j) * p.V + 4 * c);
  } else if constexpr (VAR == Variant::kSm80) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int row = r + RG * j;
      cp_async_16(&tile[row * CG + c], S + int64_t(row) * p.V + 4 * c);
      if (j == R / 2 - 1) cp_async_commit();
    }
    cp_async_commit();
  } else if (warp == 0) {
    // sm90: warp 0 hands the TMA engine one 128-byte bulk copy per row; each half of the rows
    // completes on its own mbarrier. The other warps first touch the barriers after load_qk's
    // __syncthreads, which orders them after this initialisation.
    constexpr uint32_t kHalfBytes = (K / 2) * BV * sizeof(float);
    if (lane == 0) {
      mbar_init(&bars[0], 1);
      mbar_init(&bars[1], 1);
      mbar_fence_init();
      mbar_arrive_expect_tx(&bars[0], kHalfBytes);
      mbar_arrive_expect_tx(&bars[1], kHalfBytes);
    }
    __syncwarp();
    for (int row = lane; row < K; row += 32) {
      bulk_g2s(&tile[row * CG], S + int64_t(row) * p.V, BV * sizeof(float), &bars[row < K / 2 ? 0 : 1]);
    }
  }

  const T* vp = static_cast<const T*>(p.v) + n * p.v_stride_n + hv * p.v_stride_h + col;
  float vv[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) vv[m] = to_float<T>(vp[m]);
  // GDN: one decay for the head, in a register. KDA: one per key channel, staged in shared
  // memory (load_qk's barrier publishes them). A template flag keeps GDN free of the staging,
  // which measured 14% at B=1024 when it was a run-time branch.
  const float head_decay = PER_CHANNEL ? 1.f : __expf(p.g[nh]);
  if constexpr (PER_CHANNEL) {
    for (int i = t; i < K; i += kThreads) ds[i] = __expf(p.g[nh * K + i]);
  }
  const float beta = p.beta[nh];
  const QkScales sc = load_qk<T, K, kWarps>(p, n, h, qs, ks, red3);

  // Decay the tile and reduce both dot products in one pass.
  float pk[4] = {0.f, 0.f, 0.f, 0.f};
  float pq[4] = {0.f, 0.f, 0.f, 0.f};
  auto accumulate = [&](int j) {
    const int row = r + RG * j;
    const float decay = PER_CHANNEL ? ds[row] : head_decay;
    s[j].x *= decay;
    s[j].y *= decay;
    s[j].z *= decay;
    s[j].w *= decay;
    const float kr = ks[row], qr = qs[row];
    pk[0] += s[j].x * kr; pk[1] += s[j].y * kr; pk[2] += s[j].z * kr; pk[3] += s[j].w * kr;
    pq[0] += s[j].x * qr; pq[1] += s[j].y * qr; pq[2] += s[j].z * qr; pq[3] += s[j].w * qr;
  };
  if constexpr (tile_in_registers(VAR)) {
#pragma unroll
    for (int j = 0; j < R; ++j) accumulate(j);
  } else {
    // sm80: a thread reads back only what it copied itself, so its own wait_group suffices.
    if constexpr (VAR == Variant::kSm80) cp_async_wait<1>(); else mbar_wait(&bars[0], 0);
#pragma unroll
    for (int j = 0; j < R / 2; ++j) {
      s[j] = tile[(r + RG * j) * CG + c];
      accumulate(j);
    }
    if constexpr (VAR == Variant::kSm80) cp_async_wait<0>(); else mbar_wait(&bars[1], 0);
#pragma unroll
    for (int j = R / 2; j < R; ++j) {
      s[j] = tile[(r + RG * j) * CG + c];
      accumulate(j);
    }
  }

#pragma unroll
  for (int m = 0; m < 4; ++m) {
    pk[m] = warp_sum_rows<CG>(pk[m]);
    pq[m] = warp_sum_rows<CG>(pq[m]);
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
  float o[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    float tk = 0.f, tq = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      tk += red[w][c][m];
      tq += red[w][c][4 + m];
    }
    u[m] = beta * (vv[m] - tk * sc.k);
    o[m] = tq * sc.q + u[m] * sc.qk;
  }
  if (r == 0) {
#pragma unroll
    for (int m = 0; m < 4; ++m) out[m] = from_float<T>(o[m]);
  }
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int row = r + RG * j;
    const float kr = ks[row] * sc.k;
    float4 x = s[j];
    x.x += kr * u[0];
    x.y += kr * u[1];
    x.z += kr * u[2];
    x.w += kr * u[3];
    *reinterpret_cast<float4*>(S + int64_t(row) * p.V + 4 * c) = x;
  }
}

template <typename T, int K, int BV, Variant VAR, int MIN_BLOCKS>
int launch_tile(const GdnDecodeParams& p, cudaStream_t stream, bool cluster, size_t smem) {
  auto kernel = p.g_per_channel ? gdn_decode_tiled_kernel<T, K, BV, VAR, MIN_BLOCKS, true>
                                : gdn_decode_tiled_kernel<T, K, BV, VAR, MIN_BLOCKS, false>;
  const int64_t tiles = p.V / BV;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.N * p.HV * tiles));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (cluster && tiles <= 8) {
    // sm_90 thread-block clusters: the column tiles of one head run together on one GPC.
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(tiles);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, p));
}

// Resident blocks per SM of one build of the kernel on the current device (asked once).
template <typename T, int K, int BV, Variant VAR, int MIN_BLOCKS>
int resident_blocks(int device, size_t smem) {
  static int cached[64] = {};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int blocks = 0;
  // The GDN build stands for both: the KDA build differs by K floats of shared memory.
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, gdn_decode_tiled_kernel<T, K, BV, VAR, MIN_BLOCKS, false>,
                                                kThreads, smem);
  if (device >= 0 && device < 64 && blocks > 0) cached[device] = blocks;
  return blocks;
}

template <typename T, int K, Variant VAR>
int launch_tiled(const GdnDecodeParams& p, cudaStream_t stream) {
  constexpr int BV = kWideTileV;
  const bool cluster = VAR == Variant::kSm90 || VAR == Variant::kSm90Tma;
  const size_t smem = tile_in_registers(VAR) ? 0 : size_t(K) * BV * sizeof(float);
  const int device = p.device, sms = p.sm_count;
  const int64_t blocks = p.N * p.HV * (p.V / BV);
  const int free_fit = resident_blocks<T, K, BV, VAR, 1>(device, smem);
  const int squeezed_fit = resident_blocks<T, K, BV, VAR, kSqueezedBlocksPerSm>(device, smem);
  if (sms > 0 && free_fit > 0 && squeezed_fit > free_fit) {
    const int64_t free_waves = (blocks + int64_t(sms) * free_fit - 1) / (int64_t(sms) * free_fit);
    const int64_t squeezed_waves = (blocks + int64_t(sms) * squeezed_fit - 1) / (int64_t(sms) * squeezed_fit);
    // Only where the tail wave is a large share of the time: over many waves the spills cost more.
    if (squeezed_waves < free_waves && squeezed_waves <= 2) {
      return launch_tile<T, K, BV, VAR, kSqueezedBlocksPerSm>(p, stream, cluster, smem);
    }
  }
  return launch_tile<T, K, BV, VAR, 1>(p, stream, cluster, smem);
}

template <typename T, int K>
int launch_variant(const GdnDecodeParams& p, Variant v, cudaStream_t stream) {
  switch (v) {
    case Variant::kGeneric: return launch_tiled<T, K, Variant::kGeneric>(p, stream);
    case Variant::kSm80: return launch_tiled<T, K, Variant::kSm80>(p, stream);
    case Variant::kSm90Tma: return launch_tiled<T, K, Variant::kSm90Tma>(p, stream);
    case Variant::kSm90: return launch_tiled<T, K, Variant::kSm90>(p, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template <typename T>
int launch_k(const GdnDecodeParams& p, Variant v, cudaStream_t stream) {
  switch (p.K) {
    case 64: return launch_variant<T, 64>(p, v, stream);
    case 128: return launch_variant<T, 128>(p, v, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int launch_gdn_decode(const GdnDecodeParams& p, Variant v, void* stream) {
  if (p.N == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: return launch_k<float>(p, v, s);
    case DType::kFloat16: return launch_k<__half>(p, v, s);
    case DType::kBFloat16: return launch_k<__nv_bfloat16>(p, v, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace cudelta
