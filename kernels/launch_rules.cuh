// Which build of which kernel a launch takes, per layout, state dtype, head dim and batch. The
// rules were chosen by benchmarks/warp_sweep.cu (every build of the warp kernels, on one GPU,
// without torch), which includes this header; the numbers behind each threshold are in
// benchmarks/results-h100-kernel.md (and results-h200-kernel.md for the check on an H200), not here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "launch.h"
#include "common/host.cuh"
#include "block_kv.cuh"
#include "warp_kv.cuh"
#include "warp_vk.cuh"

namespace cudelta {
namespace {

// Layout vk: which build a launch of `pairs` (request, value head) pairs takes.
// Small batches are latency: short tiles, many warps, each with little dependent work. From a few
// pairs per SM the bytes in flight per warp decide: fp32 two 8-row tiles per warp, then one 8-row
// tile from 16 pairs per SM; bf16 16-row tiles. At mid batches (a few to 64 pairs per SM) the
// evict-first state (STREAM) pays; at B=1 (where the benchmark's state stays in L2 between steps)
// and at the largest batches it costs. Programmatic dependent launch (where the params allow it)
// pays on every build chosen here. The persistent grid (PERSIST) and the 32-row bf16 builds stay
// in the sweep only: since the loads are issued before any is used (load_bits), 16-row bf16 tiles
// are as fast or faster.
// The extra builds are for K = 128 only (Qwen3-Next, Kimi-Linear): each costs release compile time.
template <int K, typename ST>
int launch_vk_warp(const GdnDecodeParams& p, cudaStream_t stream) {
  if constexpr (K == 128) {
    const int64_t pairs = p.N * p.HV, sms = rule_sms(p);
    if constexpr (std::is_same_v<ST, float>) {
      if (pairs <= sms) return launch_vk_warp_rows<K, ST, 4>(p, stream);
      if (pairs <= 16 * sms) return launch_vk_warp_rows<K, ST, 8, 2, false, true>(p, stream);
      return launch_vk_warp_rows<K, ST, 8>(p, stream);
    } else {
      if (pairs <= sms / 2) return launch_vk_warp_rows<K, ST, 8>(p, stream);
      if (pairs <= 64 * sms) return launch_vk_warp_rows<K, ST, 16, 1, false, true>(p, stream);
      return launch_vk_warp_rows<K, ST, 16>(p, stream);
    }
  }
  return launch_vk_warp_rows<K, ST, warp_rows_big<K, ST>()>(p, stream);
}

// Layout kv (K = 64, 128): which warp build a launch takes. Four column chunks per tile (fp32 16
// columns, bf16 32) for small batches; fp32 past one (request, head) pair per SM: 32 columns
// (128-byte row segments, 254 registers) in blocks of two warps; bf16 past 4 pairs per SM: blocks
// of four warps (a head's whole rows at once). The evict-first state (STREAM) at mid batches, as
// for vk. Programmatic dependent launch costs the 4-chunk builds once the grid passes 4 warps per
// SM (the next step's early warps take the slots this one still needs) and pays below; the
// multi-warp blocks neither gain nor lose by it beyond noise. Extra builds for K = 128 only, as
// for vk.
template <int K, typename ST>
int launch_kv_warp(const GdnDecodeParams& p, cudaStream_t stream) {
  const int64_t pairs = p.N * p.HV, sms = rule_sms(p);
  GdnDecodeParams small = p;
  small.pdl = p.pdl && pairs * (p.V / KvWarpShape<K, ST, 4>::BW) <= 4 * sms;
  if constexpr (K == 128 && std::is_same_v<ST, float>) {
    if (pairs <= sms) return launch_kv_warp_cols<K, ST, 4>(small, stream);
    if (pairs <= 16 * sms) return launch_kv_warp_cols<K, ST, 8, 2, true>(p, stream);
    return launch_kv_warp_cols<K, ST, 8, 2>(p, stream);
  } else if constexpr (K == 128) {
    if (pairs <= sms / 2) return launch_kv_warp_cols<K, ST, 4>(small, stream);
    if (pairs <= 4 * sms) return launch_kv_warp_cols<K, ST, 4, 1, true>(small, stream);
    if (p.V % (4 * KvWarpShape<K, ST, 4>::BW) == 0) return launch_kv_warp_cols<K, ST, 4, 4>(p, stream);
  }
  return launch_kv_warp_cols<K, ST, 4>(small, stream);
}

// One layout and state dtype, every head dim: what each unit of kernels/units/ compiles.
template <typename ST>
int launch_vk(const GdnDecodeParams& p, cudaStream_t stream) {
  switch (p.K) {
    case 64: return launch_vk_warp<64, ST>(p, stream);
    case 128: return launch_vk_warp<128, ST>(p, stream);
    case 256: return launch_vk_warp<256, ST>(p, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template <typename ST>
int launch_kv(const GdnDecodeParams& p, cudaStream_t stream) {
  switch (p.K) {
    case 64: return launch_kv_warp<64, ST>(p, stream);
    case 128: return launch_kv_warp<128, ST>(p, stream);
    case 256: return launch_kv_block<256, ST>(p, stream);  // block_kv.cuh: why this shape keeps it
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace
}  // namespace cudelta
