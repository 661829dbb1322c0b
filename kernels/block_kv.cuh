// The block kernel of layout "kv" [K, V], kept for one shape only: kv with K = 256. Every other
// shape runs the warp kernels. The kv warp kernel (warp_kv.cuh) has no K = 256 build: a lane holds
// NR = K / RPI consecutive rows of the state, q and k, so at K = 256 it would hold either 32 rows
// (4 chunks a tile: the registers of the K = 128 two-warp build, 254) or read 32-byte row segments
// (2 chunks, 16 rows), and neither has been measured against this kernel. Until a GPU run does,
// the shape keeps the kernel auto ran for it before.
//
// One block of 128 threads owns one (request n, value head hv) pair and a 32-wide tile of its value
// columns: thread t holds 4 columns 4*(t%8)..+3 of rows t/8 + 16 j, so a warp's vector accesses
// cover whole 32-column row segments; the reduction over k crosses warps (shuffles, then shared
// memory). The state stays in registers in its storage type (bf16 halves the registers) and is
// widened to fp32 where it is used.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"
#include "common/dtype.cuh"
#include "common/host.cuh"
#include "common/ptx.cuh"
#include "common/step.cuh"

namespace cudelta {
namespace {

constexpr int kBlockThreads = 128;
constexpr int kBlockWarps = kBlockThreads / 32;
// Value columns per block: more, smaller blocks measured slower at small batches
// (benchmarks/results-h100-kernel.md, "Numbers behind the kernels' comments").
constexpr int kTileV = 32;

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

// q and k of head h to shared memory as float, with the three dot products the step needs
// (|q|^2, |k|^2, q.k) reduced over the block. Every thread gets the same scales back. Its
// __syncthreads also publishes whatever the block wrote to shared memory before it.
template <int K, int THREADS = kBlockThreads>
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
  s.n = nh / p.HV;
  s.hv = nh - s.n * p.HV;
  s.h = qk_head(p, static_cast<uint32_t>(s.hv));
  s.slot = p.idx_is_int64 ? static_cast<const int64_t*>(p.idx)[s.n] : static_cast<const int32_t*>(p.idx)[s.n];
  return s;
}

__device__ __forceinline__ int64_t out_at(const GdnDecodeParams& p, const Site& s, int64_t col) {
  return s.n * p.out_stride_n + s.hv * p.out_stride_h + col;
}


template <int K, typename ST, bool PER_CHANNEL>
__global__ void __launch_bounds__(kBlockThreads, 1) decode_kv_kernel(const GdnDecodeParams p) {
  using V4 = Vec4<ST>;
  using Raw = typename V4::Raw;
  constexpr int BV = kTileV;
  constexpr int CG = BV / 4;              // column groups
  constexpr int RG = kBlockThreads / CG;  // row groups
  constexpr int R = K / RG;               // rows per thread
  pdl_enter();
  __shared__ float qs[K];
  __shared__ float ks[K];
  __shared__ float red3[kBlockWarps][3];
  __shared__ float ds[PER_CHANNEL ? K : 1];
  __shared__ float red[kBlockWarps][CG][8];

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
  ST* S = static_cast<ST*>(p.state) + site.slot * p.state_stride_p + site.hv * int64_t(K) * p.V + site.tile * BV;

  // The state tile goes first: its loads are in flight while the gates, q and k are read.
  Raw s[R];
#pragma unroll
  for (int j = 0; j < R; ++j) s[j] = *reinterpret_cast<const Raw*>(S + int64_t(r + RG * j) * p.V + 4 * c);

  float vv[4];
  const int64_t v_at = site.n * p.v_stride_n + site.hv * p.v_stride_h + col;
#pragma unroll
  for (int m = 0; m < 4; ++m) vv[m] = load_f(p.v, p.dtype, v_at + m);
  // GDN: one decay for the head, in a register. KDA: one per key channel (row), staged in shared
  // memory (load_qk's barrier publishes them). A template flag keeps GDN free of the staging, which
  // measured slower as a run-time branch.
  const float head_decay = PER_CHANNEL ? 1.f : load_decay(p, site.n, site.hv, -1);
  if constexpr (PER_CHANNEL) {
    for (int i = t; i < K; i += kBlockThreads) ds[i] = load_decay(p, site.n, site.hv, i);
  }
  const float beta = load_beta(p, site.n, site.hv);
  const QkScales sc = load_qk<K>(p, site.n, site.h, qs, ks, red3);

  // Decay the tile and reduce both dot products in one pass.
  float pk[4] = {0.f, 0.f, 0.f, 0.f};
  float pq[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int row = r + RG * j;
    const float decay = PER_CHANNEL ? ds[row] : head_decay;
    const float4 x = V4::widen(s[j]);
    const float kr = ks[row] * decay, qr = qs[row] * decay;
    pk[0] += x.x * kr; pk[1] += x.y * kr; pk[2] += x.z * kr; pk[3] += x.w * kr;
    pq[0] += x.x * qr; pq[1] += x.y * qr; pq[2] += x.z * qr; pq[3] += x.w * qr;
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
    for (int w = 0; w < kBlockWarps; ++w) {
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

// One block per (request, value head, 32-column tile); consecutive blocks take one head's tiles.
template <int K, typename ST>
int launch_kv_block(const GdnDecodeParams& p, cudaStream_t stream) {
  auto kernel = p.g_per_channel ? decode_kv_kernel<K, ST, true> : decode_kv_kernel<K, ST, false>;
  return launch_decode(kernel, dim3(static_cast<unsigned>(p.N * p.HV * (p.V / kTileV))), dim3(kBlockThreads), p,
                       stream);
}

}  // namespace
}  // namespace cudelta
