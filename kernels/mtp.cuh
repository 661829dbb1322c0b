// Several tokens per request (speculative decoding), the state after each token stored to its
// checkpoint slot, the gated RMSNorm epilogue, one token with the contract's slots: launch_mtp picks
// one of four kernels. Each computes any call the rule gives it; the choice is speed only.
//   mtp_one.cuh       at most one token a request (layout vk, K = 128): warp_vk's step on the
//                     contract's slots, the epilogue in the block, in clusters or as a
//                     second launch
//   mtp_few.cuh       idx [N, 2], and [N, 3..4] with fp32 state or vLLM's bf16 call on sm_90 (GDN,
//                     layout vk, K = 128), in small grids: each warp's rows straight into registers
//                     with its tokens' inputs, no shared staging
//   mtp_stream.cuh    up to kStreamTokens checkpoint columns (kStreamLongTokens in vLLM's layout
//                     at K = 128): row chunks streamed through a cp.async ring, the pass's tokens
//                     staged in shared memory
//   mtp_resident.cuh  the head in fp32 registers: what a pass cannot hold (more checkpoint columns,
//                     long bf16 requests, long heads) and single tokens in small grids
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "mtp_one.cuh"
#include "mtp_resident.cuh"
#include "mtp_stream.cuh"
#include "mtp_few.cuh"

namespace cudelta {
namespace {

template <bool VK, int K, typename ST>
int launch_mtp_k(const GdnDecodeParams& p, cudaStream_t stream) {
  if constexpr (VK && K == 128) {
    if (one_token_call(p)) return launch_vk_one<ST>(p, stream);
    if (few_token_call<ST>(p)) return launch_vk_few<ST>(p, stream);
  }
  // About one token a request (rows <= requests: the epilogue alone, or vLLM's MTP call at T = 1) in
  // a grid of at most two heads per SM: the resident kernel has the shorter path there (no staging,
  // one barrier), and streaming gains nothing. Either kernel computes any call; this is speed only.
  const int64_t sms = rule_sms(p);
  const bool resident_first = (p.L <= p.N && p.N * p.HV <= 2 * sms) || p.V > kStreamMaxV<K>;
  if (p.idx_columns > kStreamTokens) {
    // More checkpoint columns than the 8-token pass stages. vLLM 0.34's nine-token call (9-16
    // columns in its layout) takes the long-pass build, which stages them all; beyond that only the
    // resident kernel carries the state across (a checkpoint slot may be invalid, so the streaming
    // kernel cannot carry it through one).
    if constexpr (VK && K == 128) {
      if (p.idx_columns <= kStreamLongTokens && !resident_first) return launch_mtp_stream<VK, K, ST, kStreamLongTokens>(p, stream);
    }
    return launch_mtp_rows<VK, K, ST, 16>(p, stream);
  }
  // A bf16 state with idx [N] where a request may have more tokens than a pass: the streaming
  // kernel would carry it from pass to pass through the slot, rounded to bf16 mid-request
  // (cu_seqlens is not read on the host: any request may then hold all L rows).
  const bool long_requests = p.idx_columns == 0 && (p.cu_seqlens != nullptr ? p.L : p.tokens) > kStreamTokens;
  if (resident_first || (!std::is_same_v<ST, float> && long_requests)) return launch_mtp_rows<VK, K, ST, 16>(p, stream);
  return launch_mtp_stream<VK, K, ST>(p, stream);
}

template <typename ST>
int launch_mtp(const GdnDecodeParams& p, cudaStream_t stream) {
  switch (p.K) {
    case 64: return p.state_vk ? launch_mtp_k<true, 64, ST>(p, stream) : launch_mtp_k<false, 64, ST>(p, stream);
    case 128: return p.state_vk ? launch_mtp_k<true, 128, ST>(p, stream) : launch_mtp_k<false, 128, ST>(p, stream);
    case 256: return p.state_vk ? launch_mtp_k<true, 256, ST>(p, stream) : launch_mtp_k<false, 256, ST>(p, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace
}  // namespace cudelta
