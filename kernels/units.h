// The entry points of the kernel builds, one per layout and state dtype, each defined by one file
// of kernels/units/ (its launch_vk<ST> or launch_kv<ST>, launch_rules.cuh), so ninja compiles the
// four sets of kernels in parallel and dispatch.cu compiles none of them.
//
// Everything in the kernel headers is in an unnamed namespace: internal to its unit, as when one
// file held it all, so no template instance is exported from the library. These four are hidden
// too: only the library itself calls them.
#pragma once

#include <cuda_runtime.h>

#include "launch.h"

namespace cudelta {

#define CUDELTA_UNIT_ENTRY __attribute__((visibility("hidden"))) int
CUDELTA_UNIT_ENTRY launch_vk_float32(const GdnDecodeParams& p, cudaStream_t stream);   // state [P, HV, V, K]
CUDELTA_UNIT_ENTRY launch_vk_bfloat16(const GdnDecodeParams& p, cudaStream_t stream);
CUDELTA_UNIT_ENTRY launch_kv_float32(const GdnDecodeParams& p, cudaStream_t stream);   // state [P, HV, K, V]
CUDELTA_UNIT_ENTRY launch_kv_bfloat16(const GdnDecodeParams& p, cudaStream_t stream);
// Several tokens per request and the epilogue (kernels/mtp.cuh), one unit per state dtype.
CUDELTA_UNIT_ENTRY launch_mtp_float32(const GdnDecodeParams& p, cudaStream_t stream);
CUDELTA_UNIT_ENTRY launch_mtp_bfloat16(const GdnDecodeParams& p, cudaStream_t stream);
#undef CUDELTA_UNIT_ENTRY

}  // namespace cudelta
