// cudelta's torch ops, registered through the LibTorch stable ABI only, so one library serves
// every torch from the floor set by TORCH_TARGET_VERSION upwards.
//
//   cudelta::gdn_decode      one Gated DeltaNet decode step, state pool updated in place
//   cudelta::kda_decode      the same with Kimi Delta Attention's per-channel decay
//   cudelta::select_variant  the kernel variant that runs on a device for a batch (auto or forced)
//   cudelta::probe           what the driver loaded on a device: __CUDA_ARCH__, feature flags, and
//                            the variant auto picks for large batches
//   cudelta::build_info      the JSON build record embedded at compile time

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../kernels/launch.h"
#include "build_info.h"

namespace cudelta {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::Double: return "float64";
    default: return "another dtype";
  }
}

std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

std::string fix_command(int cc) {
  return "FORCE_BUILD=1 TORCH_CUDA_ARCH_LIST=" + std::to_string(cc / 10) + "." + std::to_string(cc % 10) +
         " pip install --no-cache-dir --force-reinstall cudelta";
}

Variant select(int device, int64_t requested, int64_t heads, ImageInfo* info) {
  const int err = probe_image(device, info);
  if (err != 0) {
    const int cc = device_compute_capability(device);
    STD_TORCH_CHECK(cc > 0, "cudelta: cannot read the compute capability of CUDA device ", device);
    STD_TORCH_CHECK(false, "cudelta: this build has no kernel image for CUDA device ", device, " (compute ", cc / 10,
                    ".", cc % 10, "): ", cuda_error_string(err), ". Built for ", kBuildArchs,
                    ". Build for this GPU with: ", fix_command(cc));
  }
  if (requested < 0) return auto_variant(info->cuda_arch, heads);
  STD_TORCH_CHECK(requested < kNumVariants, "cudelta: kernel variant ", requested,
                  " does not exist; accepted: generic, sm80, sm90, sm90tma (CUDELTA_KERNEL_VARIANT)");
  const auto v = static_cast<Variant>(requested);
  const int cc = info->compute_capability;
  STD_TORCH_CHECK(variant_min_arch(v) <= info->cuda_arch, "cudelta: kernel variant ", variant_name(v),
                  " needs an sm_", variant_min_arch(v) / 10, "+ image, but CUDA device ", device, " (compute ",
                  cc / 10, ".", cc % 10, ") runs the sm_", info->cuda_arch / 10,
                  " image; variants it can run: generic", info->cuda_arch >= 800 ? ", sm80" : "",
                  info->cuda_arch >= 900 ? ", sm90, sm90tma" : "");
  return v;
}

void check_cuda(const char* op, const Tensor& t, const char* name, int device) {
  STD_TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor");
  STD_TORCH_CHECK(t.get_device_index() == device, op, ": ", name, " is on cuda:", t.get_device_index(),
                  " but q is on cuda:", device, "; all tensors must be on one device");
}

DType to_dtype(const char* op, ScalarType t) {
  switch (t) {
    case ScalarType::Float: return DType::kFloat32;
    case ScalarType::Half: return DType::kFloat16;
    case ScalarType::BFloat16: return DType::kBFloat16;
    default:
      STD_TORCH_CHECK(false, op, ": q has dtype ", dtype_name(t),
                      "; accepted: bfloat16, float16, float32");
  }
  return DType::kFloat32;
}

Tensor decode(const char* op, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, Tensor idx,
              double scale, bool use_qk_l2norm, int64_t variant, bool per_channel) {
  STD_TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor");
  const int device = q.get_device_index();
  for (auto [t, name] : {std::pair<const Tensor&, const char*>{k, "k"}, {v, "v"}, {g, "g"}, {beta, "beta"},
                         {state, "state"}, {idx, "idx"}}) {
    check_cuda(op, t, name, device);
  }
  STD_TORCH_CHECK(q.dim() == 3, op, ": q must be [N, H, K], got shape ", shape_of(q));
  const int64_t N = q.size(0), H = q.size(1), K = q.size(2);
  STD_TORCH_CHECK(k.dim() == 3 && k.size(0) == N && k.size(1) == H && k.size(2) == K,
                  op, ": k must have q's shape ", shape_of(q), ", got ", shape_of(k));
  STD_TORCH_CHECK(v.dim() == 3 && v.size(0) == N, op, ": v must be [N, HV, V] with N=", N, ", got ",
                  shape_of(v));
  const int64_t HV = v.size(1), V = v.size(2);
  STD_TORCH_CHECK(H > 0 && HV % H == 0, op, ": v's head count HV=", HV,
                  " must be a multiple of q's head count H=", H);
  const DType dt = to_dtype(op, q.scalar_type());
  STD_TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                  op, ": q, k, v must share one dtype; got q ", dtype_name(q.scalar_type()), ", k ",
                  dtype_name(k.scalar_type()), ", v ", dtype_name(v.scalar_type()));
  STD_TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
                  op, ": the last dim of q, k and v must be contiguous");
  STD_TORCH_CHECK(K == 64 || K == 128, op, ": head dim K=", K,
                  " is not supported by the CUDA kernel; accepted: 64, 128");
  STD_TORCH_CHECK(V % 32 == 0 && V > 0, op, ": value dim V=", V, " must be a multiple of 32");
  for (auto [t, name] : {std::pair<const Tensor&, const char*>{g, "g"}, {beta, "beta"}}) {
    STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float, op, ": ", name, " must be float32, got ",
                    dtype_name(t.scalar_type()));
  }
  STD_TORCH_CHECK(beta.dim() == 2 && beta.size(0) == N && beta.size(1) == HV && beta.is_contiguous(), op,
                  ": beta must be a contiguous [N, HV] = [", N, ", ", HV, "] tensor, got ", shape_of(beta));
  if (per_channel) {
    STD_TORCH_CHECK(g.dim() == 3 && g.size(0) == N && g.size(1) == HV && g.size(2) == K && g.is_contiguous(), op,
                    ": g must be a contiguous per-channel [N, HV, K] = [", N, ", ", HV, ", ", K,
                    "] tensor, got ", shape_of(g));
  } else {
    STD_TORCH_CHECK(g.dim() == 2 && g.size(0) == N && g.size(1) == HV && g.is_contiguous(), op,
                    ": g must be a contiguous [N, HV] = [", N, ", ", HV, "] tensor, got ", shape_of(g),
                    " (per-channel gates are kda_decode)");
  }
  STD_TORCH_CHECK(state.scalar_type() == ScalarType::Float, op, ": state must be float32, got ",
                  dtype_name(state.scalar_type()));
  STD_TORCH_CHECK(state.dim() == 4 && state.size(1) == HV && state.size(2) == K && state.size(3) == V,
                  op, ": state must be [P, HV, K, V] = [P, ", HV, ", ", K, ", ", V, "], got ",
                  shape_of(state));
  STD_TORCH_CHECK(state.is_contiguous(), op, ": state must be contiguous");
  STD_TORCH_CHECK(reinterpret_cast<uintptr_t>(state.data_ptr()) % 16 == 0,
                  op, ": state must be 16-byte aligned (a view starting mid-row is not)");
  STD_TORCH_CHECK(idx.scalar_type() == ScalarType::Int || idx.scalar_type() == ScalarType::Long,
                  op, ": idx must be int32 or int64, got ", dtype_name(idx.scalar_type()));
  STD_TORCH_CHECK(idx.dim() == 1 && idx.size(0) == N && idx.is_contiguous(),
                  op, ": idx must be a contiguous [N] = [", N, "] tensor, got ", shape_of(idx));

  ImageInfo info{};
  const Variant chosen = select(device, variant, N * HV, &info);
  Tensor out = torch::stable::new_empty(v, {N, HV, V});

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
  p.g = static_cast<const float*>(g.data_ptr());
  p.g_per_channel = per_channel;
  p.beta = static_cast<const float*>(beta.data_ptr());
  p.state = static_cast<float*>(state.data_ptr());
  p.idx = idx.data_ptr();
  p.idx_is_int64 = idx.scalar_type() == ScalarType::Long;
  p.out = out.data_ptr();
  p.N = N;
  p.H = H;
  p.HV = HV;
  p.K = K;
  p.V = V;
  p.P = state.size(0);
  p.scale = static_cast<float>(scale);
  p.use_qk_l2norm = use_qk_l2norm;
  p.device = device;
  p.sm_count = info.sm_count;

  torch::stable::accelerator::DeviceGuard guard(device);
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  const int err = launch_gdn_decode(p, chosen, stream);
  STD_TORCH_CHECK(err == 0, op, ": kernel launch failed: ", cuda_error_string(err));
  return out;
}

Tensor gdn_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, Tensor idx, double scale,
                  bool use_qk_l2norm, int64_t variant) {
  return decode("cudelta.gdn_decode", q, k, v, g, beta, state, idx, scale, use_qk_l2norm, variant, false);
}

Tensor kda_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, Tensor idx, double scale,
                  bool use_qk_l2norm, int64_t variant) {
  return decode("cudelta.kda_decode", q, k, v, g, beta, state, idx, scale, use_qk_l2norm, variant, true);
}

int64_t select_variant(int64_t device, int64_t requested, int64_t heads) {
  ImageInfo info{};
  return static_cast<int64_t>(select(static_cast<int>(device), requested, heads, &info));
}

std::vector<int64_t> probe(int64_t device) {
  const int cc = device_compute_capability(static_cast<int>(device));
  STD_TORCH_CHECK(cc > 0, "cudelta.probe: no CUDA device ", device);
  ImageInfo info{};
  const int err = probe_image(static_cast<int>(device), &info);
  if (err != 0) return {cc, 0, 0, 0, -1};  // no image: the caller reports it with the built archs
  return {cc, info.cuda_arch, info.arch_specific ? 1 : 0, info.family_specific ? 1 : 0,
          static_cast<int64_t>(select(static_cast<int>(device), -1, int64_t(1) << 30, &info))};
}

std::string build_info() { return kBuildInfoJson; }

}  // namespace
}  // namespace cudelta

STABLE_TORCH_LIBRARY(cudelta, m) {
  m.def(
      "gdn_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor idx, "
      "float scale, bool use_qk_l2norm, int variant) -> Tensor");
  m.def(
      "kda_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor idx, "
      "float scale, bool use_qk_l2norm, int variant) -> Tensor");
  m.def("select_variant(int device, int requested, int heads) -> int");
  m.def("probe(int device) -> int[]");
  m.def("build_info() -> str");
}

STABLE_TORCH_LIBRARY_IMPL(cudelta, CUDA, m) {
  m.impl("gdn_decode", TORCH_BOX(&cudelta::gdn_decode));
  m.impl("kda_decode", TORCH_BOX(&cudelta::kda_decode));
}

STABLE_TORCH_LIBRARY_IMPL(cudelta, CompositeExplicitAutograd, m) {
  m.impl("select_variant", TORCH_BOX(&cudelta::select_variant));
  m.impl("probe", TORCH_BOX(&cudelta::probe));
  m.impl("build_info", TORCH_BOX(&cudelta::build_info));
}
