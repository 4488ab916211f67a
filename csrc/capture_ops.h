// Host entry points of the factor-capture kernels (see capture_launch.h for the maths).
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <utility>
#include <vector>

namespace lightning_cafin {

// fp32 [C/groups * kh * kw]: sum over the batch, the groups and every output position of
// the squared zero-padded input under each kernel tap, in the weight's (c, ki, kj) order.
// x: 4-D (B, C, H, W) CUDA tensor, float32/float16/bfloat16, any strides.
// padding is (top, left); the bottom/right padding is implied by out_hw.
at::Tensor conv_input_stats(const at::Tensor& x, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                            std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups,
                            std::vector<int64_t> out_hw, bool side = false);

// fp32 [t.size(dim)]: sum over every other dim of t (of t^2 when square), multiplied by
// float(1 / divisor) when divisor > 0 (as torch's division by a Python scalar does).
// side: run on the device's capture side stream (side_stream.h); the result is then
// ready on the current stream only after capture_join().
at::Tensor channel_stats(const at::Tensor& t, int64_t dim, bool square, double divisor, bool side = false);

// One layer's two partial sums in one call, ordered on the side stream once (side_stream.h):
// h from x (input_op {0, dim, square}: channel_stats(x, dim, square, input_div); {1, kh, kw,
// sh, sw, pt, pl, dh, dw, groups, Ho, Wo}: conv_input_stats, a 3-D x read as height 1) and
// s = channel_stats(grad, grad_dim, grad_square, grad_div).  Returns (h, s).
std::tuple<at::Tensor, at::Tensor> layer_stats(const at::Tensor& x, const at::Tensor& grad,
                                               const std::vector<int64_t>& input_op, double input_div,
                                               int64_t grad_dim, bool grad_square, double grad_div, bool side);
// layer_stats as the gradient taps call it (capture_tap.h): where the two reductions share
// a launch of the rows kernel, their sums over splits are left to finish_deferred_sums()
// (deferred_sums.h), so (h, s) hold them only after that runs (capture_join(), a sink's take).
std::tuple<at::Tensor, at::Tensor> layer_stats_for_tap(const at::Tensor& x, const at::Tensor& grad,
                                                       const std::vector<int64_t>& input_op, double input_div,
                                                       int64_t grad_dim, bool grad_square, double grad_div,
                                                       bool side);

// layer_stats' and channel_stats' contracts on CPU tensors (float32/float64/float16/bfloat16),
// with ATen ops (capture_reference.cpp; side does not apply).  layer_stats sends CPU tensors
// to layer_stats_reference; the gradient-only taps (capture_tap.h) call
// channel_stats_reference for CPU gradients.
at::Tensor channel_stats_reference(const at::Tensor& t, int64_t dim, bool square, double divisor);
// Whether input_op is a convolution's ({1, kh, kw, sh, sw, pt, pl, dh, dw, groups, Ho, Wo})
// or a channel sum's ({0, dim, square}); an error naming `op` else.
bool is_conv_op(const std::vector<int64_t>& input_op, const char* op);
// layer_stats' h alone, now, on the current stream: x read in the forward where it may not
// last until the backward (capture_tap.h's tap_read).  CPU tensors take the reference.
at::Tensor input_stats(const at::Tensor& x, const std::vector<int64_t>& input_op, double input_div);
at::Tensor input_stats_reference(const at::Tensor& x, const std::vector<int64_t>& input_op, double input_div);
std::tuple<at::Tensor, at::Tensor> layer_stats_reference(const at::Tensor& x, const at::Tensor& grad,
                                                         const std::vector<int64_t>& input_op, double input_div,
                                                         int64_t grad_dim, bool grad_square, double grad_div);

// A norm's capture statistics from its saved means and its bias gradient (capture_tap.h's
// NormTap), (h, s) float32 in one allocation and, on CUDA, one launch: h = the means summed
// over every dim but their channel dim (dim 0 of a batch norm's 1-D means, dim 1 of a layer
// norm's per-row means), times float(mean_scale); s = bias_grad as float32 (a copy, never
// bias_grad itself).  CPU tensors, and dtypes the kernels do not read, take
// norm_stats_reference (ATen ops, any device).
std::tuple<at::Tensor, at::Tensor> norm_stats(const at::Tensor& means, const at::Tensor& bias_grad, double mean_scale);
std::tuple<at::Tensor, at::Tensor> norm_stats_reference(const at::Tensor& means, const at::Tensor& bias_grad,
                                                        double mean_scale);
// One norm's inputs to norm_stats_batch.
struct NormInput {
  at::Tensor means, bias_grad;
  double mean_scale;
};
// norm_stats of every norm at once, on CUDA tensors of one device whose dtypes the kernels
// read (norm_stats_on_kernels): one launch, the results cut from one buffer; the same
// floats as norm_stats of each.
std::vector<std::pair<at::Tensor, at::Tensor>> norm_stats_batch(const std::vector<NormInput>& norms);
// Whether norm_stats of these reads them with the kernels (else norm_stats_reference).
bool norm_stats_on_kernels(const at::Tensor& means, const at::Tensor& bias_grad);

// The capture step's factor update for every layer at once (one launch per 56 layers).
// Returns int32 [L]: 1 where the layer's statistics held a NaN (its factors untouched).
at::Tensor factor_update_(const std::vector<at::Tensor>& h, const std::vector<at::Tensor>& s,
                          const std::vector<at::Tensor>& H, const std::vector<at::Tensor>& S,
                          const std::vector<int64_t>& kinds, const std::vector<int64_t>& flags,
                          const std::vector<double>& h_div, const std::vector<double>& s_div,
                          const std::vector<double>& s_scale, const std::vector<double>& extra, double c_old,
                          double c_new);

}  // namespace lightning_cafin
