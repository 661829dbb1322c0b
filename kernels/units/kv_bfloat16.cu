// Layout kv, bfloat16 state: every build of its kernels (kernels/units.h).
#include "../launch_rules.cuh"
#include "../units.h"

namespace cudelta {
template int launch_kv<__nv_bfloat16>(const GdnDecodeParams&, cudaStream_t);
}  // namespace cudelta
