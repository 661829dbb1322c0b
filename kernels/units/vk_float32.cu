// Layout vk, float32 state: every build of its kernels (kernels/units.h).
#include "../launch_rules.cuh"
#include "../units.h"

namespace cudelta {
int launch_vk_float32(const GdnDecodeParams& p, cudaStream_t stream) { return launch_vk<float>(p, stream); }
}  // namespace cudelta
