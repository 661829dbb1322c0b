// PTX and warp primitives every kernel shares: programmatic dependent launch, the state's cache
// hints, register fences, and the shuffle reductions. Anything sm_90+-only is guarded by
// __CUDA_ARCH__, so each image of the fat binary (and the PTX the driver JITs) compiles it or not.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cudelta {
namespace {

// Programmatic dependent launch (sm_90+). Launched with the attribute (GdnDecodeParams::pdl), a
// kernel's blocks may become resident while the previous kernel of the stream still runs:
// griddepcontrol.wait holds them until that kernel has completed and its writes are visible, so
// every kernel here calls this before its first global access (one exception: gated_rms_norm_kernel
// loads z and w before it, inputs of the decode launch it follows). It then lets the next kernel's
// blocks do the same. Without the attribute both instructions are no-ops.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether this compile pass has clusters: a build launched only in clusters has its body in sm_90+
// images alone (the host pass's value is not used).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kClusterBodies = false;
#else
constexpr bool kClusterBodies = true;
#endif

// Thread block clusters (sm_90+; launched only from sm_90+ images, GdnDecodeParams::clusters).
// cluster_size: the blocks of this block's cluster, 1 where the launch made none. The barrier's
// arrive (release) and wait (acquire) are each executed by every thread of every block.
__device__ __forceinline__ unsigned cluster_size() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned n;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
#else
  return 1;
#endif
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The address of `local` (this block's shared memory) in the shared memory of cluster block `rank`.
__device__ __forceinline__ uint32_t cluster_address(const void* local, unsigned rank) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
  return remote;
}
#endif
// Stores x at `local` (this block's shared memory) as seen in the shared memory of cluster block `rank`.
__device__ __forceinline__ void store_cluster(float* local, unsigned rank, float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t remote = cluster_address(local, rank);
  // No "memory" clobber: it would keep the compiler from moving shared loads across the store in a
  // kernel's loop; the cluster barrier before any read of the value orders it.
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(x));
#else
  *local = x;
#endif
}

// The same exchange counted by a transaction barrier instead of a second cluster barrier: each block
// expects `bytes` of sends (send_cluster) into its shared memory and waits for them alone
// (wait_sends). A cluster barrier's arrive has release semantics at cluster scope (MEMBAR.ALL.GPU
// before it in the SASS), so every thread first waits until its earlier global stores are performed
// (the step's state stores, still in flight when the sums are ready); a send carries only its own
// bytes. Protocol, one exchange a launch (the barrier's first phase): expect_sends by one thread
// before the cluster's first (relaxed) arrival, whose wait every sender passes before its first
// send, so that every block's barrier is initialised; a block leaves only after its own barrier
// completes, so no send lands in a block that has exited.
__device__ __forceinline__ void expect_sends(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a) : "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Stores x at `local` as seen in cluster block `rank`, counted by that block's barrier `bar`.
__device__ __forceinline__ void send_cluster(float* local, unsigned rank, float x, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               ::"r"(cluster_address(local, rank)), "r"(__float_as_uint(x)), "r"(cluster_address(bar, rank))
               : "memory");
#else
  *local = x;
#endif
}
// Waits until the block's barrier has counted every byte expect_sends announced.
__device__ __forceinline__ void wait_sends(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra LAB_WAIT;\n"
      "}\n" ::"r"(a)
      : "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The transposing butterfly from lane offset O down to LO: N sums per lane, halved at each level
// until one is left, then plain xor-sums for the remaining offsets. At each halving level the lanes
// with the offset's bit set keep the upper half.
template <int N, int O, int LO = 1>
__device__ __forceinline__ void butterfly(float* a, float* b, int lane) {
  if constexpr (O >= LO) {
    if constexpr (N > 1) {
      constexpr int H = N / 2;
      const bool hi = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float sa = hi ? a[i] : a[i + H], ka = hi ? a[i + H] : a[i];
        const float sb = hi ? b[i] : b[i + H], kb = hi ? b[i + H] : b[i];
        a[i] = ka + __shfl_xor_sync(0xffffffffu, sa, O);
        b[i] = kb + __shfl_xor_sync(0xffffffffu, sb, O);
      }
      butterfly<H, O / 2, LO>(a, b, lane);
    } else {
      a[0] += __shfl_xor_sync(0xffffffffu, a[0], O);
      b[0] += __shfl_xor_sync(0xffffffffu, b[0], O);
      butterfly<1, O / 2, LO>(a, b, lane);
    }
  }
}

// The warp kernels' state chunks, each read and written once per step. STREAM: with the
// evict-first ("streaming") cache hint (ld.global.cs / st.global.cs), so the state passing through
// does not displace what L2 holds for longer. A launch-rule choice (launch_vk_warp, launch_kv_warp):
// it pays at mid batches, and costs where a step's state stays in L2 between calls or where the
// grid is many waves deep (the measurements: benchmarks/results-h100-kernel.md).
template <bool STREAM, typename T>
__device__ __forceinline__ T state_load(const T* p) {
  if constexpr (STREAM) return __ldcs(p);
  else return *p;
}
template <bool STREAM, typename T>
__device__ __forceinline__ void state_store(T* p, const T& x) {
  if constexpr (STREAM) __stcs(p, x);
  else *p = x;
}

// Asynchronous 16-byte copies global -> shared (sm_80+): the streaming multi-token kernel keeps its
// next state chunks in flight in shared memory rather than in registers (mtp_stream.cuh). Each thread reads
// back only what it copied, so waiting for its own groups is enough.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Hides a chunk's value from the compiler, so the widened copy made for the reduction is not kept
// live until the update (that doubled the registers of a bf16 tile); the update widens it again.
__device__ __forceinline__ void opaque(float4& x) {
  asm volatile("" : "+f"(x.x), "+f"(x.y), "+f"(x.z), "+f"(x.w));
}
__device__ __forceinline__ void opaque(uint4& x) {
  asm volatile("" : "+r"(x.x), "+r"(x.y), "+r"(x.z), "+r"(x.w));
}

}  // namespace
}  // namespace cudelta
