// Several tokens per request and the epilogue, float32 state, both layouts (kernels/units.h).
#include "../mtp.cuh"
#include "../units.h"

namespace cudelta {
int launch_mtp_float32(const GdnDecodeParams& p, cudaStream_t stream) { return launch_mtp<float>(p, stream); }
}  // namespace cudelta
