// Gradient taps (capture_tap.h).
#include "capture_tap.h"

#include "capture_ops.h"

#include <utility>

namespace lightning_cafin {
namespace {

const char* kTap = "tap_layer: ";
const char* kGradTap = "tap_gradient: ";

struct Tap {
  std::shared_ptr<TapSink> sink;
  at::Tensor x;  // released when the tap fires
  std::vector<int64_t> input_op;
  double input_div, grad_div, hn, sn;
  int64_t grad_dim;
  bool grad_square, side;
};

struct GradientTap {
  std::shared_ptr<TapSink> sink;
  at::Tensor h;  // the input's statistics, read in the forward
  double hn, grad_div, sn;
  int64_t grad_dim;
  bool grad_square, side, fired = false;
};

void check_tap_args(const std::shared_ptr<TapSink>& sink, const at::Tensor& output, const char* op) {
  TORCH_CHECK(sink != nullptr, op, "sink must be a TapSink, got None");
  TORCH_CHECK(output.defined(), op, "output must be a tensor");
  TORCH_CHECK(output.requires_grad(), op, "output must require grad (nothing would call the tap)");
}

}  // namespace

void TapSink::add(Result r) {
  std::lock_guard<std::mutex> lock(mu_);
  results_.push_back(std::move(r));
}

std::vector<TapSink::Result> TapSink::take() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Result> out;
  out.swap(results_);
  return out;
}

int64_t TapSink::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(results_.size());
}

void tap_layer(const std::shared_ptr<TapSink>& sink, const at::Tensor& x, const at::Tensor& output,
               std::vector<int64_t> input_op, double input_div, int64_t grad_dim, bool grad_square, double grad_div,
               double hn, double sn, bool side) {
  check_tap_args(sink, output, kTap);
  TORCH_CHECK(x.defined(), kTap, "x must be a tensor");
  auto tap = std::make_shared<Tap>(Tap{sink, x, std::move(input_op), input_div, grad_div, hn, sn, grad_dim,
                                       grad_square, side});
  output.register_hook([tap](const at::TensorBase& grad_base) {
    if (!tap->x.defined()) return;  // a second backward through a retained graph: x is gone
    const at::Tensor x = std::move(tap->x);
    tap->x = at::Tensor();
    if (!grad_base.defined()) return;
    const at::Tensor grad(grad_base);
    auto [h, s] = layer_stats(x, grad, tap->input_op, tap->input_div, tap->grad_dim, tap->grad_square, tap->grad_div,
                              tap->side);
    tap->sink->add({std::move(h), tap->hn, std::move(s), tap->sn});
  });
}

void tap_gradient(const std::shared_ptr<TapSink>& sink, const at::Tensor& output, const at::Tensor& h, double hn,
                  int64_t grad_dim, bool grad_square, double grad_div, double sn, bool side) {
  check_tap_args(sink, output, kGradTap);
  TORCH_CHECK(h.defined(), kGradTap, "h must be a tensor");
  auto tap = std::make_shared<GradientTap>(GradientTap{sink, h, hn, grad_div, sn, grad_dim, grad_square, side});
  output.register_hook([tap](const at::TensorBase& grad_base) {
    if (tap->fired || !grad_base.defined()) return;  // a second backward through a retained graph
    tap->fired = true;
    const at::Tensor grad(grad_base);
    at::Tensor s = grad.device().is_cpu()
                       ? channel_stats_reference(grad, tap->grad_dim, tap->grad_square, tap->grad_div)
                       : channel_stats(grad, tap->grad_dim, tap->grad_square, tap->grad_div, tap->side);
    tap->sink->add({tap->h, tap->hn, std::move(s), tap->sn});
  });
}

}  // namespace lightning_cafin
