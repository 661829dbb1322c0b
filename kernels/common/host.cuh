// Host-side helpers every launch shares: the SM count the launch rules scale by, the
// programmatic-dependent-launch attribute and the occupancy the driver reports for a build.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../launch.h"

namespace cudelta {
namespace {

// The SM count every launch rule scales its thresholds by (the probe always fills it; the H100's
// 132, the GPU the first rules were measured on, otherwise).
inline int64_t rule_sms(const GdnDecodeParams& p) { return p.sm_count > 0 ? p.sm_count : 132; }

// Resident blocks per SM of `Kernel` on `device` with `threads` threads and `smem` bytes of dynamic
// shared memory: asked of the driver once per kernel, device and block size (again where the
// shared memory changes), then cached. 0 where the driver cannot say (its error is cleared, so that
// no later launch check reports it).
template <auto Kernel>
int resident_blocks_of(int device, int threads, size_t smem) {
  struct Seen {
    size_t smem;
    int blocks;
  };
  static Seen cached[64][33] = {};
  const int warps = threads / 32;
  const bool keep = device >= 0 && device < 64 && warps >= 1 && warps <= 32;
  if (keep && cached[device][warps].blocks > 0 && cached[device][warps].smem == smem) return cached[device][warps].blocks;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (keep && blocks > 0) cached[device][warps] = {smem, blocks};
  return blocks;
}

// Lets `Kernel` take `bytes` of dynamic shared memory on `device` (beyond 48 KB a kernel must opt
// in): set once per kernel and device, to the largest size asked so far. Returns the cudaError_t.
template <auto Kernel>
int allow_dynamic_smem(int device, size_t bytes) {
  static size_t allowed[64] = {};
  if (device >= 0 && device < 64 && allowed[device] >= bytes) return 0;
  const cudaError_t err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess && device >= 0 && device < 64) allowed[device] = bytes;
  return static_cast<int>(err);
}

// Asks the driver to run `Kernel` on `device` in the shared-memory / L1 split that gives shared
// memory `percent` of the most an SM has (cudaFuncAttributePreferredSharedMemoryCarveout, a hint):
// set once per kernel and device. Returns the cudaError_t; an error is cleared, so that no later
// launch check reports it (the launch then runs in the driver's own split).
template <auto Kernel>
int prefer_carveout(int device, int percent) {
  static bool set[64] = {};
  if (device >= 0 && device < 64 && set[device]) return 0;
  const cudaError_t err = cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, percent);
  if (err != cudaSuccess) (void)cudaGetLastError();
  else if (device >= 0 && device < 64) set[device] = true;
  return static_cast<int>(err);
}

// Appends the programmatic-dependent-launch attribute where the launch asks for it (`pdl`: the
// params' flag; every kernel here starts with pdl_enter); returns the attribute count.
inline unsigned add_pdl(bool pdl, cudaLaunchAttribute* attr, int n) {
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  return static_cast<unsigned>(n);
}

// Launches `kernel(p)` with the programmatic-dependent-launch attribute where the params ask for
// it; every decode launch goes through here. Returns the cudaError_t as an int.
// cluster: the grid's blocks in thread block clusters of these dimensions where it holds more than
// one block (sm_90+ images).
template <typename Kernel>
int launch_decode(Kernel kernel, dim3 grid, dim3 block, const GdnDecodeParams& p, cudaStream_t stream,
                  size_t dynamic_smem = 0, dim3 cluster = dim3(1, 1, 1)) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = dynamic_smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
  int n = 0;
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  cfg.numAttrs = add_pdl(p.pdl, attr, n);
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kernel, p));
}

}  // namespace
}  // namespace cudelta
