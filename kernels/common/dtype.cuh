// Element access with the dtype a run-time value: a uniform branch on the dtype is cheaper than
// another set of kernels. Loads are split from their widening (load_bits, then widen_*), so a warp
// can issue every load of a step before it waits on any; the 16-byte state chunks (Chunk) are the
// unit the kernels move the state in.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../launch.h"

namespace cudelta {
namespace {

__device__ __forceinline__ void store_f(void* p, DType t, int64_t i, float x) {
  switch (t) {
    case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<float*>(p)[i] = x; break;
  }
}

// Rounds x to the output dtype and back: the epilogue reads the output as stored (vLLM's order).
__device__ __forceinline__ float rounded(float x, DType t) {
  if (t == DType::kBFloat16) return __bfloat162float(__float2bfloat16_rn(x));
  if (t == DType::kFloat16) return __half2float(__float2half_rn(x));
  return x;
}

// --- loads apart from their widening (the warp kernels) -----------------------------------------
// A load inside a run-time dtype switch gets its first use (the widening to float) inside the same
// case, so the warp waits for it there, before it issues the next load: each load becomes a round
// trip of its own (ncu's stall samples: benchmarks/results-h100-kernel.md, "Numbers behind the
// kernels' comments"). These load raw bits (the dtype picks a predicated load, no use) and widen
// later, branch-free, so a warp issues every load first and waits once.

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

// --- indices: int32 or int64, a run-time choice ----------------------------------------------------
__device__ __forceinline__ int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}
// An index's bits (int32 in lo, or int64), loaded apart from its widening: a load under a condition
// is then not waited for where it is made (request_span).
struct IndexBits {
  uint32_t lo, hi;
};
__device__ __forceinline__ IndexBits load_index_bits(const void* p, bool is64, int64_t i) {
  IndexBits b;
  if (is64) {
    const uint2 x = static_cast<const uint2*>(p)[i];
    b.lo = x.x;
    b.hi = x.y;
  } else {
    b.lo = static_cast<const uint32_t*>(p)[i];
    b.hi = 0u;
  }
  return b;
}
__device__ __forceinline__ int64_t widen_index(IndexBits b, bool is64) {
  return is64 ? static_cast<int64_t>((uint64_t(b.hi) << 32) | b.lo) : static_cast<int64_t>(static_cast<int32_t>(b.lo));
}
// Element i with both words loaded at offsets that do not depend on the dtype's branch (an int32's
// one word twice), so a thread's index loads go out together (the conv update's request: slot,
// cu_seqlens and accepted count in one round trip).
__device__ __forceinline__ int64_t load_index_unbranched(const void* p, bool is64, int64_t i) {
  const int32_t* w = static_cast<const int32_t*>(p);
  const int32_t lo = w[is64 ? 2 * i : i], hi = w[is64 ? 2 * i + 1 : i];
  return is64 ? static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 32) | static_cast<uint32_t>(lo))
              : static_cast<int64_t>(lo);
}

// --- 16-byte state chunks: 4 fp32 or 8 bf16 (the warp kernels' unit) ----------------------------
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

}  // namespace
}  // namespace cudelta
