// The plain C++ boundary between host code (csrc/, LibTorch stable ABI) and device code
// (kernels/, CUDA). No torch and no CUDA headers here, so each side compiles without the other.
#pragma once

#include <cstdint>

namespace cudelta {

enum class Variant : int {
  kGeneric = 0,  // plain vectorised loads: any arch
  kSm80 = 1,     // cp.async state tiles overlapped with the q/k prologue: sm_80+
  kSm90 = 2,     // thread-block clusters: a head's column tiles co-scheduled on one GPC: sm_90+
  kSm90Tma = 3,  // clusters + cp.async.bulk (TMA engine) row copies on mbarriers: sm_90+
};
constexpr int kNumVariants = 4;
const char* variant_name(Variant v);
// What auto picks for an image (__CUDA_ARCH__) and a launch of `heads` (request, head) pairs.
Variant auto_variant(int image_arch, int64_t heads);
// Lowest __CUDA_ARCH__ of an image that contains the variant's device code.
int variant_min_arch(Variant v);

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct GdnDecodeParams {
  // q, k [N, H, K]; v [N, HV, V]: innermost dim contiguous, strides in elements.
  const void* q;
  const void* k;
  const void* v;
  int64_t q_stride_n, q_stride_h;
  int64_t k_stride_n, k_stride_h;
  int64_t v_stride_n, v_stride_h;
  DType dtype;
  const float* g;     // log-decay, contiguous: [N, HV] (GDN) or per channel [N, HV, K] (KDA)
  bool g_per_channel;
  const float* beta;  // [N, HV], contiguous
  float* state;       // [P, HV, K, V] contiguous, updated in place
  const void* idx;    // [N] slot of each request; < 0 or >= P: skipped, output zero
  bool idx_is_int64;
  void* out;          // [N, HV, V] contiguous, dtype of v
  int64_t N, H, HV, K, V, P;
  float scale;
  bool use_qk_l2norm;
  int device;    // the CUDA device of the tensors (current while launching)
  int sm_count;  // its multiprocessors, from the cached probe: no driver query per launch
};

// Launch on `stream` (a cudaStream_t). Returns 0 or a cudaError_t value.
int launch_gdn_decode(const GdnDecodeParams& p, Variant variant, void* stream);

// Compute capability (major * 10 + minor) of `device`.
int device_compute_capability(int device);
// __CUDA_ARCH__ of the image the driver loads on `device` (e.g. 900), whether arch-specific
// (sm_XYa) features were compiled in, and the device facts every launch needs; runs a probe
// kernel once per device, then cached, so the per-call path asks the driver nothing.
struct ImageInfo {
  int cuda_arch;
  bool arch_specific;
  bool family_specific;
  int compute_capability;  // major * 10 + minor
  int sm_count;
};
int probe_image(int device, ImageInfo* info);
// Last CUDA error text for messages.
const char* cuda_error_string(int err);

}  // namespace cudelta
