// The adafisher_step_ op: checks every argument (naming it, checks.h), builds the work
// list, hands it to the launchers in adafisher_step.cu and raises on the error they
// return.  Compiled by the host compiler so that a failed check raises a Python
// RuntimeError on every toolchain.
#include "adafisher_step.h"
#include "checks.h"
#include "record_op.h"
#include "step_launch.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace lightning_cafin {
namespace {

const char* kOp = "adafisher_step_: ";

}  // namespace

void adafisher_step_(const std::vector<at::Tensor>& params,
                     const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs,
                     const std::vector<at::Tensor>& steps,
                     const std::vector<std::optional<at::Tensor>>& S_list,
                     const std::vector<std::optional<at::Tensor>>& H_list,
                     const std::vector<int64_t>& col_offsets,
                     const std::vector<int64_t>& ncols,
                     const std::vector<int64_t>& inners,
                     double lr,
                     double beta,
                     double Lambda,
                     double weight_decay,
                     bool decoupled,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& lr_tensor) {
  LIGHTNING_CAFIN_RECORD_OP("adafisher_step_");
  const int64_t n = static_cast<int64_t>(params.size());
  check_list_size(grads.size(), n, kOp, "grads", "params");
  check_list_size(exp_avgs.size(), n, kOp, "exp_avgs", "params");
  check_list_size(steps.size(), n, kOp, "steps", "params");
  check_list_size(S_list.size(), n, kOp, "S_list", "params");
  check_list_size(H_list.size(), n, kOp, "H_list", "params");
  check_list_size(col_offsets.size(), n, kOp, "col_offsets", "params");
  check_list_size(ncols.size(), n, kOp, "ncols", "params");
  check_list_size(inners.size(), n, kOp, "inners", "params");
  TORCH_CHECK(beta >= 0.0 && beta < 1.0, kOp, "beta must lie in [0, 1), got ", num(beta));
  if (n == 0) return;

  check_cuda(params[0], kOp, "params[0]");
  const c10::Device device = params[0].device();
  const at::ScalarType pdtype = params[0].scalar_type();
  TORCH_CHECK(is_kernel_float(pdtype), kOp, "params must be float32, float16 or bfloat16, got params[0] of dtype ",
              dtype_name(pdtype));
  check_defined(exp_avgs[0], kOp, "exp_avgs[0]");
  const at::ScalarType mdtype = exp_avgs[0].scalar_type();
  TORCH_CHECK(mdtype == pdtype || mdtype == at::kFloat, kOp, "exp_avgs must have the params' dtype (",
              dtype_name(pdtype), ") or float32, got ", dtype_name(mdtype));

  std::vector<StepItem> items;
  items.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const at::Tensor& m = exp_avgs[i];
    const at::Tensor& s = steps[i];
    const Entry p_name{"params", i}, g_name{"grads", i}, m_name{"exp_avgs", i};
    check_cuda_on(p, kOp, p_name, device, "params[0]");
    check_cuda_on(g, kOp, g_name, device, "params[0]");
    check_cuda_on(m, kOp, m_name, device, "params[0]");
    check_cuda_on(s, kOp, Entry{"steps", i}, device, "params[0]");
    TORCH_CHECK(p.scalar_type() == pdtype, kOp, name_of(p_name), " has dtype ", dtype_name(p.scalar_type()),
                " but params[0] has ", dtype_name(pdtype), "; group tensors by dtype");
    TORCH_CHECK(g.scalar_type() == pdtype, kOp, name_of(g_name), " has dtype ", dtype_name(g.scalar_type()), " but ",
                name_of(p_name), " has ", dtype_name(pdtype));
    TORCH_CHECK(m.scalar_type() == mdtype, kOp, name_of(m_name), " has dtype ", dtype_name(m.scalar_type()),
                " but exp_avgs[0] has ", dtype_name(mdtype), "; group tensors by momentum dtype");
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == 1, kOp, "steps[", num(i),
                "] must be a float32 tensor with one element, got dtype ", dtype_name(s.scalar_type()), " and ",
                num(s.numel()), " elements");
    // any dense layout: the kernel walks the three tensors flat, in their (shared) memory order
    check_dense(p, kOp, p_name);
    check_same_shape(g, p, kOp, g_name, p_name);
    check_same_shape(m, p, kOp, m_name, p_name);
    check_same_layout(g, p, kOp, g_name, p_name);
    check_same_layout(m, p, kOp, m_name, p_name);

    StepItem it;
    it.p = p.data_ptr();
    it.g = g.data_ptr();
    it.m = m.data_ptr();
    it.step = s.data_ptr<float>();
    it.numel = p.numel();
    it.S = nullptr;
    it.H = nullptr;
    it.ncols = 1;
    it.inner = 1;

    const bool has_S = S_list[i].has_value() && S_list[i]->defined();
    const bool has_H = H_list[i].has_value() && H_list[i]->defined();
    TORCH_CHECK(has_S == has_H, kOp, "S_list[", num(i), "] and H_list[", num(i),
                "] must both be tensors or both be None");
    if (has_S) {
      const at::Tensor& S = *S_list[i];
      const at::Tensor& H = *H_list[i];
      const Entry S_name{"S_list", i}, H_name{"H_list", i};
      check_cuda_on(S, kOp, S_name, device, "params[0]");
      check_cuda_on(H, kOp, H_name, device, "params[0]");
      check_dtype(S, at::kFloat, kOp, S_name);
      check_dtype(H, at::kFloat, kOp, H_name);
      check_contiguous_1d(S, kOp, S_name);
      check_contiguous_1d(H, kOp, H_name);
      const int64_t nc = ncols[i];
      const int64_t off = col_offsets[i];
      TORCH_CHECK(nc >= 1 && nc <= std::numeric_limits<int32_t>::max(), kOp, "ncols[", num(i),
                  "] must lie in [1, 2^31), got ", num(nc));
      TORCH_CHECK(p.numel() == S.numel() * nc, kOp, name_of(p_name), " has ", num(p.numel()), " elements but len(",
                  name_of(S_name), ") * ncols[", num(i), "] = ", num(S.numel()), " * ", num(nc));
      TORCH_CHECK(off >= 0 && off + nc <= H.numel(), kOp, "col_offsets[", num(i), "] + ncols[", num(i), "] = ",
                  num(off), " + ", num(nc), " exceeds len(", name_of(H_name), ") = ", num(H.numel()));
      const int64_t inner = inners[i];
      TORCH_CHECK(inner >= 1 && nc % inner == 0, kOp, "inners[", num(i), "] must be >= 1 and divide ncols[", num(i),
                  "] = ", num(nc), ", got ", num(inner));
      if (inner > 1) {  // channels innermost: a row per dim-0 index, and the strides must say so
        TORCH_CHECK(S.numel() == p.size(0), kOp, "inners[", num(i), "] = ", num(inner), " needs a row per index of ",
                    name_of(p_name), "'s dim 0 (", num(p.size(0)), "), got len(", name_of(S_name), ") = ",
                    num(S.numel()));
        check_channels_innermost(p, inner, kOp, p_name);
      }
      if (p.numel() > 0) {
        it.S = S.data_ptr<float>();
        it.H = H.data_ptr<float>() + off;
        it.ncols = static_cast<int32_t>(nc);
        it.inner = static_cast<int32_t>(inner);
      }
    }
    TORCH_CHECK((it.numel + kStepChunkSize - 1) / kStepChunkSize <= std::numeric_limits<int32_t>::max(), kOp,
                name_of(p_name),
                " is too large (", num(it.numel), " elements)");
    items.push_back(it);
  }

  const float* gs_ptr = nullptr;
  const float* fi_ptr = nullptr;
  if (grad_scale.has_value() && grad_scale->defined()) {
    check_device_scalar(*grad_scale, kOp, "grad_scale", device, "params[0]");
    gs_ptr = grad_scale->data_ptr<float>();
  }
  if (found_inf.has_value() && found_inf->defined()) {
    check_device_scalar(*found_inf, kOp, "found_inf", device, "params[0]");
    fi_ptr = found_inf->data_ptr<float>();
  }

  StepScalars sc;
  sc.lr_ptr = nullptr;
  if (lr_tensor.has_value() && lr_tensor->defined()) {
    check_device_scalar(*lr_tensor, kOp, "lr_tensor", device, "params[0]");
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

  check_launch(launch_adafisher_step(items.data(), items.size(), pdtype, mdtype, sc, gs_ptr, fi_ptr, stream), kOp);
  // Ordered after every step launch on the same stream: no block reads a counter
  // that is being incremented.
  std::vector<float*> step_ptrs;
  step_ptrs.reserve(steps.size());
  for (const at::Tensor& s : steps) step_ptrs.push_back(s.data_ptr<float>());
  check_launch(launch_step_increments(step_ptrs.data(), step_ptrs.size(), fi_ptr, stream), kOp);
}

}  // namespace lightning_cafin
