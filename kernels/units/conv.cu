// The causal-conv1d update (kernels/conv_update.cuh): widths 2 to 4, vLLM's models use 4.
#include "../conv_update.cuh"
#include "../launch.h"

namespace cudelta {
int launch_conv_update(const ConvUpdateParams& p, void* stream) {
  if (p.N == 0 || p.dim == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.width) {
    case 2: return launch_conv_width<2>(p, s);
    case 3: return launch_conv_width<3>(p, s);
    case 4: return launch_conv_width<4>(p, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}
}  // namespace cudelta
