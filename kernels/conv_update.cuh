// The causal-conv1d update that precedes the step in vLLM's GDN layer, as a kernel of its own
// (cudelta/conv_reference.py is its semantics; ConvUpdateParams in launch.h its arguments). Not
// fused into the step: both fused steps built so far lost to this kernel and the step chained by
// programmatic dependent launch (ARCHITECTURE.md, "Not fused yet"), which is how an engine runs the
// layer's decode pair on cudelta's kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/host.cuh"
#include "common/ptx.cuh"
#include "launch.h"

namespace cudelta {
namespace {

constexpr int kConvThreads = 64;
// Tokens a thread loads before it computes any: a request's tokens in batches of this many (TB).
// The batch's registers bound the occupancy: at 8, 116 registers a thread at sm_90a (8 blocks of 64
// an SM), which capped the bytes in flight from B = 128. Where no request can have more than 2 tokens
// (one a row, or the conv state's columns leave room for no more: vLLM sizes them to the call) the
// build with a batch of 2 is taken, held to 64 registers (16 blocks an SM): 1.3x vLLM's conv at
// B = 512 where it had been 0.9x (benchmarks/results-h200-conv.md).
constexpr int kConvTokenBatch = 8;
constexpr int kConvShortBatch = 2;
// The shared-memory split every conv build asks the driver for, as a percentage of an SM's most:
// 57% of an H100's, H200's or B200's 228 KB is their 132 KB split. The conv needs no shared memory
// itself, but an SM changes its split only once drained: left to the driver the conv ran in a small
// one, and the step's blocks that need more, launched early by programmatic dependent launch to load
// their state under the conv, waited for the conv's last block on their SM instead. 132 KB holds
// the staged one-token kernel three blocks an SM (33 KB each with the 1 KB the driver keeps;
// tests/unit/test_kernel_spills.py holds it to that: KDA's build asks for three, GDN's for four,
// which after this conv still gained, benchmarks/results-h200-mtp.md) and GDN's multi-token kernels'
// 13-42 KB blocks.
// H200 (benchmarks/results-h200-kda.md, "The conv's split"): KDA's drop-in 0.4-0.5 µs faster at 384
// pairs and level elsewhere; GDN's conv + MTP call with bf16 state 0.8-0.9 µs faster at B = 8, T = 4
// and 8, with fp32 state 0.1-0.2 µs slower there (a step that fits the conv's split runs in it, with
// less L1). At 100% GDN's call at B = 32 lost 2.6 µs; at 57% on the step's launches too, the larger
// grids lost their L1.
constexpr int kConvCarveout = 57;

// Four consecutive elements of T (float, __nv_bfloat16 or __half) as one 16- or 8-byte vector: raw
// loads first, widened after, so a thread's loads go out together and it waits once. (A load whose
// width depends on a run-time dtype sits in a branch, and the warp waits for it where the branch
// joins: the vector path is compiled for each dtype instead.)
template <typename T>
struct Four {
  using Raw = std::conditional_t<std::is_same_v<T, float>, float4, uint2>;
  static __device__ __forceinline__ Raw load(const void* p, int64_t at) {
    return *reinterpret_cast<const Raw*>(static_cast<const T*>(p) + at);
  }
  static __device__ __forceinline__ void widen(const Raw& r, float* x) {
    if constexpr (std::is_same_v<T, float>) {
      x[0] = r.x; x[1] = r.y; x[2] = r.z; x[3] = r.w;
    } else {
      using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
      float2 a, b;
      if constexpr (std::is_same_v<T, __half>) {
        a = __half22float2(*reinterpret_cast<const T2*>(&r.x));
        b = __half22float2(*reinterpret_cast<const T2*>(&r.y));
      } else {
        a = __bfloat1622float2(*reinterpret_cast<const T2*>(&r.x));
        b = __bfloat1622float2(*reinterpret_cast<const T2*>(&r.y));
      }
      x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
    }
  }
  static __device__ __forceinline__ float to_float(T x) {
    if constexpr (std::is_same_v<T, float>) return x;
    else if constexpr (std::is_same_v<T, __half>) return __half2float(x);
    else return __bfloat162float(x);
  }
  static __device__ __forceinline__ float round(float x) {
    if constexpr (std::is_same_v<T, float>) return x;
    else if constexpr (std::is_same_v<T, __half>) return __half2float(__float2half_rn(x));
    else return __bfloat162float(__float2bfloat16_rn(x));
  }
  static __device__ __forceinline__ void store(void* p, int64_t at, const float* x) {
    if constexpr (std::is_same_v<T, float>) {
      *reinterpret_cast<float4*>(static_cast<float*>(p) + at) = make_float4(x[0], x[1], x[2], x[3]);
    } else {
      uint2 r;
      if constexpr (std::is_same_v<T, __half>) {
        const __half2 a = __floats2half2_rn(x[0], x[1]), b = __floats2half2_rn(x[2], x[3]);
        r = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
      } else {
        const __nv_bfloat162 a = __floats2bfloat162_rn(x[0], x[1]), b = __floats2bfloat162_rn(x[2], x[3]);
        r = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
      }
      *reinterpret_cast<uint2*>(static_cast<T*>(p) + at) = r;
    }
  }
};

// The element access of one build: T void, a channel a thread with every dtype a run-time value
// (predicated loads); T a dtype, four channels a thread as vectors, x, the state, the weight and the
// bias all of T (the launch picks it where p.vec holds: vLLM's bf16 layer).
template <typename T>
struct ConvAccess {
  static constexpr int C = 4;
  using Raw = typename Four<T>::Raw;
  // The thread's W taps of its 4 channels (weight [dim, W] contiguous, of T) as 8-byte vectors, and
  // its bias, as loaded: widen_weights waits for them.
  template <int W>
  struct Weights {
    static constexpr int kUnits = W * C * static_cast<int>(sizeof(T)) / 8;
    uint2 r[kUnits];
    Raw rb;
  };
  template <int W>
  static __device__ __forceinline__ Weights<W> load_weights(const ConvUpdateParams& p, int64_t c) {
    Weights<W> raw;
    const uint2* src = reinterpret_cast<const uint2*>(static_cast<const T*>(p.weight) + c * W);
#pragma unroll
    for (int i = 0; i < Weights<W>::kUnits; ++i) raw.r[i] = src[i];
    raw.rb = Raw{};
    if (p.bias) raw.rb = Four<T>::load(p.bias, c);
    return raw;
  }
  template <int W>
  static __device__ __forceinline__ void widen_weights(const ConvUpdateParams& p, const Weights<W>& raw,
                                                       float (&w)[C][W], float (&b)[C]) {
    const T* e = reinterpret_cast<const T*>(raw.r);
#pragma unroll
    for (int m = 0; m < C; ++m)
#pragma unroll
      for (int j = 0; j < W; ++j) w[m][j] = Four<T>::to_float(e[m * W + j]);
    if (p.bias) Four<T>::widen(raw.rb, b);
  }
  static __device__ __forceinline__ Raw load_x(const ConvUpdateParams& p, int64_t row, int64_t c) {
    return Four<T>::load(p.x, row * p.x_stride_row + c);
  }
  static __device__ __forceinline__ Raw load_state(const ConvUpdateParams& p, const void* col0, int64_t col) {
    return Four<T>::load(col0, col * p.cs_col);
  }
  static __device__ __forceinline__ void widen(const ConvUpdateParams&, const Raw& r, DType, float* x) {
    Four<T>::widen(r, x);
  }
  static __device__ __forceinline__ float to_state(const ConvUpdateParams&, float x) { return Four<T>::round(x); }
  static __device__ __forceinline__ void store_out(const ConvUpdateParams& p, int64_t row, int64_t c, const float* y) {
    Four<T>::store(p.out, row * p.out_stride_row + c, y);
  }
  static __device__ __forceinline__ void store_state(const ConvUpdateParams& p, void* col0, int64_t col, const float* v) {
    Four<T>::store(col0, col * p.cs_col, v);
  }
};
// vLLM's Kimi K3 KDA decode weight as the layer keeps it (fp32, [3, W, dim / 3]: each of q, k and v
// tap-major) beside bf16 x, state and out: ConvAccess<T>'s four channels a thread, the 4 channels'
// tap j one 16-byte vector (a channel a thread, the scalar build, took 3.5x the time of this at B =
// 512 on an H200: benchmarks/kda_parts.py). The bias, if any, fp32.
template <typename T>
struct ConvAccessF32Taps : ConvAccess<T> {
  static constexpr int C = 4;
  template <int W>
  struct Weights {
    float4 r[W];
    float4 rb;
  };
  template <int W>
  static __device__ __forceinline__ Weights<W> load_weights(const ConvUpdateParams& p, int64_t c) {
    Weights<W> raw;
    const float* src = static_cast<const float*>(p.weight) + (c / p.w_seg) * p.w_stride_seg + (c % p.w_seg);
#pragma unroll
    for (int j = 0; j < W; ++j) raw.r[j] = *reinterpret_cast<const float4*>(src + j * p.w_stride_tap);
    raw.rb = make_float4(0.f, 0.f, 0.f, 0.f);
    if (p.bias) raw.rb = *reinterpret_cast<const float4*>(static_cast<const float*>(p.bias) + c);
    return raw;
  }
  template <int W>
  static __device__ __forceinline__ void widen_weights(const ConvUpdateParams& p, const Weights<W>& raw,
                                                       float (&w)[C][W], float (&b)[C]) {
#pragma unroll
    for (int j = 0; j < W; ++j) {
      w[0][j] = raw.r[j].x;
      w[1][j] = raw.r[j].y;
      w[2][j] = raw.r[j].z;
      w[3][j] = raw.r[j].w;
    }
    if (p.bias) {
      b[0] = raw.rb.x;
      b[1] = raw.rb.y;
      b[2] = raw.rb.z;
      b[3] = raw.rb.w;
    }
  }
};

template <>
struct ConvAccess<void> {
  static constexpr int C = 1;
  using Raw = uint32_t;
  template <int W>
  struct Weights {
    uint32_t bits[W];
    uint32_t bb;
  };
  template <int W>
  static __device__ __forceinline__ Weights<W> load_weights(const ConvUpdateParams& p, int64_t c) {
    Weights<W> raw;
    const int64_t at = (c / p.w_seg) * p.w_stride_seg + (c % p.w_seg) * p.w_stride_dim;
#pragma unroll
    for (int j = 0; j < W; ++j) raw.bits[j] = load_bits(p.weight, p.weight_dtype, at + j * p.w_stride_tap);
    raw.bb = 0;
    if (p.bias) raw.bb = load_bits(p.bias, p.bias_dtype, c);
    return raw;
  }
  template <int W>
  static __device__ __forceinline__ void widen_weights(const ConvUpdateParams& p, const Weights<W>& raw,
                                                       float (&w)[C][W], float (&b)[C]) {
    widen_all<W>(raw.bits, p.weight_dtype, w[0]);
    if (p.bias) b[0] = widen_bits(raw.bb, p.bias_dtype);
  }
  static __device__ __forceinline__ Raw load_x(const ConvUpdateParams& p, int64_t row, int64_t c) {
    return load_bits(p.x, p.x_dtype, row * p.x_stride_row + c);
  }
  static __device__ __forceinline__ Raw load_state(const ConvUpdateParams& p, const void* col0, int64_t col) {
    return load_bits(col0, p.state_dtype, col * p.cs_col);
  }
  static __device__ __forceinline__ void widen(const ConvUpdateParams&, const Raw& r, DType t, float* x) {
    *x = widen_bits(r, t);
  }
  static __device__ __forceinline__ float to_state(const ConvUpdateParams& p, float x) { return rounded(x, p.state_dtype); }
  static __device__ __forceinline__ void store_out(const ConvUpdateParams& p, int64_t row, int64_t c, const float* y) {
    store_f(p.out, p.x_dtype, row * p.out_stride_row + c, *y);
  }
  static __device__ __forceinline__ void store_state(const ConvUpdateParams& p, void* col0, int64_t col, const float* v) {
    store_f(col0, p.state_dtype, col * p.cs_col, *v);
  }
};

// One channel's output from its W weights, the W values of its sequence (seq(j): the window's
// columns, then the token) and its bias: the products summed in tap order, then the bias, the
// reference's order without contraction; SiLU with the fast exp and division (a few fp32 ulps, under
// the output's rounding: the precise ones were most of a token's latency chain where few warps share
// an SM). SiLU is computed whether asked or not, then selected: written `silu ? f(s) : s`, ptxas put a
// branch around each channel's exp and reciprocal, and a token's 4 channels ran one after another
// (H100, 16/32 heads, the conv alone: B = 1 T = 4 / 8 3.06 / 3.94 -> 2.50 / 2.96 µs, vLLM's 2.55 /
// 3.11; B = 512 T = 4 / 8 65.0 / 97.2 -> 60.0 / 91.0; B = 32 T = 1 / 2 1-2% slower). Computing a batch's
// tokens without the branch out of the loop at the request's end also let the tokens interleave,
// but took 152 registers a thread (116 with it, bf16 at sm_90a) and was 12-53% slower than before
// from B = 32 at T = 4 / 8 (benchmarks/results-h100-90d34eb.md).
template <int W, typename Seq>
__device__ __forceinline__ float conv_output(const float (&w)[W], const Seq& seq, float bias, bool silu) {
  float s = __fmul_rn(w[0], seq(0));
#pragma unroll
  for (int j = 1; j < W; ++j) s = __fadd_rn(s, __fmul_rn(w[j], seq(j)));
  s = __fadd_rn(bias, s);
  const float activated = __fdividef(s, 1.f + __expf(-s));
  return silu ? activated : s;
}

// Request n's slot, rows [bos, eos) of x and the window's first column off: their loads go out
// together (load_index_unbranched).
struct Request {
  int64_t slot, bos, eos, off;
};
__device__ __forceinline__ Request load_request(const ConvUpdateParams& p, int64_t n) {
  Request r{load_index_unbranched(p.indices, p.indices_int64, n * p.indices_stride), n, n + 1, 0};
  if (p.cu_seqlens) {
    r.bos = load_index_unbranched(p.cu_seqlens, p.cu_int64, n);
    r.eos = load_index_unbranched(p.cu_seqlens, p.cu_int64, n + 1);
    r.off = load_index_unbranched(p.accepted, p.accepted_int64, n) - 1;
  }
  return r;
}

// A thread a (request, C consecutive channels): the channels' windows (W - 1 columns of the slot,
// from column num_accepted - 1), weights and tokens in registers, then the request's tokens in
// order. Every read of the slot comes before its first write, and no other thread touches the
// channels' columns, so the update is safe in place and the output may alias x. A request the pool
// cannot hold (a slot out of range, rows outside x, a window or new state past state_len) is skipped
// like a null slot: the reference raises for it, which a kernel cannot without a host sync, and
// nothing is half-written.
template <int W, typename A, int TB>
__device__ __forceinline__ void conv_update(const ConvUpdateParams& p) {
  constexpr int C = A::C;
  pdl_enter();
  const int64_t c = (int64_t(blockIdx.x) * kConvThreads + threadIdx.x) * C;
  if (c >= p.dim) return;
  // The first request's slot and span are loaded before the weights are widened, which waits for
  // them: otherwise the weights, then the indices, then the window are three trips to memory in a
  // row where the indices and the weights can share the first (sm_90a SASS: the index loads had
  // followed the wait; the latency that counts at small batch, where every thread waits on it).
  const auto raw = A::template load_weights<W>(p, c);
  Request r = load_request(p, blockIdx.y);
  float w[C][W], b[C] = {};
  A::template widen_weights<W>(p, raw, w, b);
  char* const cs = static_cast<char*>(p.conv_state);
  const int64_t es = p.state_dtype == DType::kFloat32 ? 4 : 2;
  for (int64_t n = blockIdx.y; n < p.N; n += gridDim.y) {
    if (n != blockIdx.y) r = load_request(p, n);
    const int64_t slot = r.slot, bos = r.bos, eos = r.eos, off = r.off;
    const int64_t tokens = eos - bos;
    if (slot == p.null_block_id || slot < 0 || slot >= p.slots || tokens <= 0 || bos < 0 || eos > p.L || off < 0 ||
        off + W - 1 > p.state_len || W - 2 + tokens > p.state_len)
      continue;
    void* const col0 = cs + (slot * p.cs_slot + c * p.cs_dim) * es;  // the channels' column 0
    float win[W - 1 + TB][C];  // the window, then a batch of tokens
    for (int64_t t0 = 0; t0 < tokens; t0 += TB) {
      const int batch = static_cast<int>(tokens - t0 < TB ? tokens - t0 : TB);
      typename A::Raw xr[TB], sr[W - 1];
#pragma unroll
      for (int t = 0; t < TB; ++t)
        if (t < batch) xr[t] = A::load_x(p, bos + t0 + t, c);
      if (t0 == 0) {
#pragma unroll
        for (int j = 0; j < W - 1; ++j) sr[j] = A::load_state(p, col0, off + j);
#pragma unroll
        for (int j = 0; j < W - 1; ++j) A::widen(p, sr[j], p.state_dtype, win[j]);
        // The window's last W - 2 columns move to the front: the state after the request is the
        // sequence (window, tokens) without its first column.
#pragma unroll
        for (int j = 1; j < W - 1; ++j) A::store_state(p, col0, j - 1, win[j]);
      }
#pragma unroll
      for (int t = 0; t < TB; ++t) {
        if (t >= batch) break;
        A::widen(p, xr[t], p.x_dtype, win[W - 1 + t]);
        float y[C];
#pragma unroll
        for (int m = 0; m < C; ++m) {
          const float xt = A::to_state(p, win[W - 1 + t][m]);  // x as the state's dtype, as vLLM converts it
          win[W - 1 + t][m] = xt;
          y[m] = A::to_state(p, conv_output<W>(w[m], [&](int j) { return win[t + j][m]; }, b[m], p.silu));
        }
        A::store_out(p, bos + t0 + t, c, y);
        A::store_state(p, col0, W - 2 + t0 + t, win[W - 1 + t]);
      }
      // A full batch's last W - 1 values open the next batch's window (only a full batch has a next).
#pragma unroll
      for (int j = 0; j < W - 1; ++j)
#pragma unroll
        for (int m = 0; m < C; ++m) win[j][m] = win[TB + j][m];
    }
  }
}

template <int W, typename T, int TB>
__global__ void __launch_bounds__(kConvThreads, TB <= kConvShortBatch ? 16 : 1) conv_update_kernel(const ConvUpdateParams p) {
  conv_update<W, ConvAccess<T>, TB>(p);
}
// vLLM's KDA layer step (ConvAccessF32Taps): bf16, one token a row.
template <int W, int TB>
__global__ void __launch_bounds__(kConvThreads, TB <= kConvShortBatch ? 16 : 1) conv_update_f32_taps_kernel(
    const ConvUpdateParams p) {
  conv_update<W, ConvAccessF32Taps<__nv_bfloat16>, TB>(p);
}

// The same on vLLM's DS pages (p.f32_taps_ds): a slot's conv state [dim, 3], so a thread's 4
// channels' windows are 12 consecutive bf16, read as three 8-byte vectors and written back
// shifted, with the token, as three more. Width 4, one token a row (no cu_seqlens: the window
// starts at column 0). Column by column (ConvAccess's loop) they were 24 two-byte accesses a thread
// and the drop-in stayed at 0.86-0.89x vLLM's op from B = 32 (benchmarks/results-h200-kda.md); the
// arithmetic is conv_update's, in its order.
__global__ void __launch_bounds__(kConvThreads, 16) conv_update_f32_taps_ds_kernel(const ConvUpdateParams p) {
  constexpr int W = 4, C = 4;
  using A = ConvAccessF32Taps<__nv_bfloat16>;
  pdl_enter();
  const int64_t c = (int64_t(blockIdx.x) * kConvThreads + threadIdx.x) * C;
  if (c >= p.dim) return;
  const auto raw = A::load_weights<W>(p, c);
  Request r = load_request(p, blockIdx.y);
  float w[C][W], b[C] = {};
  A::widen_weights<W>(p, raw, w, b);
  char* const cs = static_cast<char*>(p.conv_state);
  for (int64_t n = blockIdx.y; n < p.N; n += gridDim.y) {
    if (n != blockIdx.y) r = load_request(p, n);
    const int64_t slot = r.slot;
    if (slot == p.null_block_id || slot < 0 || slot >= p.slots || n >= p.L) continue;
    uint2* const win_at = reinterpret_cast<uint2*>(cs + (slot * p.cs_slot + c * p.cs_dim) * 2);
    const uint2 xr = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.x) + n * p.x_stride_row + c);
    uint2 v[W - 1];
#pragma unroll
    for (int i = 0; i < W - 1; ++i) v[i] = win_at[i];
    // Channel m's column j is element m * 3 + j of the 12.
    float e[C * (W - 1)], xt[C];
#pragma unroll
    for (int i = 0; i < W - 1; ++i) Four<__nv_bfloat16>::widen(v[i], e + 4 * i);
    Four<__nv_bfloat16>::widen(xr, xt);
    float y[C], next[C * (W - 1)];
#pragma unroll
    for (int m = 0; m < C; ++m) {
      const float seq[W] = {e[m * 3], e[m * 3 + 1], e[m * 3 + 2], xt[m]};
      y[m] = conv_output<W>(w[m], [&](int j) { return seq[j]; }, b[m], p.silu);
#pragma unroll
      for (int j = 0; j < W - 1; ++j) next[m * 3 + j] = seq[j + 1];
    }
    Four<__nv_bfloat16>::store(p.out, n * p.out_stride_row + c, y);
#pragma unroll
    for (int i = 0; i < W - 1; ++i) Four<__nv_bfloat16>::store(win_at, 4 * i, next + 4 * i);
  }
}

template <int W, typename T, int TB = kConvTokenBatch, bool F32_TAPS = false, bool DS = false>
int launch_conv_build(const ConvUpdateParams& p, cudaStream_t stream) {
  constexpr int C = ConvAccess<T>::C;
  cudaLaunchConfig_t cfg = {};
  const int64_t threads = (p.dim + C - 1) / C;
  cfg.gridDim = dim3(static_cast<unsigned>((threads + kConvThreads - 1) / kConvThreads),
                     static_cast<unsigned>(p.N < kMaxGridYZ ? p.N : kMaxGridYZ), 1);
  cfg.blockDim = dim3(kConvThreads, 1, 1);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  cfg.attrs = attr;
  cfg.numAttrs = add_pdl(p.pdl, attr, 0);
  constexpr auto kernel = [] {
    if constexpr (DS) return &conv_update_f32_taps_ds_kernel;
    else if constexpr (F32_TAPS) return &conv_update_f32_taps_kernel<W, TB>;
    else return &conv_update_kernel<W, T, TB>;
  }();
  prefer_carveout<kernel>(p.device, kConvCarveout);
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, p));
}

// Four channels a thread as vectors where p.vec holds (the dtypes agree, every run is aligned);
// else a channel a thread.
template <int W>
int launch_conv_width(const ConvUpdateParams& p, cudaStream_t stream) {
  if constexpr (W == 4) {
    if (p.f32_taps) return launch_conv_build<W, __nv_bfloat16, kConvShortBatch, true>(p, stream);
    if (p.f32_taps_ds) return launch_conv_build<W, __nv_bfloat16, kConvShortBatch, true, true>(p, stream);
  }
  if (p.vec) {
    // At most this many tokens a request: one without cu_seqlens, else what the window leaves of
    // the state's columns (a request with more is skipped by the kernel either way).
    const bool short_calls = !p.cu_seqlens || p.state_len - (W - 2) <= kConvShortBatch;
    switch (p.state_dtype) {
      case DType::kBFloat16:
        return short_calls ? launch_conv_build<W, __nv_bfloat16, kConvShortBatch>(p, stream)
                           : launch_conv_build<W, __nv_bfloat16>(p, stream);
      case DType::kFloat16:
        return short_calls ? launch_conv_build<W, __half, kConvShortBatch>(p, stream)
                           : launch_conv_build<W, __half>(p, stream);
      case DType::kFloat32:
        return short_calls ? launch_conv_build<W, float, kConvShortBatch>(p, stream)
                           : launch_conv_build<W, float>(p, stream);
    }
  }
  return launch_conv_build<W, void>(p, stream);
}

}  // namespace
}  // namespace cudelta
