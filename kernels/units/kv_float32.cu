// Layout kv, float32 state: every build of its kernels (kernels/units.h).
#include "../launch_rules.cuh"
#include "../units.h"

namespace cudelta {
int launch_kv_float32(const GdnDecodeParams& p, cudaStream_t stream) { return launch_kv<float>(p, stream); }
}  // namespace cudelta
