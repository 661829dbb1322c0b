// Layout kv, float32 state: every build of its kernels (kernels/units.h).
#include "../launch_rules.cuh"
#include "../units.h"

namespace cudelta {
template int launch_kv<float>(const GdnDecodeParams&, cudaStream_t);
}  // namespace cudelta
