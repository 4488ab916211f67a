// layer_stats and channel_stats on CPU tensors, with ATen ops: the contract of capture_ops.h restated for the
// host, so that what calls layer_stats from C++ (the gradient taps, capture_tap.h) runs and
// is tested on a machine without a GPU.  The CUDA kernels are tested against the float64
// torch rules on the GPU; this is tested against the same rules on the CPU.  Not a fast
// path: the capture hooks send CPU tensors to the torch rules.
#include "capture_ops.h"
#include "checks.h"

#include <c10/core/GradMode.h>
#include <c10/core/WrapDimMinimal.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace lightning_cafin {
namespace {

const char* kRef = "layer_stats (CPU): ";

// t (as float32, squared when `square`) summed over every dim but `dim`, times
// float(1 / divisor) when divisor > 0.
at::Tensor channel_sums(const at::Tensor& t, int64_t dim, bool square, double divisor) {
  TORCH_CHECK(t.dim() >= 1, kRef, "a channel sum needs at least one dim");
  dim = c10::maybe_wrap_dim(dim, t.dim());
  at::Tensor f = t.to(at::kFloat);
  if (square) f = f * f;
  std::vector<int64_t> others;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (d != dim) others.push_back(d);
  at::Tensor out = others.empty() ? f.clone() : f.sum(others);
  if (divisor > 0) out.mul_(static_cast<float>(1.0 / divisor));
  return out.contiguous();
}

// [C/groups * kh * kw], in the weight's (c, ki, kj) order: the squared zero-padded input
// under each tap, summed over the batch, the groups and every output position.
at::Tensor window_sums(const at::Tensor& x_in, const std::vector<int64_t>& o) {
  const at::Tensor x = x_in.dim() == 3 ? x_in.unsqueeze(2) : x_in;
  TORCH_CHECK(x.dim() == 4, kRef, "the convolution input must be 3-D or 4-D, got ", num(static_cast<int64_t>(x_in.dim())),
              " dims");
  const int64_t kh = o[1], kw = o[2], sh = o[3], sw = o[4], pt = o[5], pl = o[6], dh = o[7], dw = o[8], groups = o[9];
  const int64_t Ho = o[10], Wo = o[11], C = x.size(1), H = x.size(2), W = x.size(3);
  TORCH_CHECK(kh > 0 && kw > 0 && sh > 0 && sw > 0 && dh > 0 && dw > 0 && pt >= 0 && pl >= 0 && groups > 0 &&
                  C % groups == 0 && Ho >= 0 && Wo >= 0,
              kRef, "invalid convolution geometry");
  const int64_t Cg = C / groups;
  at::Tensor out = at::zeros({Cg * kh * kw}, x.options().dtype(at::kFloat));
  if (Ho == 0 || Wo == 0 || x.size(0) == 0) return out;
  // padded so that every tap's strided window lies inside
  const int64_t pb = std::max<int64_t>(0, (Ho - 1) * sh + (kh - 1) * dh + 1 - H - pt);
  const int64_t pr = std::max<int64_t>(0, (Wo - 1) * sw + (kw - 1) * dw + 1 - W - pl);
  at::Tensor sq = x.to(at::kFloat);
  sq = at::constant_pad_nd(sq * sq, {pl, pr, pt, pb}, 0.0);
  at::Tensor taps = out.view({Cg, kh, kw});
  for (int64_t ki = 0; ki < kh; ++ki) {
    for (int64_t kj = 0; kj < kw; ++kj) {
      at::Tensor win = sq.slice(2, ki * dh, ki * dh + (Ho - 1) * sh + 1, sh).slice(3, kj * dw, kj * dw + (Wo - 1) * sw + 1, sw);
      taps.select(2, kj).select(1, ki).copy_(win.sum({0, 2, 3}).view({groups, Cg}).sum(0));
    }
  }
  return out;
}

// h from x by input_op (checked here)
at::Tensor input_h(const at::Tensor& x, const std::vector<int64_t>& input_op, double input_div) {
  return is_conv_op(input_op, kRef) ? window_sums(x, input_op)
                                    : channel_sums(x, input_op[1], input_op[2] != 0, input_div);
}

}  // namespace

at::Tensor channel_stats_reference(const at::Tensor& t, int64_t dim, bool square, double divisor) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && at::isFloatingType(t.scalar_type()), kRef,
              "t must be a floating-point CPU tensor");
  const c10::NoGradGuard no_grad;
  return channel_sums(t, dim, square, divisor);
}

std::tuple<at::Tensor, at::Tensor> layer_stats_reference(const at::Tensor& x, const at::Tensor& grad,
                                                         const std::vector<int64_t>& input_op, double input_div,
                                                         int64_t grad_dim, bool grad_square, double grad_div) {
  for (const at::Tensor* t : {&x, &grad}) {
    TORCH_CHECK(t->defined() && t->device().is_cpu(), kRef, "x and grad must be CPU tensors");
    TORCH_CHECK(at::isFloatingType(t->scalar_type()), kRef, "x and grad must be floating point, got ",
                dtype_name(t->scalar_type()));
  }
  const c10::NoGradGuard no_grad;
  return {input_h(x, input_op, input_div), channel_sums(grad, grad_dim, grad_square, grad_div)};
}

at::Tensor input_stats_reference(const at::Tensor& x, const std::vector<int64_t>& input_op, double input_div) {
  TORCH_CHECK(x.defined() && x.device().is_cpu() && at::isFloatingType(x.scalar_type()), kRef,
              "x must be a floating-point CPU tensor");
  const c10::NoGradGuard no_grad;
  return input_h(x, input_op, input_div);
}

std::tuple<at::Tensor, at::Tensor> norm_stats_reference(const at::Tensor& means, const at::Tensor& bias_grad,
                                                        double mean_scale) {
  TORCH_CHECK(means.defined() && bias_grad.defined() && at::isFloatingType(means.scalar_type()) &&
                  at::isFloatingType(bias_grad.scalar_type()),
              "norm_stats: means and bias_grad must be floating-point tensors");
  TORCH_CHECK(means.dim() >= 1 && bias_grad.dim() == 1, "norm_stats: means must have a dim and bias_grad be 1-D, got ",
              num(static_cast<int64_t>(means.dim())), " and ", num(static_cast<int64_t>(bias_grad.dim())), " dims");
  // as the CUDA op: a 2-D tensor is neither kind of means (a layer norm's per-row means keep the input's dims)
  TORCH_CHECK(means.dim() != 2, "norm_stats: means must be 1-D (a batch norm's) or have 3 or more dims (a layer "
              "norm's per row), got 2 dims");
  const c10::NoGradGuard no_grad;
  at::Tensor h;
  if (means.dim() == 1) {  // a batch norm's per-channel means
    h = means.to(at::kFloat).mul(mean_scale);
  } else {  // a layer norm's per-row means, summed over every dim but dim 1
    std::vector<int64_t> dims;
    for (int64_t d = 0; d < means.dim(); ++d)
      if (d != 1) dims.push_back(d);
    h = means.sum(dims, /*keepdim=*/false, at::kFloat).mul_(mean_scale);
  }
  return {h, bias_grad.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true)};
}

}  // namespace lightning_cafin
