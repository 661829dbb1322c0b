// The entry points of the kernel builds, one per layout and state dtype: defined in
// launch_rules.cuh, explicitly instantiated by one file each under kernels/units/, so ninja
// compiles the four sets of kernels in parallel and dispatch.cu compiles none of them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "launch.h"

namespace cudelta {

template <typename ST>
int launch_vk(const GdnDecodeParams& p, cudaStream_t stream);  // state [P, HV, V, K]
template <typename ST>
int launch_kv(const GdnDecodeParams& p, cudaStream_t stream);  // state [P, HV, K, V]

extern template int launch_vk<float>(const GdnDecodeParams&, cudaStream_t);
extern template int launch_vk<__nv_bfloat16>(const GdnDecodeParams&, cudaStream_t);
extern template int launch_kv<float>(const GdnDecodeParams&, cudaStream_t);
extern template int launch_kv<__nv_bfloat16>(const GdnDecodeParams&, cudaStream_t);

}  // namespace cudelta
