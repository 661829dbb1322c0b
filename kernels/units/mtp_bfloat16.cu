// Several tokens per request and the epilogue, bfloat16 state, both layouts (kernels/units.h).
#include "../mtp.cuh"
#include "../units.h"

namespace cudelta {
int launch_mtp_bfloat16(const GdnDecodeParams& p, cudaStream_t stream) { return launch_mtp<__nv_bfloat16>(p, stream); }
}  // namespace cudelta
