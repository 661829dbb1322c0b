// Which image of the fat binary did the driver load on this GPU? Only device code can tell:
// __CUDA_ARCH__ and the arch-/family-specific feature macros are fixed when each cubin (or the
// PTX the driver JIT-compiles) is built. The host uses the answer to pick a kernel variant and
// to report it, instead of guessing from the compute capability alone.

#include <cuda_runtime.h>

#include <mutex>

#include "launch.h"

namespace cudelta {
namespace {

__global__ void probe_kernel(int* out) {
#if defined(__CUDA_ARCH__)
  out[0] = __CUDA_ARCH__;
#if defined(__CUDA_ARCH_SPECIFIC__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) || \
    defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM120_ALL)
  out[1] = 1;
#else
  out[1] = 0;
#endif
#if defined(__CUDA_ARCH_FAMILY_SPECIFIC__)
  out[2] = 1;
#else
  out[2] = 0;
#endif
#endif
}

constexpr int kMaxDevices = 64;
std::mutex g_mutex;
ImageInfo g_cache[kMaxDevices];
bool g_cached[kMaxDevices] = {};

}  // namespace

Variant auto_variant(int image_arch, int64_t heads, bool state_vk) {
  // One variant has a row in the table: the warp kernels were the fastest of the five that were
  // built (generic, sm80, sm90, sm90tma, warp) on the H100 and the H200, every layout, state dtype
  // and batch measured (benchmarks/results-h100-kernel.md, results-h200-kernel.md), so the others
  // were removed. The arguments stay: they are what a variant for another image would be chosen by.
  (void)state_vk;
  (void)heads;
  (void)image_arch;
  return Variant::kWarp;
}

int device_compute_capability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return -1;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return -1;
  return major * 10 + minor;
}

int probe_image(int device, ImageInfo* info) {
  if (device < 0 || device >= kMaxDevices) return static_cast<int>(cudaErrorInvalidDevice);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_cached[device]) {
    *info = g_cache[device];
    return 0;
  }
  int previous = 0;
  cudaGetDevice(&previous);
  cudaError_t err = cudaSetDevice(device);
  int host[3] = {0, 0, 0};
  int* buf = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&buf, sizeof(host));
  if (err == cudaSuccess) err = cudaMemset(buf, 0, sizeof(host));
  if (err == cudaSuccess) {
    probe_kernel<<<1, 1>>>(buf);
    err = cudaGetLastError();  // cudaErrorNoKernelImageForDevice when no image fits
  }
  if (err == cudaSuccess) err = cudaMemcpy(host, buf, sizeof(host), cudaMemcpyDeviceToHost);
  if (buf) cudaFree(buf);
  cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so torch's next check does not trip on it
    return static_cast<int>(err);
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  g_cache[device] = ImageInfo{host[0], host[1] != 0, host[2] != 0, device_compute_capability(device), sms};
  g_cached[device] = true;
  *info = g_cache[device];
  return 0;
}

const char* cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace cudelta
