// cudelta's torch ops, registered through the LibTorch stable ABI only, so one library serves
// every torch from the floor set by TORCH_TARGET_VERSION upwards.
//
//   cudelta::decode          one decode call, Gated DeltaNet or (per_channel) Kimi Delta Attention:
//                            each request's tokens in order, the state pool updated in place
//   cudelta::conv_update     the causal-conv1d update that precedes the step in vLLM's GDN layer
//   cudelta::select_variant  the kernel variant that runs on a device for a batch (auto or forced)
//   cudelta::probe           what the driver loaded on a device: __CUDA_ARCH__, feature flags, and
//                            the variant auto picks for large batches
//   cudelta::build_info      the JSON build record embedded at compile time
//   cudelta::variants        the kernel variant table (kernels/launch.h kVariants) as JSON

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../kernels/launch.h"
#include "build_info.h"

namespace cudelta {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Error messages are assembled with std::to_string, never by streaming numbers: on torch 2.11
// (H100, 2026-11-23) a number streamed into STD_TORCH_CHECK's std::ostringstream from this library
// crashed inside std::basic_ostream::_M_insert<long> (cuda-gdb backtrace; the process died with
// SIGSEGV instead of raising), while messages without numbers raised normally.
inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, const std::string& x) { s += x; }
inline void append(std::string& s, char x) { s += x; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline void append(std::string& s, T x) {
  s += std::to_string(x);
}

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::string msg;
  (append(msg, parts), ...);
  throw std::runtime_error(msg);
}

#define CUDELTA_CHECK(cond, ...) \
  do {                           \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::Double: return "float64";
    case ScalarType::Float8_e4m3fn: return "float8_e4m3fn";
    default: return "another dtype";
  }
}

std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// "warp, ...": the variants an image of `cuda_arch` contains, in the table's order
// (kernels/launch.h kVariants).
std::string variants_for(int cuda_arch) {
  std::string names;
  for (const VariantInfo& v : kVariants)
    if (v.min_arch <= cuda_arch) names += (names.empty() ? "" : ", ") + std::string(v.name);
  return names;
}

std::string fix_command(int cc) {
  const std::string env =
      "FORCE_BUILD=1 TORCH_CUDA_ARCH_LIST=" + std::to_string(cc / 10) + "." + std::to_string(cc % 10) + " ";
  // kReinstallParts: the hint split where the variables go (installer/compile/build_record.py).
  std::string command = kReinstallParts[0];
  for (size_t i = 1; i < sizeof(kReinstallParts) / sizeof(kReinstallParts[0]); ++i) command += env + kReinstallParts[i];
  return command;
}

Variant select(int device, int64_t requested, int64_t heads, ImageInfo* info, bool state_vk = false) {
  const int err = probe_image(device, info);
  if (err != 0) {
    const int cc = device_compute_capability(device);
    CUDELTA_CHECK(cc > 0, "cudelta: cannot read the compute capability of CUDA device ", device);
    CUDELTA_CHECK(false, "cudelta: this build has no kernel image for CUDA device ", device, " (compute ", cc / 10,
                    ".", cc % 10, "): ", cuda_error_string(err), ". Built for ", kBuildArchs,
                    ". Build for this GPU with: ", fix_command(cc));
  }
  if (requested < 0) return auto_variant(info->cuda_arch, heads, state_vk);
  CUDELTA_CHECK(requested < kNumVariants, "cudelta: kernel variant ", requested,
                  " does not exist; accepted: ", variants_for(1 << 30), " (CUDELTA_KERNEL_VARIANT)");
  const auto v = static_cast<Variant>(requested);
  const int cc = info->compute_capability;
  CUDELTA_CHECK(variant_min_arch(v) <= info->cuda_arch, "cudelta: kernel variant ", variant_name(v),
                  " needs an sm_", variant_min_arch(v) / 10, "+ image, but CUDA device ", device, " (compute ",
                  cc / 10, ".", cc % 10, ") runs the sm_", info->cuda_arch / 10,
                  " image; variants it can run: ", variants_for(info->cuda_arch));
  return v;
}

void check_cuda(const char* op, const Tensor& t, const char* name, int device) {
  CUDELTA_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor");
  CUDELTA_CHECK(t.get_device_index() == device, op, ": ", name, " is on cuda:", t.get_device_index(),
                  " but q is on cuda:", device, "; all tensors must be on one device");
}

DType float_dtype(const char* op, const char* name, ScalarType t) {
  switch (t) {
    case ScalarType::Float: return DType::kFloat32;
    case ScalarType::Half: return DType::kFloat16;
    case ScalarType::BFloat16: return DType::kBFloat16;
    default:
      CUDELTA_CHECK(false, op, ": ", name, " has dtype ", dtype_name(t), "; accepted: bfloat16, float16, float32");
  }
  return DType::kFloat32;
}

// A [N, H, K] tensor whose rows a lane may read as 16-byte vectors: its start and its outer
// strides whole 16-byte units (a slice of a packed projection usually is).
bool aligned16(const Tensor& t) {
  const int64_t es = t.scalar_type() == ScalarType::Float ? 4 : 2;
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * es) % 16 == 0 &&
         (t.stride(1) * es) % 16 == 0;
}

bool head_dim_ok(int64_t d) { return d == 64 || d == 128 || d == 256; }

// A per-row tensor of the gates: [N, HV] or [N, HV, K] (rows: requests, or tokens with several a
// request), innermost contiguous (a view sliced out of a wider projection is fine).
void check_gate(const char* op, const Tensor& t, const char* name, int64_t N, int64_t HV, int64_t K,
                bool per_channel, const char* rows) {
  const bool shape_ok = per_channel ? (t.dim() == 3 && t.size(0) == N && t.size(1) == HV && t.size(2) == K)
                                    : (t.dim() == 2 && t.size(0) == N && t.size(1) == HV);
  if (per_channel) {
    CUDELTA_CHECK(shape_ok, op, ": ", name, " must be per-channel [", rows, ", HV, K] = [", N, ", ", HV, ", ", K,
                    "], got ", shape_of(t));
  } else {
    CUDELTA_CHECK(shape_ok, op, ": ", name, " must be [", rows, ", HV] = [", N, ", ", HV, "], got ", shape_of(t),
                    t.dim() == 3 ? " (per-channel gates are kda_decode)" : "");
  }
  CUDELTA_CHECK(t.stride(t.dim() - 1) == 1 || t.size(t.dim() - 1) == 1, op, ": the last dim of ", name,
                  " must be contiguous");
  float_dtype(op, name, t.scalar_type());
}

void check_param(const char* op, const Tensor& t, const char* name, int64_t HV, int64_t K, bool per_channel) {
  const bool shape_ok = per_channel ? (t.dim() == 2 && t.size(0) == HV && t.size(1) == K)
                                    : (t.dim() == 1 && t.size(0) == HV);
  CUDELTA_CHECK(shape_ok, op, ": ", name, " must be ", per_channel ? "[HV, K] = [" : "[HV] = [", HV,
                  per_channel ? ", " + std::to_string(K) : std::string(), "], got ", shape_of(t));
  CUDELTA_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  float_dtype(op, name, t.scalar_type());
}

// The pool rule (cudelta/_contract.py check_pool, check_kernel_pool): each slot's [HV, K, V] block
// contiguous, slots any number of elements >= one block apart (vLLM's padded pages), and, for the
// kernels' 16-byte state accesses, slot 0 on 16 bytes and the slot stride a whole number of 16-byte
// units, so that every slot starts aligned. Returns the slot stride in elements.
int64_t check_pool(const char* op, const Tensor& state, bool vk) {
  const int64_t block = state.size(1) * state.size(2) * state.size(3);
  const int64_t inner[3] = {state.size(2) * state.size(3), state.size(3), 1};
  for (int d = 1; d < 4; ++d) {
    CUDELTA_CHECK(state.size(d) == 1 || state.stride(d) == inner[d - 1], op, ": state's slot block ",
                  vk ? "[HV, V, K]" : "[HV, K, V]", " must be contiguous (strides (", inner[0], ", ", inner[1],
                  ", 1)); got strides (", state.stride(1), ", ", state.stride(2), ", ", state.stride(3),
                  ") for shape ", shape_of(state));
  }
  // One slot (or none): its stride is never used to address anything.
  const int64_t stride = state.size(0) > 1 ? state.stride(0) : block;
  CUDELTA_CHECK(stride >= block, op, ": state's slot stride must be at least one slot's block of ", block,
                " elements; got ", stride);
  const int64_t es = state.scalar_type() == ScalarType::Float ? 4 : 2;
  CUDELTA_CHECK((stride * es) % 16 == 0, op, ": state's slot stride of ", stride, " elements (", stride * es,
                " bytes) is not a multiple of 16 bytes; accepted on CUDA: slots a multiple of 16 bytes apart "
                "(the kernels' 16-byte state accesses; vLLM's pages are)");
  CUDELTA_CHECK(reinterpret_cast<uintptr_t>(state.data_ptr()) % 16 == 0, op,
                ": state must start on 16 bytes; got address offset ",
                static_cast<int64_t>(reinterpret_cast<uintptr_t>(state.data_ptr()) % 16),
                " (a view starting mid-row is not)");
  return stride;
}

// The bytes [lo, hi) a tensor addresses (every argument here has non-negative strides).
struct Span {
  int64_t lo = 0, hi = 0;
};

Span span_of(const Tensor& t) {
  if (t.numel() == 0) return {};
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto first = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()));
  return {first, first + (last + 1) * static_cast<int64_t>(t.element_size())};
}

// Whether two spans share a byte (an empty span, {0, 0}, meets nothing).
bool overlaps(Span a, Span b) { return a.lo < b.hi && b.lo < a.hi; }

// Whether bytes meet a slot's block of the pool; the padding between blocks is not the pool's
// (vLLM keeps each page's conv state there). cudelta/_contract.py _meets_slots in the same terms.
bool meets_slots(const Tensor& state, int64_t slot_stride, Span s) {
  if (s.lo == s.hi || state.numel() == 0) return false;
  const int64_t size = static_cast<int64_t>(state.element_size());
  const auto base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(state.data_ptr()));
  const int64_t block = state.size(1) * state.size(2) * state.size(3) * size, stride = slot_stride * size;
  const int64_t first = s.lo < base + block ? 0 : (s.lo - base - block) / stride + 1;
  return first < state.size(0) && base + first * stride < s.hi;
}

// One decode call's arguments as the op receives them, checked and turned into the kernels'
// parameters by decode() alone; the registered op only gathers them.
struct DecodeArgs {
  Tensor q, k, v;
  std::optional<Tensor> g, beta, a, b, A_log, dt_bias;
  Tensor state, idx, out;
  std::optional<Tensor> cu_seqlens, num_accepted_tokens, output_gate, norm_weight;
  double scale, norm_eps;
  bool per_channel, use_qk_l2norm;
  int64_t layout, min_slot, tokens, gate_activation, variant;
  bool pdl, early_state;
  double gate_lower_bound;
  std::optional<Tensor> output_scale;
};

// An index tensor: int32 or int64, contiguous, of the given shape.
void check_index(const char* op, const Tensor& t, const char* name, const std::vector<int64_t>& shape,
                 const char* what) {
  bool ok = (t.scalar_type() == ScalarType::Int || t.scalar_type() == ScalarType::Long) && t.is_contiguous() &&
            t.dim() == static_cast<int64_t>(shape.size());
  for (size_t d = 0; ok && d < shape.size(); ++d) ok = shape[d] < 0 || t.size(d) == shape[d];
  std::string want = "[";
  for (size_t d = 0; d < shape.size(); ++d)
    want += (d ? ", " : "") + (shape[d] < 0 ? std::string("C") : std::to_string(shape[d]));
  CUDELTA_CHECK(ok, op, ": ", name, " must be a contiguous int32/int64 ", want + "]", " tensor (", what, "), got ",
                dtype_name(t.scalar_type()), " ", shape_of(t));
}

void decode(const DecodeArgs& x) {
  const char* op = "cudelta.decode";
  const Tensor &q = x.q, &k = x.k, &v = x.v, &state = x.state, &idx = x.idx, &out = x.out;
  CUDELTA_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor");
  const int device = q.get_device_index();
  for (auto [t, name] : {std::pair<const Tensor&, const char*>{k, "k"}, {v, "v"}, {state, "state"}, {idx, "idx"},
                         {out, "out"}}) {
    check_cuda(op, t, name, device);
  }
  for (auto [t, name] : {std::pair<const std::optional<Tensor>&, const char*>{x.g, "g"}, {x.beta, "beta"},
                         {x.a, "a"}, {x.b, "b"}, {x.A_log, "A_log"}, {x.dt_bias, "dt_bias"},
                         {x.cu_seqlens, "cu_seqlens"}, {x.num_accepted_tokens, "num_accepted_tokens"},
                         {x.output_gate, "output_gate"}, {x.norm_weight, "norm_weight"},
                         {x.output_scale, "output_scale"}}) {
    if (t.has_value()) check_cuda(op, *t, name, device);
  }
  // Rows: one per request, or, with several tokens a request, one per token (cu_seqlens or
  // `tokens` per request); N, the requests, from cu_seqlens or from the rows.
  CUDELTA_CHECK(q.dim() == 3, op, ": q must be [rows, H, K], got shape ", shape_of(q));
  const int64_t L = q.size(0), H = q.size(1), K = q.size(2);
  CUDELTA_CHECK(x.tokens >= 1, op, ": tokens per request must be >= 1, got ", x.tokens);
  const bool varlen = x.cu_seqlens.has_value();
  CUDELTA_CHECK(!varlen || x.tokens == 1, op, ": with cu_seqlens pass tokens=1 (got ", x.tokens, ")");
  CUDELTA_CHECK(varlen || L % x.tokens == 0, op, ": q's ", L, " rows are not a whole number of requests of ",
                x.tokens, " tokens");
  if (varlen) {
    CUDELTA_CHECK(x.cu_seqlens->dim() == 1 && x.cu_seqlens->size(0) >= 1, op,
                  ": cu_seqlens must be [N+1], got ", shape_of(*x.cu_seqlens));
    check_index(op, *x.cu_seqlens, "cu_seqlens", {x.cu_seqlens->size(0)}, "token offsets [N+1]");
  }
  const int64_t N = varlen ? x.cu_seqlens->size(0) - 1 : L / x.tokens;
  const bool multi = varlen || x.tokens > 1 || idx.dim() == 2 || x.output_gate.has_value();
  const char* rows = multi ? "tokens" : "N";
  CUDELTA_CHECK(k.dim() == 3 && k.size(0) == L && k.size(1) == H && k.size(2) == K,
                  op, ": k must have q's shape ", shape_of(q), ", got ", shape_of(k));
  CUDELTA_CHECK(v.dim() == 3 && v.size(0) == L, op, ": v must be [", rows, ", HV, V] with ", rows, "=", L, ", got ",
                  shape_of(v));
  const int64_t HV = v.size(1), V = v.size(2);
  CUDELTA_CHECK(H > 0 && HV % H == 0, op, ": v's head count HV=", HV,
                  " must be a multiple of q's head count H=", H);
  const DType dt = float_dtype(op, "q", q.scalar_type());
  CUDELTA_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                  op, ": q, k, v must share one dtype; got q ", dtype_name(q.scalar_type()), ", k ",
                  dtype_name(k.scalar_type()), ", v ", dtype_name(v.scalar_type()));
  CUDELTA_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
                  op, ": the last dim of q, k and v must be contiguous");
  CUDELTA_CHECK(head_dim_ok(K), op, ": head dim K=", K, " is not supported; accepted: 64, 128, 256");
  CUDELTA_CHECK(head_dim_ok(V), op, ": head dim V=", V, " is not supported; accepted: 64, 128, 256");

  // Gates: exactly one of g and the raw (a, A_log, dt_bias); exactly one of beta and b.
  CUDELTA_CHECK(x.g.has_value() != x.a.has_value(), op, ": pass either g or the raw gate a (with A_log, dt_bias)",
                  x.g.has_value() ? ", not both" : "");
  CUDELTA_CHECK(x.beta.has_value() != x.b.has_value(), op, ": pass exactly one of beta and the raw b");
  const bool gate_raw = x.a.has_value();
  const Tensor& gate = gate_raw ? *x.a : *x.g;
  check_gate(op, gate, gate_raw ? "a" : "g", L, HV, K, x.per_channel, rows);
  if (gate_raw) {
    CUDELTA_CHECK(x.A_log.has_value() && x.dt_bias.has_value(), op, ": the raw gate a needs A_log and dt_bias");
    check_param(op, *x.A_log, "A_log", HV, K, false);
    check_param(op, *x.dt_bias, "dt_bias", HV, K, x.per_channel);
  } else {
    CUDELTA_CHECK(!x.A_log.has_value() && !x.dt_bias.has_value(), op,
                    ": A_log and dt_bias belong to the raw gate a; with g pass neither");
  }
  // 0: the softplus form; below 0 (and finite): the bounded form, which only the raw gate has.
  CUDELTA_CHECK(x.gate_lower_bound == 0.0 || (gate_raw && x.per_channel && x.gate_lower_bound < 0.0 && std::isfinite(x.gate_lower_bound)), op,
                ": gate_lower_bound ", x.gate_lower_bound, " is not accepted; expected 0 (none) or a finite value < 0, "
                "with KDA's raw gate a");
  const Tensor& bt = x.beta.has_value() ? *x.beta : *x.b;
  check_gate(op, bt, x.beta.has_value() ? "beta" : "b", L, HV, K, false, rows);

  CUDELTA_CHECK(x.layout == 0 || x.layout == 1, op, ": layout ", x.layout,
                " does not exist; accepted: 0 (kv), 1 (vk)");
  const bool vk = x.layout == 1;
  CUDELTA_CHECK(state.scalar_type() == ScalarType::Float || state.scalar_type() == ScalarType::BFloat16, op,
                  ": state has dtype ", dtype_name(state.scalar_type()), "; accepted: float32, bfloat16");
  const int64_t d2 = vk ? V : K, d3 = vk ? K : V;
  CUDELTA_CHECK(state.dim() == 4 && state.size(1) == HV && state.size(2) == d2 && state.size(3) == d3, op,
                  ": state must be [P, HV, ", vk ? "V, K" : "K, V", "] = [P, ", HV, ", ", d2, ", ", d3,
                  "] for layout ", vk ? "vk" : "kv", ", got ", shape_of(state));
  const int64_t slot_stride = check_pool(op, state, vk);

  // Slots: idx [N], or [N, C] with a checkpoint per token (C >= the tokens of a request).
  if (idx.dim() == 2) {
    check_index(op, idx, "idx", {N, -1}, "a slot per token");
    CUDELTA_CHECK(idx.size(1) >= 1 && (varlen || idx.size(1) >= x.tokens), op, ": idx [N, C] needs a column for each of ",
                  "the ", x.tokens, " tokens of a request, got ", shape_of(idx));
  } else {
    check_index(op, idx, "idx", {N}, "a slot per request");
  }
  if (x.num_accepted_tokens.has_value()) {
    CUDELTA_CHECK(idx.dim() == 2, op, ": num_accepted_tokens picks the starting slot among idx[n, :]: idx must be ",
                  "[N, C], got ", shape_of(idx));
    check_index(op, *x.num_accepted_tokens, "num_accepted_tokens", {N}, "accepted tokens per request");
  }
  CUDELTA_CHECK(x.min_slot == 0 || x.min_slot == 1, op, ": min_slot ", x.min_slot,
                  " is not accepted; accepted: 0 (invalid_slot='negative'), 1 ('nonpositive')");
  // The epilogue's FP8 output: output_scale, a float32 [1] (vLLM's static per-tensor scale), and out e4m3.
  if (x.output_scale.has_value()) {
    CUDELTA_CHECK(x.output_gate.has_value(), op, ": output_scale quantizes the gated RMSNorm epilogue's output to FP8: ",
                  "pass output_gate and norm_weight too");
    CUDELTA_CHECK(x.output_scale->scalar_type() == ScalarType::Float && x.output_scale->numel() == 1, op,
                  ": output_scale must be a float32 tensor of one element, got ", dtype_name(x.output_scale->scalar_type()),
                  " ", shape_of(*x.output_scale));
    CUDELTA_CHECK(out.scalar_type() == ScalarType::Float8_e4m3fn, op,
                  ": out must be float8_e4m3fn with output_scale (the FP8 output), got ", dtype_name(out.scalar_type()));
  } else {
    CUDELTA_CHECK(out.scalar_type() == v.scalar_type(), op, ": out must have v's dtype ",
                  dtype_name(v.scalar_type()), ", got ", dtype_name(out.scalar_type()),
                  out.scalar_type() == ScalarType::Float8_e4m3fn ? " (an FP8 out needs output_scale)" : "");
  }
  CUDELTA_CHECK(out.dim() == 3 && out.size(0) == L && out.size(1) == HV && out.size(2) == V &&
                      out.stride(2) == 1,
                  op, ": out must be [", rows, ", HV, V] = [", L, ", ", HV, ", ", V,
                  "] with a contiguous last dim, got ", shape_of(out));

  // The epilogue: output_gate z (out's shape) with norm_weight [V]; the activation 1 (silu) or 2.
  CUDELTA_CHECK(x.output_gate.has_value() == x.norm_weight.has_value(), op,
                ": the gated RMSNorm epilogue needs both output_gate and norm_weight");
  CUDELTA_CHECK(x.output_gate.has_value() ? (x.gate_activation == 1 || x.gate_activation == 2) : x.gate_activation == 0,
                op, ": gate_activation ", x.gate_activation, " is not accepted; accepted: ",
                x.output_gate.has_value() ? "1 (silu), 2 (sigmoid)" : "0 without an output gate");
  if (x.output_gate.has_value()) {
    const Tensor& z = *x.output_gate;
    CUDELTA_CHECK(z.dim() == 3 && z.size(0) == L && z.size(1) == HV && z.size(2) == V && z.stride(2) == 1, op,
                  ": output_gate must be [", rows, ", HV, V] = [", L, ", ", HV, ", ", V,
                  "] with a contiguous last dim, got ", shape_of(z));
    float_dtype(op, "output_gate", z.scalar_type());
    const Tensor& w = *x.norm_weight;
    CUDELTA_CHECK(w.dim() == 1 && w.size(0) == V && w.is_contiguous(), op, ": norm_weight must be a contiguous [V] = [",
                  V, "], got ", shape_of(w));
    float_dtype(op, "norm_weight", w.scalar_type());
    CUDELTA_CHECK(x.norm_eps >= 0, op, ": norm_eps must be >= 0, got ", x.norm_eps);
  }

  // What the op writes (out, the pool's slots) shares no byte with what it reads: the kernels read
  // inputs after they write out (cudelta/_contract.py check_no_overlap, in the same words).
  const char* accepted = "; accepted: buffers that share no byte with each other";
  const Span out_span = span_of(out);
  CUDELTA_CHECK(!meets_slots(state, slot_stride, out_span), op, ": out shares memory with the state pool", accepted,
                " (out is written, the pool read and written)");
  auto opt = [](const std::optional<Tensor>& t) { return t.has_value() ? &*t : nullptr; };
  const std::pair<const Tensor*, const char*> inputs[] = {
      {&q, "q"}, {&k, "k"}, {&v, "v"}, {&idx, "idx"}, {opt(x.cu_seqlens), "cu_seqlens"},
      {opt(x.num_accepted_tokens), "num_accepted_tokens"}, {opt(x.output_gate), "output_gate"},
      {opt(x.norm_weight), "norm_weight"}, {opt(x.g), "g"}, {opt(x.beta), "beta"}, {opt(x.a), "a"},
      {opt(x.b), "b"}, {opt(x.A_log), "A_log"}, {opt(x.dt_bias), "dt_bias"}, {opt(x.output_scale), "output_scale"}};
  constexpr size_t kInputs = sizeof(inputs) / sizeof(inputs[0]);
  Span spans[kInputs];  // an absent input's is empty: it meets nothing
  for (size_t i = 0; i < kInputs; ++i) {
    if (inputs[i].first == nullptr) continue;
    spans[i] = span_of(*inputs[i].first);
    CUDELTA_CHECK(!overlaps(spans[i], out_span), op, ": out shares memory with ",
                  inputs[i].second, accepted, " (out is written while ", inputs[i].second, " is still read)");
  }
  for (size_t i = 0; i < kInputs; ++i) {
    CUDELTA_CHECK(!meets_slots(state, slot_stride, spans[i]), op, ": ", inputs[i].second,
                  " shares memory with the state pool's slots", accepted, " (the pool is written while ",
                  inputs[i].second, " is still read)");
  }

  ImageInfo info{};
  const Variant chosen = select(device, x.variant, N * HV, &info, vk);

  GdnDecodeParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_stride_n = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_stride_n = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.v_stride_n = v.stride(0);
  p.v_stride_h = v.stride(1);
  p.dtype = dt;
  p.qk_aligned = aligned16(q) && aligned16(k);
  p.g = gate.data_ptr();
  p.g_dtype = float_dtype(op, "g", gate.scalar_type());
  p.g_stride_n = gate.stride(0);
  p.g_stride_h = gate.stride(1);
  p.gate_raw = gate_raw;
  p.g_per_channel = x.per_channel;
  if (gate_raw) {
    p.A_log = x.A_log->data_ptr();
    p.A_log_dtype = float_dtype(op, "A_log", x.A_log->scalar_type());
    p.dt_bias = x.dt_bias->data_ptr();
    p.dt_bias_dtype = float_dtype(op, "dt_bias", x.dt_bias->scalar_type());
    p.gate_lower_bound = static_cast<float>(x.gate_lower_bound);
  }
  p.beta = bt.data_ptr();
  p.beta_dtype = float_dtype(op, "beta", bt.scalar_type());
  p.beta_stride_n = bt.stride(0);
  p.beta_stride_h = bt.stride(1);
  p.beta_raw = !x.beta.has_value();
  p.state = state.data_ptr();
  p.state_dtype = state.scalar_type() == ScalarType::Float ? DType::kFloat32 : DType::kBFloat16;
  p.state_vk = vk;
  p.state_stride_p = slot_stride;
  p.idx = idx.data_ptr();
  p.idx_is_int64 = idx.scalar_type() == ScalarType::Long;
  p.min_slot = x.min_slot;
  p.out = out.data_ptr();
  p.out_stride_n = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.N = N;
  p.H = H;
  p.HV = HV;
  p.K = K;
  p.V = V;
  p.P = state.size(0);
  p.scale = static_cast<float>(x.scale);
  p.use_qk_l2norm = x.use_qk_l2norm;
  p.device = device;
  p.sm_count = info.sm_count;
  p.pdl = x.pdl && info.cuda_arch >= 900;
  p.early_state = p.pdl && x.early_state;
  p.clusters = info.cuda_arch >= 900;
  p.image_arch = info.cuda_arch;
  p.tokens = x.tokens;
  p.L = L;
  if (varlen) {
    p.cu_seqlens = x.cu_seqlens->data_ptr();
    p.cu_is_int64 = x.cu_seqlens->scalar_type() == ScalarType::Long;
  }
  p.idx_columns = idx.dim() == 2 ? idx.size(1) : 0;
  if (x.num_accepted_tokens.has_value()) {
    p.accepted = x.num_accepted_tokens->data_ptr();
    p.accepted_is_int64 = x.num_accepted_tokens->scalar_type() == ScalarType::Long;
  }
  if (x.output_gate.has_value()) {
    p.gate_activation = static_cast<int>(x.gate_activation);
    p.z = x.output_gate->data_ptr();
    p.z_dtype = float_dtype(op, "output_gate", x.output_gate->scalar_type());
    p.z_stride_n = x.output_gate->stride(0);
    p.z_stride_h = x.output_gate->stride(1);
    p.norm_weight = x.norm_weight->data_ptr();
    p.norm_weight_dtype = float_dtype(op, "norm_weight", x.norm_weight->scalar_type());
    p.norm_eps = static_cast<float>(x.norm_eps);
  }
  p.out_scale = x.output_scale.has_value() ? static_cast<const float*>(x.output_scale->data_ptr()) : nullptr;

  torch::stable::accelerator::DeviceGuard guard(device);
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  const int err = launch_gdn_decode(p, chosen, stream);
  CUDELTA_CHECK(err == 0, op, ": kernel launch failed: ", cuda_error_string(err));
}

// The registered op: its arguments gathered into one DecodeArgs, in the schema's order.
void decode_op(Tensor q, Tensor k, Tensor v, std::optional<Tensor> g, std::optional<Tensor> beta,
               std::optional<Tensor> a, std::optional<Tensor> b, std::optional<Tensor> A_log,
               std::optional<Tensor> dt_bias, Tensor state, Tensor idx, Tensor out, std::optional<Tensor> cu_seqlens,
               std::optional<Tensor> num_accepted_tokens, std::optional<Tensor> output_gate,
               std::optional<Tensor> norm_weight, double scale, double norm_eps, bool per_channel, bool use_qk_l2norm,
               int64_t layout, int64_t min_slot, int64_t tokens, int64_t gate_activation, int64_t variant, bool pdl,
               bool early_state, double gate_lower_bound, std::optional<Tensor> output_scale) {
  decode(DecodeArgs{q, k, v, g, beta, a, b, A_log, dt_bias, state, idx, out, cu_seqlens, num_accepted_tokens,
                    output_gate, norm_weight, scale, norm_eps, per_channel, use_qk_l2norm, layout, min_slot, tokens,
                    gate_activation, variant, pdl, early_state, gate_lower_bound, output_scale});
}

// cudelta::conv_update: the causal-conv1d update before the step (ConvUpdateParams, launch.h).
// Shapes, dtypes and strides are checked here; the per-request data (slots, spans, accepted counts)
// on the device, where a request the pool cannot hold is skipped (cudelta/conv_reference.py raises).
void conv_update_op(Tensor x, Tensor conv_state, Tensor weight, std::optional<Tensor> bias, Tensor indices,
                    std::optional<Tensor> cu_seqlens, std::optional<Tensor> num_accepted_tokens, Tensor out,
                    int64_t null_block_id, bool silu, bool pdl) {
  const char* op = "cudelta.conv_update";
  CUDELTA_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor");
  const int device = x.get_device_index();
  for (auto [t, name] : {std::pair<const Tensor&, const char*>{conv_state, "conv_state"}, {weight, "weight"},
                         {indices, "conv_state_indices"}, {out, "out"}}) {
    check_cuda(op, t, name, device);
  }
  for (auto [t, name] : {std::pair<const std::optional<Tensor>&, const char*>{bias, "bias"},
                         {cu_seqlens, "cu_seqlens"}, {num_accepted_tokens, "num_accepted_tokens"}}) {
    if (t.has_value()) check_cuda(op, *t, name, device);
  }
  CUDELTA_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [tokens, dim] with dim contiguous, got ",
                shape_of(x));
  const int64_t L = x.size(0), dim = x.size(1);
  // [dim, width], or vLLM's KDA decode layout [segments, width, dim / segments] (q, k, v tap-major).
  const bool segmented = weight.dim() == 3;
  CUDELTA_CHECK((weight.dim() == 2 && weight.size(0) == dim) ||
                    (segmented && weight.size(0) >= 1 && weight.size(0) * weight.size(2) == dim),
                op, ": weight must be [dim=", dim, ", width] or [segments, width, dim / segments], got ",
                shape_of(weight));
  const int64_t width = weight.size(1);
  CUDELTA_CHECK(width >= 2 && width <= 4, op, ": conv width ", width, " is not supported; accepted: 2, 3, 4");
  CUDELTA_CHECK(conv_state.dim() == 3 && conv_state.size(1) == dim && conv_state.size(2) >= width - 1, op,
                ": conv_state must be [slots, dim=", dim, ", state_len >= width - 1 = ", width - 1, "], got ",
                shape_of(conv_state));
  for (int64_t d = 0; d < 3; ++d)
    CUDELTA_CHECK(conv_state.stride(d) >= 0, op, ": conv_state's strides must be non-negative");
  CUDELTA_CHECK(out.dim() == 2 && out.size(0) == L && out.size(1) == dim && out.stride(1) == 1 &&
                    out.scalar_type() == x.scalar_type(),
                op, ": out must be x's shape ", shape_of(x), " and dtype ", dtype_name(x.scalar_type()),
                " with dim contiguous, got ", dtype_name(out.scalar_type()), " ", shape_of(out));
  if (bias.has_value())
    CUDELTA_CHECK(bias->dim() == 1 && bias->size(0) == dim && bias->is_contiguous(), op,
                  ": bias must be a contiguous [dim=", dim, "], got ", shape_of(*bias));
  CUDELTA_CHECK(indices.dim() == 1 && indices.stride(0) >= 0 &&
                    (indices.scalar_type() == ScalarType::Int || indices.scalar_type() == ScalarType::Long),
                op, ": conv_state_indices must be an int32/int64 [N] tensor (a slot a request; any stride), got ",
                dtype_name(indices.scalar_type()), " ", shape_of(indices));
  const int64_t N = indices.size(0);
  CUDELTA_CHECK(cu_seqlens.has_value() == num_accepted_tokens.has_value(), op,
                ": cu_seqlens and num_accepted_tokens go together (speculative decoding) or not at all "
                "(one token a row)");
  if (cu_seqlens.has_value()) {
    check_index(op, *cu_seqlens, "cu_seqlens", {N + 1}, "token offsets [N+1]");
    check_index(op, *num_accepted_tokens, "num_accepted_tokens", {N}, "accepted tokens a request");
  } else {
    CUDELTA_CHECK(L == N, op, ": one token a row: x has ", L, " rows for ", N, " conv_state_indices");
  }
  const Span state_span = span_of(conv_state);
  for (auto [t, name] : {std::pair<const Tensor&, const char*>{x, "x"}, {out, "out"}}) {
    CUDELTA_CHECK(!overlaps(span_of(t), state_span), op, ": ", name, " shares memory with conv_state");
  }

  ConvUpdateParams p{};
  p.x = x.data_ptr();
  p.x_dtype = float_dtype(op, "x", x.scalar_type());
  p.x_stride_row = x.stride(0);
  p.out = out.data_ptr();
  p.out_stride_row = out.stride(0);
  p.conv_state = conv_state.data_ptr();
  p.state_dtype = float_dtype(op, "conv_state", conv_state.scalar_type());
  p.cs_slot = conv_state.stride(0);
  p.cs_dim = conv_state.stride(1);
  p.cs_col = conv_state.stride(2);
  p.weight = weight.data_ptr();
  p.weight_dtype = float_dtype(op, "weight", weight.scalar_type());
  p.w_stride_dim = segmented ? weight.stride(2) : weight.stride(0);
  p.w_stride_tap = weight.stride(1);
  p.w_seg = segmented ? weight.size(2) : dim;
  p.w_stride_seg = segmented ? weight.stride(0) : 0;
  if (bias.has_value()) {
    p.bias = bias->data_ptr();
    p.bias_dtype = float_dtype(op, "bias", bias->scalar_type());
  }
  p.indices = indices.data_ptr();
  p.indices_int64 = indices.scalar_type() == ScalarType::Long;
  p.indices_stride = indices.stride(0);
  if (cu_seqlens.has_value()) {
    p.cu_seqlens = cu_seqlens->data_ptr();
    p.cu_int64 = cu_seqlens->scalar_type() == ScalarType::Long;
    p.accepted = num_accepted_tokens->data_ptr();
    p.accepted_int64 = num_accepted_tokens->scalar_type() == ScalarType::Long;
  }
  p.N = N;
  p.dim = dim;
  p.width = width;
  p.state_len = conv_state.size(2);
  p.slots = conv_state.size(0);
  p.L = L;
  p.null_block_id = null_block_id;
  p.silu = silu;
  p.device = device;
  // Runs of 4 channels as vectors: each run's bytes aligned to their size in x, out and the state.
  const auto run_aligned = [](const Tensor& t, std::initializer_list<int64_t> strides) {
    const int64_t run = 4 * static_cast<int64_t>(t.element_size());
    bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % run == 0;
    for (int64_t s : strides) ok = ok && (s * static_cast<int64_t>(t.element_size())) % run == 0;
    return ok;
  };
  const bool one_dtype = conv_state.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                        (!bias.has_value() || bias->scalar_type() == x.scalar_type());
  // The vector builds: 4 channels a thread, each run aligned in x, out and the bias, and (but for
  // the DS fp32-taps build, which moves whole windows) in the state's columns.
  const bool xo_runs4 = dim % 4 == 0 && run_aligned(x, {x.stride(0)}) && run_aligned(out, {out.stride(0)}) &&
                        (!bias.has_value() || run_aligned(*bias, {}));
  const bool runs4 = xo_runs4 && conv_state.stride(1) == 1 &&
                     run_aligned(conv_state, {conv_state.stride(0), conv_state.stride(2)});
  p.vec = one_dtype && runs4 && !segmented && weight.stride(1) == 1 && weight.stride(0) == width &&
          reinterpret_cast<uintptr_t>(weight.data_ptr()) % 8 == 0;
  // A tap's 4 channels of the fp32 weight one 16-byte vector: whole runs in every segment.
  const bool taps = segmented && width == 4 && p.w_stride_dim == 1 && p.w_seg % 4 == 0 &&
                   run_aligned(weight, {p.w_stride_seg, p.w_stride_tap}) && weight.scalar_type() == ScalarType::Float &&
                   x.scalar_type() == ScalarType::BFloat16 && conv_state.scalar_type() == ScalarType::BFloat16 &&
                   (!bias.has_value() || bias->scalar_type() == ScalarType::Float) &&
                   (!cu_seqlens.has_value() || conv_state.size(2) - 2 <= 2);
  p.f32_taps = taps && runs4;
  // DS pages: each slot's [dim, 3] contiguous, 4 channels' windows one 24-byte run on 8 bytes.
  p.f32_taps_ds = taps && xo_runs4 && !cu_seqlens.has_value() && conv_state.size(2) == 3 &&
                  conv_state.stride(1) == 3 && conv_state.stride(2) == 1 &&
                  reinterpret_cast<uintptr_t>(conv_state.data_ptr()) % 8 == 0 && (conv_state.stride(0) * 2) % 8 == 0;
  ImageInfo info{};
  select(device, -1, 1, &info);  // names a GPU this build has no image for
  p.pdl = pdl && info.cuda_arch >= 900;

  torch::stable::accelerator::DeviceGuard guard(device);
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  const int err = launch_conv_update(p, stream);
  CUDELTA_CHECK(err == 0, op, ": kernel launch failed: ", cuda_error_string(err));
}

int64_t select_variant(int64_t device, int64_t requested, int64_t heads) {
  ImageInfo info{};
  return static_cast<int64_t>(select(static_cast<int>(device), requested, heads, &info));
}

std::vector<int64_t> probe(int64_t device) {
  const int cc = device_compute_capability(static_cast<int>(device));
  CUDELTA_CHECK(cc > 0, "cudelta.probe: no CUDA device ", device);
  ImageInfo info{};
  const int err = probe_image(static_cast<int>(device), &info);
  if (err != 0) return {cc, 0, 0, 0, -1};  // no image: the caller reports it with the built archs
  return {cc, info.cuda_arch, info.arch_specific ? 1 : 0, info.family_specific ? 1 : 0,
          static_cast<int64_t>(select(static_cast<int>(device), -1, int64_t(1) << 30, &info))};
}

std::string build_info() { return kBuildInfoJson; }

// The variant table as JSON, [{"name": "warp", "id": 0, "min_arch": 0}, ...]: all Python knows of
// the variants (cudelta/_native.py variants()).
std::string variants() {
  std::string out = "[";
  for (const VariantInfo& v : kVariants) {
    out += (out.size() > 1 ? ", " : "") + std::string("{\"name\": \"") + v.name + "\", \"id\": " +
           std::to_string(static_cast<int>(v.id)) + ", \"min_arch\": " + std::to_string(v.min_arch) + "}";
  }
  return out + "]";
}

}  // namespace
}  // namespace cudelta

STABLE_TORCH_LIBRARY(cudelta, m) {
  // Gates: g or the raw a (with A_log, dt_bias); beta or the raw b; per_channel: KDA's decay.
  // layout 0 = "kv" [P, HV, K, V], 1 = "vk" [P, HV, V, K]; min_slot 0 or 1 (slot 0 a null block).
  // Rows of q etc.: requests, or tokens (`tokens` a request, or cu_seqlens [N+1]); idx [N] or
  // [N, C] (a checkpoint per token). gate_activation 0 (no epilogue), 1 silu, 2 sigmoid;
  // variant -1 = auto; pdl: programmatic dependent launch where the image is sm_90+ (CUDELTA_PDL,
  // read once in Python); early_state: the kernel before it in the stream is cudelta's conv update
  // of the same layer step (GdnDecodeParams::early_state); gate_lower_bound < 0: the raw gate's
  // bounded form (GdnDecodeParams::gate_lower_bound), 0 none; output_scale: the epilogue's FP8 output
  // (a float32 [1], out then float8_e4m3fn). The output goes to `out` (engines preallocate it; the
  // Python API does too).
  m.def(
      "decode(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? a, Tensor? b, Tensor? A_log, "
      "Tensor? dt_bias, Tensor(a!) state, Tensor idx, Tensor(b!) out, Tensor? cu_seqlens, "
      "Tensor? num_accepted_tokens, Tensor? output_gate, Tensor? norm_weight, float scale, float norm_eps, "
      "bool per_channel, bool use_qk_l2norm, int layout, int min_slot, int tokens, int gate_activation, "
      "int variant, bool pdl, bool early_state=False, float gate_lower_bound=0., Tensor? output_scale=None) -> ()");
  // The causal-conv1d update before the step: x [tokens, dim], conv_state [slots, dim, state_len]
  // updated in place, out [tokens, dim] (may be x); one token a row, or cu_seqlens with
  // num_accepted_tokens (speculative decoding); silu or no activation.
  m.def(
      "conv_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor conv_state_indices, "
      "Tensor? cu_seqlens, Tensor? num_accepted_tokens, Tensor(b!) out, int null_block_id, bool silu, bool pdl) -> ()");
  m.def("select_variant(int device, int requested, int heads) -> int");
  m.def("probe(int device) -> int[]");
  m.def("build_info() -> str");
  m.def("variants() -> str");
}

STABLE_TORCH_LIBRARY_IMPL(cudelta, CUDA, m) {
  m.impl("decode", TORCH_BOX(&cudelta::decode_op));
  m.impl("conv_update", TORCH_BOX(&cudelta::conv_update_op));
}

STABLE_TORCH_LIBRARY_IMPL(cudelta, CompositeExplicitAutograd, m) {
  m.impl("select_variant", TORCH_BOX(&cudelta::select_variant));
  m.impl("probe", TORCH_BOX(&cudelta::probe));
  m.impl("build_info", TORCH_BOX(&cudelta::build_info));
  m.impl("variants", TORCH_BOX(&cudelta::variants));
}
