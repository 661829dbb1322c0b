// Layout vk, bfloat16 state: every build of its kernels (kernels/units.h).
#include "../launch_rules.cuh"
#include "../units.h"

namespace cudelta {
int launch_vk_bfloat16(const GdnDecodeParams& p, cudaStream_t stream) { return launch_vk<__nv_bfloat16>(p, stream); }
}  // namespace cudelta
