// The adafisher_step_ op: checks every argument (naming it), builds the work list and
// hands it to the launchers in adafisher_step.cu.  Compiled by the host compiler so
// that a failed check raises a Python RuntimeError on every toolchain.
#include "adafisher_step.h"
#include "step_launch.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace lightning_cafin {
namespace {

// Numbers in check messages are formatted with std::to_string, never streamed.  On the
// GPU machine's toolchain (torch 2.11, extension built by /opt/gcc) the extension carries
// its own copy of std::ostream::_M_insert<long>; streaming any integer or double into
// c10::str's ostringstream jumped through a mismatched locale facet and segfaulted (seen
// under cuda-gdb: SIGSEGV in basic_ostream::_M_insert<long> inside lightning_cafin_C.so,
// called from adafisher_step_), so every failed check that carried a number crashed the
// process instead of raising.  Strings and const char* are streamed safely.
template <typename T>
std::string num(T v) {
  return std::to_string(v);
}

std::string dims_str(at::IntArrayRef dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(dims[i]);
  }
  return out + ")";
}

const char* kOp = "adafisher_step_: ";

void check_same_list_size(int64_t n, int64_t got, const char* name) {
  TORCH_CHECK(got == n, kOp, name, " has ", num(got), " entries but params has ", num(n));
}

void check_dense(const at::Tensor& t, const char* name, int64_t i, const c10::Device& device) {
  TORCH_CHECK(t.defined(), kOp, name, "[", num(i), "] is undefined (None)");
  TORCH_CHECK(t.is_cuda(), kOp, name, "[", num(i), "] must be a CUDA tensor, got a tensor on ",
              t.device());
  TORCH_CHECK(t.device() == device, kOp, name, "[", num(i), "] is on ", t.device().str(),
              " but params[0] is on ", device.str(), "; call the op once per device");
}

void check_scalar_f32(const at::Tensor& t, const char* name, const c10::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, kOp, name, " must be on ", device.str(),
              ", got a tensor on ", t.device().str());
  TORCH_CHECK(t.scalar_type() == at::kFloat, kOp, name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == 1, kOp, name, " must have exactly one element, got ", num(t.numel()));
}

bool supported_param_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

}  // namespace

void adafisher_step_(const std::vector<at::Tensor>& params,
                     const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs,
                     const std::vector<at::Tensor>& steps,
                     const std::vector<std::optional<at::Tensor>>& S_list,
                     const std::vector<std::optional<at::Tensor>>& H_list,
                     const std::vector<int64_t>& col_offsets,
                     const std::vector<int64_t>& ncols,
                     double lr,
                     double beta,
                     double Lambda,
                     double weight_decay,
                     bool decoupled,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& lr_tensor) {
  // Indices are int64_t, not size_t, in every message (see the note in dims_str).
  const int64_t n = static_cast<int64_t>(params.size());
  check_same_list_size(n, grads.size(), "grads");
  check_same_list_size(n, exp_avgs.size(), "exp_avgs");
  check_same_list_size(n, steps.size(), "steps");
  check_same_list_size(n, S_list.size(), "S_list");
  check_same_list_size(n, H_list.size(), "H_list");
  check_same_list_size(n, col_offsets.size(), "col_offsets");
  check_same_list_size(n, ncols.size(), "ncols");
  TORCH_CHECK(beta >= 0.0 && beta < 1.0, kOp, "beta must lie in [0, 1), got ", num(beta));
  if (n == 0) return;

  TORCH_CHECK(params[0].defined(), kOp, "params[0] is undefined (None)");
  TORCH_CHECK(params[0].is_cuda(), kOp, "params[0] must be a CUDA tensor, got a tensor on ",
              params[0].device().str());
  const c10::Device device = params[0].device();
  const at::ScalarType pdtype = params[0].scalar_type();
  TORCH_CHECK(supported_param_dtype(pdtype), kOp,
              "params must be float32, float16 or bfloat16, got params[0] of dtype ", pdtype);
  TORCH_CHECK(exp_avgs[0].defined(), kOp, "exp_avgs[0] is undefined (None)");
  const at::ScalarType mdtype = exp_avgs[0].scalar_type();
  TORCH_CHECK(mdtype == pdtype || mdtype == at::kFloat, kOp,
              "exp_avgs must have the params' dtype (", pdtype, ") or float32, got ", mdtype);

  std::vector<StepItem> items;
  items.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const at::Tensor& m = exp_avgs[i];
    const at::Tensor& s = steps[i];
    check_dense(p, "params", i, device);
    check_dense(g, "grads", i, device);
    check_dense(m, "exp_avgs", i, device);
    check_dense(s, "steps", i, device);
    TORCH_CHECK(p.scalar_type() == pdtype, kOp, "params[", num(i), "] has dtype ", p.scalar_type(),
                " but params[0] has ", pdtype, "; group tensors by dtype");
    TORCH_CHECK(g.scalar_type() == pdtype, kOp, "grads[", num(i), "] has dtype ", g.scalar_type(),
                " but params[", num(i), "] has ", pdtype);
    TORCH_CHECK(m.scalar_type() == mdtype, kOp, "exp_avgs[", num(i), "] has dtype ",
                m.scalar_type(), " but exp_avgs[0] has ", mdtype,
                "; group tensors by momentum dtype");
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == 1, kOp, "steps[", num(i),
                "] must be a float32 tensor with one element, got dtype ", s.scalar_type(),
                " and ", num(s.numel()), " elements");
    TORCH_CHECK(p.is_contiguous(), kOp, "params[", num(i), "] must be contiguous (strides ",
                dims_str(p.strides()), ")");
    TORCH_CHECK(g.is_contiguous(), kOp, "grads[", num(i), "] must be contiguous (strides ",
                dims_str(g.strides()), ")");
    TORCH_CHECK(m.is_contiguous(), kOp, "exp_avgs[", num(i), "] must be contiguous (strides ",
                dims_str(m.strides()), ")");
    TORCH_CHECK(g.sizes() == p.sizes(), kOp, "grads[", num(i), "] has shape ", dims_str(g.sizes()),
                " but params[", num(i), "] has shape ", dims_str(p.sizes()));
    TORCH_CHECK(m.sizes() == p.sizes(), kOp, "exp_avgs[", num(i), "] has shape ", dims_str(m.sizes()),
                " but params[", num(i), "] has shape ", dims_str(p.sizes()));

    StepItem it;
    it.p = p.data_ptr();
    it.g = g.data_ptr();
    it.m = m.data_ptr();
    it.step = s.data_ptr<float>();
    it.numel = p.numel();
    it.S = nullptr;
    it.H = nullptr;
    it.ncols = 1;

    const bool has_S = S_list[i].has_value() && S_list[i]->defined();
    const bool has_H = H_list[i].has_value() && H_list[i]->defined();
    TORCH_CHECK(has_S == has_H, kOp, "S_list[", num(i), "] and H_list[", num(i),
                "] must both be tensors or both be None");
    if (has_S) {
      const at::Tensor& S = *S_list[i];
      const at::Tensor& H = *H_list[i];
      check_dense(S, "S_list", i, device);
      check_dense(H, "H_list", i, device);
      TORCH_CHECK(S.scalar_type() == at::kFloat, kOp, "S_list[", num(i), "] must be float32, got ",
                  S.scalar_type());
      TORCH_CHECK(H.scalar_type() == at::kFloat, kOp, "H_list[", num(i), "] must be float32, got ",
                  H.scalar_type());
      TORCH_CHECK(S.dim() == 1 && S.is_contiguous(), kOp, "S_list[", num(i),
                  "] must be a contiguous 1-D tensor, got shape ", dims_str(S.sizes()), " strides ",
                  dims_str(S.strides()));
      TORCH_CHECK(H.dim() == 1 && H.is_contiguous(), kOp, "H_list[", num(i),
                  "] must be a contiguous 1-D tensor, got shape ", dims_str(H.sizes()), " strides ",
                  dims_str(H.strides()));
      const int64_t nc = ncols[i];
      const int64_t off = col_offsets[i];
      TORCH_CHECK(nc >= 1 && nc <= std::numeric_limits<int32_t>::max(), kOp, "ncols[", num(i),
                  "] must lie in [1, 2^31), got ", num(nc));
      TORCH_CHECK(p.numel() == S.numel() * nc, kOp, "params[", num(i), "] has ", num(p.numel()),
                  " elements but len(S_list[", num(i), "]) * ncols[", num(i), "] = ", num(S.numel()), " * ", num(nc));
      TORCH_CHECK(off >= 0 && off + nc <= H.numel(), kOp, "col_offsets[", num(i), "] + ncols[", num(i),
                  "] = ", num(off), " + ", num(nc), " exceeds len(H_list[", num(i), "]) = ", num(H.numel()));
      if (p.numel() > 0) {
        it.S = S.data_ptr<float>();
        it.H = H.data_ptr<float>() + off;
        it.ncols = static_cast<int32_t>(nc);
      }
    }
    TORCH_CHECK((it.numel + kStepChunkSize - 1) / kStepChunkSize <=
                    std::numeric_limits<int32_t>::max(),
                kOp, "params[", num(i), "] is too large (", num(it.numel), " elements)");
    items.push_back(it);
  }

  const float* gs_ptr = nullptr;
  const float* fi_ptr = nullptr;
  if (grad_scale.has_value() && grad_scale->defined()) {
    check_scalar_f32(*grad_scale, "grad_scale", device);
    gs_ptr = grad_scale->data_ptr<float>();
  }
  if (found_inf.has_value() && found_inf->defined()) {
    check_scalar_f32(*found_inf, "found_inf", device);
    fi_ptr = found_inf->data_ptr<float>();
  }

  StepScalars sc;
  sc.lr_ptr = nullptr;
  if (lr_tensor.has_value() && lr_tensor->defined()) {
    check_scalar_f32(*lr_tensor, "lr_tensor", device);
    sc.lr_ptr = lr_tensor->data_ptr<float>();
  }
  sc.lr = lr;
  sc.beta = beta;
  sc.lr_f = static_cast<float>(lr);
  sc.beta_f = static_cast<float>(beta);
  sc.one_minus_beta_f = static_cast<float>(1.0 - beta);
  sc.lambda_f = static_cast<float>(Lambda);
  sc.wd_f = static_cast<float>(weight_decay);
  sc.decoupled = decoupled ? 1 : 0;
  sc.has_wd = weight_decay != 0.0 ? 1 : 0;

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  launch_adafisher_step(items.data(), items.size(), pdtype, mdtype, sc, gs_ptr, fi_ptr, stream);
  // Ordered after every step launch on the same stream: no block reads a counter
  // that is being incremented.
  std::vector<float*> step_ptrs;
  step_ptrs.reserve(steps.size());
  for (const at::Tensor& s : steps) step_ptrs.push_back(s.data_ptr<float>());
  launch_step_increments(step_ptrs.data(), step_ptrs.size(), fi_ptr, stream);
}

}  // namespace lightning_cafin
