// The one entry of the device side: a batch split to what a grid can hold, then the variant's
// launch from the table (launch.h kVariants). The kernels themselves are compiled in
// kernels/units/; this file compiles none of them.
//
// The step is bandwidth bound (one read and one write of the state), so every option that costs no
// bytes is a run-time value (q/k/v dtype, raw or precomputed gates, the invalid-slot rule, strides)
// and only what shapes the state access is a template: the layout, the state dtype, K, the build's
// tile shape, and the per-channel decay (KDA).

#include <cuda_runtime.h>

#include <cstdint>

#include "common/host.cuh"
#include "launch.h"
#include "units.h"

namespace cudelta {
namespace {

// The warp kernels put requests on the grid's z dimension.
constexpr int64_t kMaxRequestsPerLaunch = kMaxGridYZ;

// Past this many (request, value head) pairs an SM, the step's state loads issued under the conv
// (GdnDecodeParams::early_state) overlap it only in the first of many waves, and they cost: 4.5%
// slower at B = 512, T = 2, bf16 state, 16/32 heads on an H200 (the streaming kernel; level at
// T = 1 and 4; benchmarks/results-h200-conv.md), against 0.5-1.1 us gained at B = 32 (8 an SM).
constexpr int64_t kEarlyStateMaxPairsPerSm = 64;

const void* advance(const void* p, int64_t elements, DType t) {
  return static_cast<const char*>(p) + elements * (t == DType::kFloat32 ? 4 : 2);
}

}  // namespace

// Variant "warp": the warp kernels for every shape, the kv block kernel for kv with K = 256.
int launch_warp(const GdnDecodeParams& p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (p.multi_token()) {
    switch (p.state_dtype) {
      case DType::kFloat32: return launch_mtp_float32(p, s);
      case DType::kBFloat16: return launch_mtp_bfloat16(p, s);
      default: return static_cast<int>(cudaErrorInvalidValue);
    }
  }
  switch (p.state_dtype) {
    case DType::kFloat32: return p.state_vk ? launch_vk_float32(p, s) : launch_kv_float32(p, s);
    case DType::kBFloat16: return p.state_vk ? launch_vk_bfloat16(p, s) : launch_kv_bfloat16(p, s);
    default: break;
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int launch_gdn_decode(const GdnDecodeParams& call, Variant v, void* stream) {
  if (call.N == 0) return 0;
  GdnDecodeParams p = call;
  p.early_state = call.early_state && call.N * call.HV <= kEarlyStateMaxPairsPerSm * rule_sms(call);
  const int id = static_cast<int>(v);
  if (id < 0 || id >= kNumVariants) return static_cast<int>(cudaErrorInvalidValue);
  // The multi-token kernels put requests on the grid's x dimension (2^31 - 1 blocks; launch_vk_one
  // keeps its one-warp grid, which holds them on z, to the calls that fit): no split.
  if (p.N > kMaxRequestsPerLaunch && !p.multi_token()) {
    // Requests are independent: launch them in chunks the grid can hold, each chunk's per-request
    // pointers advanced past the previous ones.
    for (int64_t n0 = 0; n0 < p.N; n0 += kMaxRequestsPerLaunch) {
      GdnDecodeParams c = p;
      c.early_state = p.early_state && n0 == 0;  // a later chunk follows the step, not the conv
      c.N = p.N - n0 < kMaxRequestsPerLaunch ? p.N - n0 : kMaxRequestsPerLaunch;
      c.q = advance(p.q, n0 * p.q_stride_n, p.dtype);
      c.k = advance(p.k, n0 * p.k_stride_n, p.dtype);
      c.v = advance(p.v, n0 * p.v_stride_n, p.dtype);
      c.out = const_cast<void*>(advance(p.out, n0 * p.out_stride_n, p.dtype));
      c.g = advance(p.g, n0 * p.g_stride_n, p.g_dtype);
      c.beta = advance(p.beta, n0 * p.beta_stride_n, p.beta_dtype);
      c.idx = static_cast<const char*>(p.idx) + n0 * (p.idx_is_int64 ? 8 : 4);
      const int err = kVariants[id].launch(c, stream);
      if (err != 0) return err;
    }
    return 0;
  }
  return kVariants[id].launch(p, stream);
}

}  // namespace cudelta
