// The conv outputs a one-token step reads, computed by the step itself from the conv's inputs
// (GdnDecodeParams::conv_state): vLLM's layer runs the causal-conv1d update on mixed_qkv and then
// the step on its outputs, and here the step reads the pre-conv row, the window and the weights in
// the loads it already issues before any use, so no launch waits on another and the conv outputs
// never go through memory. The conv state's shift is left to the conv kernel's state-only pass
// (conv_update.cuh, after_step). The arithmetic is conv_output's, in the conv kernel's order, each
// output rounded to bf16 as that kernel stores it: the step sees the bits it would have read.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"
#include "common/conv_math.cuh"
#include "common/dtype.cuh"

namespace cudelta {
namespace {

constexpr int kConvInStepWidth = 4;

// The conv's inputs of E consecutive channels beside the token's own (the run the step loads as q's
// or k's): the window's three columns, the channels' 4 taps (E * 8 bytes) and their bias, as loaded.
template <int E>
struct ConvRunBits {
  RunBits<E> win[kConvInStepWidth - 1];
  uint4 w[E / 2];
  RunBits<E> bias;
};

__device__ __forceinline__ const __nv_bfloat16* conv_col(const GdnDecodeParams& p, int64_t slot, int j) {
  return static_cast<const __nv_bfloat16*>(p.conv_state) + slot * p.conv_cs_slot + j * p.conv_cs_col;
}

template <int E>
__device__ __forceinline__ ConvRunBits<E> conv_run_load(const GdnDecodeParams& p, int64_t slot, int64_t c) {
  ConvRunBits<E> b;
#pragma unroll
  for (int j = 0; j < kConvInStepWidth - 1; ++j) b.win[j] = load_run_bits<E>(conv_col(p, slot, j), DType::kBFloat16, c, true);
  const uint4* w = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.conv_weight) + c * kConvInStepWidth);
#pragma unroll
  for (int i = 0; i < E / 2; ++i) b.w[i] = w[i];
  b.bias = RunBits<E>{};
  if (p.conv_bias) b.bias = load_run_bits<E>(p.conv_bias, DType::kBFloat16, c, true);
  return b;
}

__device__ __forceinline__ float bf16_bits_to_float(uint32_t lo16) { return __uint_as_float(lo16 << 16); }
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Channel m's output from its sequence (the window's columns, then the token x).
__device__ __forceinline__ float conv_in_step_output(const GdnDecodeParams& p, const float (&w)[kConvInStepWidth],
                                                     const float (&seq)[kConvInStepWidth], float bias) {
  return round_bf16(conv_output<kConvInStepWidth>(w, [&](int j) { return seq[j]; }, bias, p.conv_silu));
}

// The E outputs of a run: x the token's bits of those channels (the step's q or k run).
template <int E>
__device__ __forceinline__ void conv_run_values(const GdnDecodeParams& p, const RunBits<E>& x_bits,
                                                const ConvRunBits<E>& b, float* y) {
  float x[E], win[kConvInStepWidth - 1][E], bias[E] = {};
  widen_run<E>(x_bits, DType::kBFloat16, true, x);
#pragma unroll
  for (int j = 0; j < kConvInStepWidth - 1; ++j) widen_run<E>(b.win[j], DType::kBFloat16, true, win[j]);
  if (p.conv_bias) widen_run<E>(b.bias, DType::kBFloat16, true, bias);
  const uint32_t* taps = reinterpret_cast<const uint32_t*>(b.w);  // channel m's tap j: bf16 m * 4 + j
#pragma unroll
  for (int m = 0; m < E; ++m) {
    float w[kConvInStepWidth];
#pragma unroll
    for (int j = 0; j < kConvInStepWidth; ++j) {
      const uint32_t word = taps[(m * kConvInStepWidth + j) / 2];
      w[j] = bf16_bits_to_float((m * kConvInStepWidth + j) % 2 ? word >> 16 : word & 0xffffu);
    }
    const float seq[kConvInStepWidth] = {win[0][m], win[1][m], win[2][m], x[m]};
    y[m] = conv_in_step_output(p, w, seq, bias[m]);
  }
}

// The same for one channel (v's: a row a lane), its x the step's v bits.
struct ConvOneBits {
  uint32_t win[kConvInStepWidth - 1];
  uint2 w;
  uint32_t bias;
};

__device__ __forceinline__ ConvOneBits conv_one_load(const GdnDecodeParams& p, int64_t slot, int64_t c) {
  ConvOneBits b;
#pragma unroll
  for (int j = 0; j < kConvInStepWidth - 1; ++j) b.win[j] = load_bits(conv_col(p, slot, j), DType::kBFloat16, c);
  b.w = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.conv_weight) + c * kConvInStepWidth);
  b.bias = p.conv_bias ? load_bits(p.conv_bias, DType::kBFloat16, c) : 0u;
  return b;
}

__device__ __forceinline__ float conv_one_value(const GdnDecodeParams& p, uint32_t x_bits, const ConvOneBits& b) {
  const float w[kConvInStepWidth] = {bf16_bits_to_float(b.w.x & 0xffffu), bf16_bits_to_float(b.w.x >> 16),
                                     bf16_bits_to_float(b.w.y & 0xffffu), bf16_bits_to_float(b.w.y >> 16)};
  const float seq[kConvInStepWidth] = {bf16_bits_to_float(b.win[0]), bf16_bits_to_float(b.win[1]),
                                       bf16_bits_to_float(b.win[2]), bf16_bits_to_float(x_bits)};
  return conv_in_step_output(p, w, seq, p.conv_bias ? bf16_bits_to_float(b.bias) : 0.f);
}

}  // namespace
}  // namespace cudelta
