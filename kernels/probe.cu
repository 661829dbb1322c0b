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
  // Measured on H100 with this build (benchmarks/results-h100-kernel.md, K=V=128, graph replay):
  // layout kv: plain register loads are fastest or tied at every batch (B=1024 fp32: generic 1799 us,
  // sm80 1815, sm90 1860, sm90tma 1817; on H200 likewise). Layout vk: from 1024 (request, head) pairs
  // the cp.async staging wins (B=1024 fp32: sm80 1579 us, generic 1832; bf16 995 vs 1070; B=32:
  // 59.7 vs 62.1), below it register loads (B=8: 17.5 vs 17.8), which also have the small-batch
  // build. The vk tile is contiguous, so staging it takes no registers and more tiles are in flight.
  // Layout vk: the warp build (one warp per register-held tile, no block sync) is fastest at every
  // batch on H100 (Qwen3-Next, raw gates; fp32 state B=1/8/256/1024: 5.2/15.5/372/1464 us against
  // 5.3/17.5 generic, 406/1585 sm80; bf16 state 4.8/10.6/212/830 against 4.8/13.4/256/998).
  // Layout kv: its warp build (a lane holds consecutive rows of a column chunk) likewise, from
  // B=1 (benchmarks/warp_sweep.cu kv, H100: fp32 B=1/8/256/1024 4.0/15.0/383/1504 us against generic
  // 4.6/20.1/478/1894; bf16 3.8/9.0/218/854 against 4.1/10.4/323/1281).
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
