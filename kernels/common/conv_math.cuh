// The causal-conv1d update's arithmetic for one channel, shared by the conv kernel
// (conv_update.cuh) and the one-token step that computes the conv outputs it reads (conv_in_step.cuh),
// so that both give the same bits.
#pragma once

#include <cuda_runtime.h>

namespace cudelta {
namespace {

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

}  // namespace
}  // namespace cudelta
