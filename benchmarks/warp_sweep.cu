// The launch shapes of the `warp` kernels, swept on one GPU without torch. Layout vk: rows per
// tile, tiles per warp, persistent grid or not; layout kv: 16-byte column chunks per tile; each
// with programmatic dependent launch off and on, for fp32 and bf16 state, Qwen3-Next heads (H=16,
// HV=32, K=V=128) or with `kda` Kimi-Linear's (H=HV=32, one raw gate per key channel: a [N,HV,K],
// dt_bias [HV,K]), raw gates, bf16 q/k/v sliced from one packed row, the pool updated in place at
// slots that change every call (as benchmarks/kernel_bench.py: a CUDA graph of 50 calls, best of 5
// replays). This is how the launch rules in kernels/launch_rules.cuh (launch_vk_warp,
// launch_kv_warp) were chosen; kernel_bench.py, through torch, is the comparison with vLLM and fla.
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
//        -o warp_sweep benchmarks/warp_sweep.cu && ./warp_sweep [vk|kv] [kda] [B ...]
//
// Each configuration is first checked on the same inputs against a reference launch (vk: the
// product's launch rule; kv: the block kernel, another kernel), three steps without PDL: max
// |difference| of the updated states and of the outputs. kv also times that block kernel (what auto
// ran on kv before the kv warp kernel, "generic" in the tables of that time, and still what kv
// with K = 256 runs).

#include "../kernels/launch_rules.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace {

using cudelta::GdnDecodeParams;
using cudelta::DType;

constexpr int HV = 32, K = 128, V = 128, CALLS = 50, REPLAYS = 5;

using Launch = int (*)(const GdnDecodeParams&, cudaStream_t);

struct Config {
  std::string name;
  Launch f32, bf16;
};

// BW rows per tile, TPW tiles per warp (all loaded before the first is reduced). A shape whose
// fp32 tiles would not fit in registers is timed for bf16 only.
template <int BW, int TPW = 1, bool PERSIST = false, bool STREAM = false>
Config rows(const char* name) {
  Launch f32 = nullptr;
  if constexpr (BW * TPW <= 32) f32 = &cudelta::launch_vk_warp_rows<K, float, BW, TPW, PERSIST, STREAM>;
  return {name, f32, &cudelta::launch_vk_warp_rows<K, __nv_bfloat16, BW, TPW, PERSIST, STREAM>};
}

// kv: CPR 16-byte column chunks per tile (fp32 4 columns each, bf16 8).
// wN: N warps per block (adjacent column tiles of one head, started together).
// A block wider than V is timed for the other state dtype only.
template <int CPR, int WPB = 1, bool STREAM = false>
Config cols(const char* name) {
  Launch f32 = nullptr, bf16 = nullptr;
  if constexpr (CPR * 4 * WPB <= V) f32 = &cudelta::launch_kv_warp_cols<K, float, CPR, WPB, STREAM>;
  if constexpr (CPR * 8 * WPB <= V) bf16 = &cudelta::launch_kv_warp_cols<K, __nv_bfloat16, CPR, WPB, STREAM>;
  return {name, f32, bf16};
}

// What the library runs for these shapes (the launch rules; the sweep's K is the library's K = 128).
int product(const GdnDecodeParams& p, cudaStream_t s) {
  const bool f32 = p.state_dtype == DType::kFloat32;
  if (p.state_vk) return f32 ? cudelta::launch_vk<float>(p, s) : cudelta::launch_vk<__nv_bfloat16>(p, s);
  return f32 ? cudelta::launch_kv<float>(p, s) : cudelta::launch_kv<__nv_bfloat16>(p, s);
}
int block(const GdnDecodeParams& p, cudaStream_t s) {
  return p.state_dtype == DType::kFloat32 ? cudelta::launch_kv_block<K, float>(p, s)
                                          : cudelta::launch_kv_block<K, __nv_bfloat16>(p, s);
}

float graph_us(cudaStream_t s, const std::function<void(int)>& call) {
  for (int i = 0; i < 3; ++i) call(i);
  CK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < CALLS; ++i) call(i);
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int r = 0; r < REPLAYS; ++r) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms * 1000.f / CALLS);
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return best;
}

template <typename T>
T* upload(const std::vector<T>& h) {
  T* d;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<__nv_bfloat16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16(x[i]);
  return y;
}

// Not zeros (they hide unwritten outputs): a hash of the index, uniform in [-0.1, 0.1).
template <typename T>
__global__ void fill(T* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    x[i] = T(0.2f * (float(h & 0xffffff) / 16777216.f - 0.5f));
  }
}

template <typename T>
__global__ void max_diff(const T* a, const T* b, size_t n, unsigned* out) {
  float m = 0.f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(float(a[i]) - float(b[i])));
  atomicMax(out, __float_as_uint(m));  // non-negative floats order as their bits
}

float max_abs_diff(const void* a, const void* b, size_t n, bool bf16) {
  unsigned* d;
  CK(cudaMalloc(&d, 4));
  CK(cudaMemset(d, 0, 4));
  if (bf16) {
    max_diff<<<1024, 256>>>(static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b), n, d);
  } else {
    max_diff<<<1024, 256>>>(static_cast<const float*>(a), static_cast<const float*>(b), n, d);
  }
  unsigned h;
  CK(cudaMemcpy(&h, d, 4, cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  float f;
  std::memcpy(&f, &h, 4);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> batches = {1, 2, 4, 8, 16, 32, 64, 128, 256, 1024};
  int first = 1;
  bool vk = true;
  if (argc > first && (std::strcmp(argv[first], "vk") == 0 || std::strcmp(argv[first], "kv") == 0)) {
    vk = argv[first][0] == 'v';
    ++first;
  }
  const bool kda = argc > first && std::strcmp(argv[first], "kda") == 0;
  if (kda) ++first;
  // Gate channels per value head: one (GDN) or one per key channel (KDA).
  const int H = kda ? HV : 16, C = kda ? K : 1;
  if (argc > first) {
    batches.clear();
    for (int i = first; i < argc; ++i) batches.push_back(std::atoi(argv[i]));
  }
  // vk: bwN N-row tiles; xT: T tiles per warp; p: persistent grid (one wave looping over the tiles).
  // kv: cN, N 16-byte column chunks per tile; wN, N warps per block. cs: the state with the
  // evict-first cache hint.
  const std::vector<Config> configs =
      vk ? std::vector<Config>{rows<4>("bw4"), rows<8>("bw8"), rows<16>("bw16"), rows<32>("bw32"),
                               rows<8, 2>("bw8x2"), rows<16, 2>("bw16x2"), rows<8, 1, true>("bw8p"),
                               rows<16, 1, true>("bw16p"), rows<32, 1, true>("bw32p"),
                               rows<16, 1, false, true>("bw16cs"), rows<32, 1, false, true>("bw32cs"),
                               rows<8, 2, false, true>("bw8x2cs"), rows<32, 1, true, true>("bw32pcs")}
         : std::vector<Config>{cols<2>("c2"), cols<4>("c4"), cols<8>("c8"), cols<4, 2>("c4w2"), cols<4, 4>("c4w4"),
                               cols<8, 2>("c8w2"), cols<8, 4>("c8w4"), cols<4, 1, true>("c4cs"),
                               cols<8, 2, true>("c8w2cs")};
  const Launch reference = vk ? product : block;
  int dev = 0, sms = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);

  std::printf("%s warp kernel launch sweep, %s, %d SMs; %s, K=V=128, raw gates, bf16 q/k/v; "
              "graph of %d calls, best of %d (us per call); pdl = programmatic dependent launch\n\n",
              vk ? "vk" : "kv", prop.name, sms,
              kda ? "KDA, Kimi-Linear heads (H=HV=32), a gate per key channel" : "GDN, Qwen3-Next heads (H=16, HV=32)",
              CALLS, REPLAYS);
  std::printf("| state | B | copy |");
  for (const auto& c : configs) std::printf(" %s | %s+pdl |", c.name.c_str(), c.name.c_str());
  if (!vk) std::printf(" block | block+pdl |");
  std::printf(" product | product+pdl | max diff |\n|---|---|---|");
  for (size_t i = 0; i < configs.size() + (vk ? 0 : 1); ++i) std::printf("---|---|");
  std::printf("---|---|---|\n");

  for (int bf : {0, 1}) {
    const size_t es = bf ? 2 : 4;
    const size_t state_elems = size_t(HV) * V * K;
    for (int B : batches) {
      const int sets = std::max(2, std::min(16, int(std::ceil(512.0 * (1 << 20) / (double(B) * state_elems * es)))));
      const int P = B * sets + 1;
      const size_t W = 2 * H * K + HV * V;
      std::vector<float> mixed(size_t(B) * W), ab(size_t(B) * HV * (C + 1)), A_log(HV), dt_bias(size_t(HV) * C);
      for (auto& x : mixed) x = nd(rng);
      for (auto& x : ab) x = nd(rng);
      for (auto& x : A_log) x = 0.5f * nd(rng);
      for (auto& x : dt_bias) x = nd(rng);
      auto* d_mixed = upload(to_bf16(mixed));
      auto* d_ab = upload(to_bf16(ab));
      auto* d_A = upload(A_log);
      auto* d_dt = upload(dt_bias);
      std::vector<int> perm(P - 1);
      for (int i = 0; i < P - 1; ++i) perm[i] = i + 1;
      std::shuffle(perm.begin(), perm.end(), rng);
      int* d_idx = upload(perm);
      void *pool, *pool0, *pool2, *dst;
      const size_t pool_bytes = size_t(P) * state_elems * es;
      CK(cudaMalloc(&pool, pool_bytes));
      CK(cudaMalloc(&pool2, pool_bytes));
      CK(cudaMalloc(&pool0, pool_bytes));
      CK(cudaMalloc(&dst, size_t(B) * sets * state_elems * es));
      if (bf) {
        fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(pool), pool_bytes / es, 1234u + B);
      } else {
        fill<<<1024, 256>>>(static_cast<float*>(pool), pool_bytes / es, 1234u + B);
      }
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(pool0, pool, pool_bytes, cudaMemcpyDeviceToDevice));
      CK(cudaDeviceSynchronize());  // pristine: every check starts here
      __nv_bfloat16 *out, *out2;
      CK(cudaMalloc(&out, size_t(B) * HV * V * 2));
      CK(cudaMalloc(&out2, size_t(B) * HV * V * 2));

      GdnDecodeParams p{};
      p.q = d_mixed;
      p.k = d_mixed + H * K;
      p.v = d_mixed + 2 * H * K;
      p.q_stride_n = p.k_stride_n = p.v_stride_n = W;
      p.q_stride_h = p.k_stride_h = K;
      p.v_stride_h = V;
      p.dtype = DType::kBFloat16;
      p.qk_aligned = true;
      p.g = d_ab;
      p.g_dtype = DType::kBFloat16;
      p.g_stride_n = HV * (C + 1);
      p.g_stride_h = C;
      p.g_per_channel = kda;
      p.gate_raw = true;
      p.A_log = d_A;
      p.A_log_dtype = DType::kFloat32;
      p.dt_bias = d_dt;
      p.dt_bias_dtype = DType::kFloat32;
      p.beta = d_ab + HV * C;
      p.beta_dtype = DType::kBFloat16;
      p.beta_stride_n = HV * (C + 1);
      p.beta_stride_h = 1;
      p.beta_raw = true;
      p.state = pool;
      p.state_dtype = bf ? DType::kBFloat16 : DType::kFloat32;
      p.state_vk = vk;
      p.state_stride_p = int64_t(HV) * K * V;  // a contiguous pool
      p.idx = d_idx;
      p.min_slot = 1;
      p.out = out;
      p.out_stride_n = HV * V;
      p.out_stride_h = V;
      p.N = B;
      p.H = H;
      p.HV = HV;
      p.K = K;
      p.V = V;
      p.P = P;
      p.scale = 1.f / std::sqrt(float(K));
      p.use_qk_l2norm = true;
      p.device = dev;
      p.sm_count = sms;

      auto at_set = [&](int i, bool pdl, void* state, void* o) {
        GdnDecodeParams q = p;
        q.idx = d_idx + (i % sets) * B;
        q.pdl = pdl;
        q.state = state;
        q.out = o;
        return q;
      };
      // Reference: the product launch, three steps on a copy of the pool.
      CK(cudaMemcpy(pool2, pool0, pool_bytes, cudaMemcpyDeviceToDevice));
      CK(cudaDeviceSynchronize());
      for (int i = 0; i < 3; ++i) CK(cudaError_t(reference(at_set(0, false, pool2, out2), s)));
      CK(cudaDeviceSynchronize());
      std::vector<float> times;
      float worst = 0.f;
      for (const auto& c : configs) {
        for (bool pdl : {false, true}) {
          Launch f = bf ? c.bf16 : c.f32;
          if (f == nullptr) {
            times.push_back(NAN);
            continue;
          }
          void* scratch;
          CK(cudaMalloc(&scratch, pool_bytes));
          CK(cudaMemcpy(scratch, pool0, pool_bytes, cudaMemcpyDeviceToDevice));
          CK(cudaDeviceSynchronize());
          for (int i = 0; i < 3; ++i) CK(cudaError_t(f(at_set(0, pdl, scratch, out), s)));
          CK(cudaDeviceSynchronize());
          worst = std::max(worst, max_abs_diff(scratch, pool2, pool_bytes / es, bf));
          worst = std::max(worst, max_abs_diff(out, out2, size_t(B) * HV * V, true));
          CK(cudaFree(scratch));
          times.push_back(graph_us(s, [&](int i) { CK(cudaError_t(f(at_set(i, pdl, pool, out), s))); }));
        }
      }
      for (Launch f : {block, product}) {
        if (vk && f == block) continue;
        for (bool pdl : {false, true}) {
          times.push_back(graph_us(s, [&](int i) { CK(cudaError_t(f(at_set(i, pdl, pool, out), s))); }));
        }
      }
      const size_t bytes = size_t(B) * state_elems * es;
      const float copy = graph_us(s, [&](int i) {
        CK(cudaMemcpyAsync(static_cast<char*>(dst) + (i % sets) * bytes,
                           static_cast<char*>(pool) + state_elems * es + (i % sets) * bytes, bytes,
                           cudaMemcpyDeviceToDevice, s));
      });
      std::printf("| %s | %d | %.1f |", bf ? "bf16" : "fp32", B, copy);
      for (float t : times) std::isnan(t) ? std::printf(" |") : std::printf(" %.1f |", t);
      std::printf(" %.1e |\n", worst);
      std::fflush(stdout);
      CK(cudaFree(d_mixed));
      CK(cudaFree(d_ab));
      CK(cudaFree(d_A));
      CK(cudaFree(d_dt));
      CK(cudaFree(d_idx));
      CK(cudaFree(pool));
      CK(cudaFree(pool2));
      CK(cudaFree(pool0));
      CK(cudaFree(dst));
      CK(cudaFree(out));
      CK(cudaFree(out2));
    }
  }
  return 0;
}
