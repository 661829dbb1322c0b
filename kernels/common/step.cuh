// The math of one decode step that does not depend on how a kernel holds its tile: the gates
// (decay and beta, precomputed or raw), the q/k scales, which q/k head a value head reads, and
// which slots are live.
//
// Both reductions of the step (pred = h'^T k and h'^T q) are done in one pass over the decayed
// state h': with u = beta * (v - pred), the output of the updated state is
// o = (h' + k u^T)^T q = h'^T q + u * (k . q), so the updated state never has to be re-read.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../launch.h"
#include "dtype.cuh"
#include "ptx.cuh"

namespace cudelta {
namespace {

// pdl_enter where the step's first loads may not come before it: at the kernel's start, or, with
// GdnDecodeParams::early_state, after the state's loads are issued (the indices, the slots' rows and
// the outputs zeroed for skipped rows are nothing the conv before it reads or writes; its q, k and
// v are, and every load of them comes after pdl_wait_late). A kernel calls both, in that order.
__device__ __forceinline__ void pdl_wait_early(const GdnDecodeParams& p) {
  if (!p.early_state) pdl_enter();
}
__device__ __forceinline__ void pdl_wait_late(const GdnDecodeParams& p) {
  if (p.early_state) pdl_enter();
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
// loads of every input of the step before they widen any (load_bits); the block kernel takes both
// phases at once (load_decay, load_beta below). The decay is exp of the log-decay: the precomputed g,
// or -exp(A_log) * softplus(a + dt_bias) of the raw gate (lower_bound * sigmoid(exp(A_log) * (a +
// dt_bias)) where gate_lower_bound is set), per head (channel < 0) or per key channel (KDA). A_log is
// one per head (a_log_bits: 0 with precomputed gates).
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
// The decays of N gates of one head (its key channels, for KDA), straight-line over N. BOUNDED: the
// call site may see KDA's bounded gate; GDN's per-head sites pass false and compile no branch for it
// (it cost the GDN multi-token kernels 2-3% at T >= 2 on an H200).
template <int N, bool BOUNDED = true>
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
    const float a = __expf(widen_bits(a_log_bits, p.A_log_dtype));
    if (BOUNDED && p.gate_lower_bound < 0.f) {
#pragma unroll
      for (int m = 0; m < N; ++m) out[m] = p.gate_lower_bound * __frcp_rn(1.f + __expf(-a * (out[m] + bias[m])));
    } else {
#pragma unroll
      for (int m = 0; m < N; ++m) out[m] = -a * softplus20(out[m] + bias[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < N; ++m) out[m] = __expf(out[m]);
}
template <bool BOUNDED = true>
__device__ __forceinline__ float decay_of(const GdnDecodeParams& p, const DecayBits& b, uint32_t a_log_bits) {
  float d;
  decays<1, BOUNDED>(p, &b, a_log_bits, &d);
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

// The q and k scales of a step.
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

// The same from a lane's N channels of q and k: its three sums, then warp_qk_scales.
template <int FIRST, int END, int N>
__device__ __forceinline__ QkScales lane_qk_scales(const GdnDecodeParams& p, const float (&qv)[N], const float (&kv)[N]) {
  float sqq = 0.f, skk = 0.f, sqk = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    sqq += qv[j] * qv[j];
    skk += kv[j] * kv[j];
    sqk += qv[j] * kv[j];
  }
  return warp_qk_scales<FIRST, END>(p, sqq, skk, sqk);
}

// The same from channels held as A runs of B (warp_vk: CPL chunks of E), summed in the same order.
template <int FIRST, int END, int A, int B>
__device__ __forceinline__ QkScales lane_qk_scales(const GdnDecodeParams& p, const float (&qv)[A][B], const float (&kv)[A][B]) {
  float sqq = 0.f, skk = 0.f, sqk = 0.f;
#pragma unroll
  for (int i = 0; i < A; ++i) {
#pragma unroll
    for (int j = 0; j < B; ++j) {
      sqq += qv[i][j] * qv[i][j];
      skk += kv[i][j] * kv[i][j];
      sqk += qv[i][j] * kv[i][j];
    }
  }
  return warp_qk_scales<FIRST, END>(p, sqq, skk, sqk);
}

// The q/k head value head hv reads: HV is a multiple of H (grouped value heads), so this is
// hv / (HV / H). 32-bit: it is on the path to the q/k loads, and head counts are small.
__device__ __forceinline__ uint32_t qk_head(const GdnDecodeParams& p, uint32_t hv) {
  return hv * static_cast<uint32_t>(p.H) / static_cast<uint32_t>(p.HV);
}


__device__ __forceinline__ bool slot_valid(const GdnDecodeParams& p, int64_t slot) {
  return slot >= p.min_slot && slot < p.P;
}

}  // namespace
}  // namespace cudelta
