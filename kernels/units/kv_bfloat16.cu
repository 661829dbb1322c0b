// Layout kv, bfloat16 state: every build of its kernels (kernels/units.h).
#include "../launch_rules.cuh"
#include "../units.h"

namespace cudelta {
int launch_kv_bfloat16(const GdnDecodeParams& p, cudaStream_t stream) { return launch_kv<__nv_bfloat16>(p, stream); }
}  // namespace cudelta
