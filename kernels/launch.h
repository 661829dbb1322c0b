// The plain C++ boundary between host code (csrc/, LibTorch stable ABI) and device code
// (kernels/, CUDA). No torch and no CUDA headers here, so each side compiles without the other.
#pragma once

#include <cstdint>

namespace cudelta {

// The kernel variants: each is a way to run the step, with its own device code and launch
// rules. Only what measurement shows auto picking on some supported GPU and shape has a row
// (benchmarks/results-h100-kernel.md, results-h200-kernel.md); the table keeps its mechanism so a
// variant for a new architecture can be added when one can be measured there.
enum class Variant : int {
  kWarp = 0,  // one warp per register-held tile, no block sync (kv with K=256: block_kv.cuh): any arch
};

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// A grid's y and z dimensions hold at most this many blocks (x: 2^31 - 1).
constexpr int64_t kMaxGridYZ = 65535;

struct GdnDecodeParams {
  // q, k [N, H, K]; v [N, HV, V]: innermost dim contiguous, strides in elements, dtype `dtype`.
  // qk_aligned: q and k start on 16 bytes and their strides are whole 16-byte units, so a lane
  // may read its consecutive channels as vectors.
  const void* q;
  const void* k;
  const void* v;
  int64_t q_stride_n, q_stride_h;
  int64_t k_stride_n, k_stride_h;
  int64_t v_stride_n, v_stride_h;
  DType dtype;
  bool qk_aligned;
  // Decay: the log-decay g, or (gate_raw) the raw a with g = -exp(A_log) * softplus(a + dt_bias).
  // [N, HV] (GDN) or per channel [N, HV, K] (KDA, innermost contiguous); dt_bias [HV] or [HV, K].
  const void* g;
  DType g_dtype;
  int64_t g_stride_n, g_stride_h;
  bool gate_raw;
  bool g_per_channel;
  const void* A_log;  // [HV], contiguous (gate_raw only)
  DType A_log_dtype;
  const void* dt_bias;  // [HV] or [HV, K], contiguous (gate_raw only)
  DType dt_bias_dtype;
  // gate_raw with gate_lower_bound < 0 (KDA): the log-decay is bounded, lower_bound * sigmoid(
  // exp(A_log) * (a + dt_bias)), in [lower_bound, 0) (vLLM's Kimi K3 "safe gate"); 0: the softplus form.
  float gate_lower_bound;
  // beta [N, HV] in (0, 1), or (beta_raw) b with beta = sigmoid(b).
  const void* beta;
  DType beta_dtype;
  int64_t beta_stride_n, beta_stride_h;
  bool beta_raw;
  // State pool [P, HV, K, V] ("kv") or [P, HV, V, K] (state_vk), float32 or bfloat16, updated in
  // place: each slot's [HV, K, V] block contiguous, slots state_stride_p elements apart (>= the block;
  // more in vLLM's padded pages, which hold the conv state and padding beside it). The byte stride is
  // a whole number of 16-byte units, so every slot starts as aligned as slot 0 (the vector accesses).
  void* state;
  DType state_dtype;
  bool state_vk;
  int64_t state_stride_p;
  const void* idx;  // [N] slot of each request; < min_slot or >= P: skipped, output zero
  bool idx_is_int64;
  int64_t min_slot;  // 0, or 1 where slot 0 is an engine's null block
  void* out;         // [N, HV, V], innermost contiguous, dtype of v
  int64_t out_stride_n, out_stride_h;
  int64_t N, H, HV, K, V, P;
  float scale;
  bool use_qk_l2norm;
  int device;    // the CUDA device of the tensors (current while launching)
  int sm_count;  // its multiprocessors, from the cached probe: no driver query per launch
  // Launch with programmatic dependent launch (sm_90+ images): the kernel's blocks start while the
  // previous kernel of the stream finishes, and wait in the kernel for its writes (griddepcontrol).
  bool pdl;
  // The kernel before this launch in the stream is cudelta's conv update of the same call
  // (cudelta.vllm_compat.conv_then_gdn_decode_post_conv_mtp): it waited for every kernel before it
  // before it let this one start, and it writes none of the slots, indices or gates this step reads
  // first, only q, k and v. The kernels that take it (pdl_wait_early / pdl_wait_late) load the
  // state's rows before griddepcontrol.wait, so that their DRAM round trip overlaps the conv.
  bool early_state;
  // The image is sm_90+: a launch may group its blocks in thread block clusters (mtp_stream.cuh).
  bool clusters;
  // __CUDA_ARCH__ of the image the driver loaded (e.g. 900): a launch rule measured on one
  // architecture's builds holds there only (mtp_few.cuh's few_token_call). 0 where unknown.
  int image_arch;

  // Several tokens per request (speculative decoding; kernels/mtp.cuh). q, k, v, the gates, the
  // output gate and out are then rows of tokens: their *_stride_n step from one token to the next.
  // Request n's tokens are cu_seqlens[n] .. cu_seqlens[n+1] - 1 (int32 or int64), or, without
  // cu_seqlens, n * tokens .. n * tokens + tokens - 1. L: the token rows (rows outside every request
  // get zero outputs).
  int64_t tokens;
  const void* cu_seqlens;
  bool cu_is_int64;
  int64_t L;
  // idx [N, idx_columns] (idx_columns > 0): the state after token t is stored at idx[n, t] (an
  // invalid slot is not written) and the step starts from idx[n, accepted[n] - 1] (idx[n, 0]
  // without `accepted`, an [N] int32/int64 tensor). idx_columns 0: idx [N], read and written once.
  int64_t idx_columns;
  const void* accepted;
  bool accepted_is_int64;
  // The gated RMSNorm epilogue (gate_activation > 0): o, rounded to out's dtype, becomes
  // o * rsqrt(mean over V of o^2 + norm_eps) * norm_weight * act(z), act = silu (1) or sigmoid (2).
  // z: rows of tokens like out, innermost contiguous; norm_weight [V], contiguous.
  int gate_activation;
  const void* z;
  DType z_dtype;
  int64_t z_stride_n, z_stride_h;
  const void* norm_weight;
  DType norm_weight_dtype;
  float norm_eps;
  // The epilogue's FP8 output: null, or a float32 [1] on the device (vLLM's static per-tensor scale);
  // out is then e4m3 (store_out, mtp_common.cuh). Only with the epilogue.
  const float* out_scale;

  // Whether the call takes the multi-token kernel: anything beyond one token read and written in
  // place at idx[n] without an epilogue.
  bool multi_token() const {
    return tokens != 1 || cu_seqlens != nullptr || idx_columns > 0 || gate_activation > 0;
  }
};


// The causal-conv1d update that precedes the step in vLLM's GDN layer (kernels/conv_update.cuh;
// semantics: cudelta/conv_reference.py). Request n's window is conv_state[indices[n], :, off : off +
// width - 1] (off = accepted[n] - 1 with cu_seqlens, else 0), its tokens x's rows bos..eos - 1
// (cu_seqlens [N+1], else row n); each token's output is act(bias + sum_j weight[:, j] * seq[t + j])
// in fp32, rounded to the state's dtype and stored in x's; the sequence without its first column goes
// back to columns 0 .. width - 3 + tokens. A slot equal to null_block_id (or out of range) is skipped.
struct ConvUpdateParams {
  const void* x;  // [L, dim], channels contiguous
  DType x_dtype;
  int64_t x_stride_row;
  void* out;  // [L, dim], x's dtype, channels contiguous; may be x
  int64_t out_stride_row;
  void* conv_state;  // [slots, dim, state_len], strides in elements
  DType state_dtype;
  int64_t cs_slot, cs_dim, cs_col;
  // weight [dim, width] (w_seg = dim), or segments of w_seg channels each (vLLM's KDA decode weight
  // [3, width, dim / 3], q, k and v tap-major): channel c's tap j is element
  // (c / w_seg) * w_stride_seg + (c % w_seg) * w_stride_dim + j * w_stride_tap.
  const void* weight;
  DType weight_dtype;
  int64_t w_stride_dim, w_stride_tap;
  int64_t w_seg, w_stride_seg;
  const void* bias;  // [dim], contiguous, or null
  DType bias_dtype;
  const void* indices;  // [N], indices_stride elements apart (vLLM passes a column of its block table)
  bool indices_int64;
  int64_t indices_stride;
  const void* cu_seqlens;  // [N+1] or null: one token a row
  bool cu_int64;
  const void* accepted;  // [N], with cu_seqlens
  bool accepted_int64;
  int64_t N, dim, width, state_len, slots, L, null_block_id;
  bool silu;
  bool pdl;  // launched with programmatic dependent launch (sm_90+ images)
  int device;  // the CUDA device of the tensors (current while launching)
  // x, the state, the weight and the bias share one dtype, every run of 4 channels from a multiple
  // of 4 is aligned to its size in x, out, the bias and each column of the conv state (channels
  // contiguous there, cs_dim 1), and the weight is a contiguous [dim, width] on 8 bytes: a thread
  // moves 4 channels as vectors.
  bool vec;
  // As vec, but the weight is vLLM's KDA decode layout in fp32 (w_seg and the strides whole 16-byte
  // runs, w_stride_dim 1), x and the state bf16, the bias fp32 or none, width 4, at most 2 tokens a
  // request (kernels/conv_update.cuh, ConvAccessF32Taps).
  bool f32_taps;
  // As f32_taps, one token a row (no cu_seqlens), on vLLM's DS pages: the conv state [slots, dim,
  // 3] with each slot's [dim, 3] contiguous (cs_dim 3, cs_col 1, state_len 3), slots on 8 bytes
  // (conv_update_f32_taps_ds_kernel).
  bool f32_taps_ds;
};
__attribute__((visibility("hidden"))) int launch_conv_update(const ConvUpdateParams& p, void* stream);  // units/conv.cu

// Launch one variant's kernels on `stream` (a cudaStream_t) for params within the grid's limits
// (launch_gdn_decode splits larger batches). Returns 0 or a cudaError_t value.
using LaunchFn = int (*)(const GdnDecodeParams& p, void* stream);
__attribute__((visibility("hidden"))) int launch_warp(const GdnDecodeParams& p, void* stream);  // dispatch.cu

// The one table of kernel variants, and all that a variant is: the id (index = Variant), the name
// users and Python see (CUDELTA_KERNEL_VARIANT, `python -m cudelta`, error messages), the lowest
// __CUDA_ARCH__ of an image that contains its device code, and its launch. Python reads it from the
// library (cudelta::variants); nothing else repeats it. Adding a variant touches its row, the enum
// and its own code.
struct VariantInfo {
  Variant id;
  const char* name;
  int min_arch;
  LaunchFn launch;
};
inline constexpr VariantInfo kVariants[] = {
    {Variant::kWarp, "warp", 0, &launch_warp},
};
constexpr int kNumVariants = static_cast<int>(sizeof(kVariants) / sizeof(kVariants[0]));
constexpr bool variants_in_id_order() {
  for (int i = 0; i < kNumVariants; ++i)
    if (static_cast<int>(kVariants[i].id) != i) return false;
  return true;
}
static_assert(variants_in_id_order(), "kVariants must list the variants in id order");

inline const char* variant_name(Variant v) { return kVariants[static_cast<int>(v)].name; }
// Lowest __CUDA_ARCH__ of an image that contains the variant's device code.
inline int variant_min_arch(Variant v) { return kVariants[static_cast<int>(v)].min_arch; }

// What auto picks for an image (__CUDA_ARCH__), a launch of `heads` (request, head) pairs and a
// state layout.
Variant auto_variant(int image_arch, int64_t heads, bool state_vk);

// Launch `variant` on `stream` (a cudaStream_t), any batch. Returns 0 or a cudaError_t value.
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
