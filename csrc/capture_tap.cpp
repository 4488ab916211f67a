// Gradient taps (capture_tap.h).
#include "capture_tap.h"

#include "capture_ops.h"

#include <utility>

namespace lightning_cafin {
namespace {

const char* kTap = "TapPlan.tap: ";
const char* kGradTap = "TapPlan.tap_gradient: ";

struct Tap {
  std::shared_ptr<const TapPlan> plan;
  at::Tensor x;  // released when the tap fires
};

struct GradientTap {
  std::shared_ptr<const TapPlan> plan;
  at::Tensor h;  // the input's statistics, read in the forward
  double hn;
  bool side, fired = false;
};

void check_tap_args(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& output, const char* op) {
  TORCH_CHECK(plan != nullptr, op, "plan must be a TapPlan, got None");
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

TapPlan::TapPlan(std::shared_ptr<TapSink> sink_, std::vector<int64_t> input_op_, double input_div_, int64_t grad_dim_,
                 bool grad_square_, double grad_div_, double hn_, double sn_)
    : sink(std::move(sink_)),
      input_op(std::move(input_op_)),
      input_div(input_div_),
      grad_div(grad_div_),
      hn(hn_),
      sn(sn_),
      grad_dim(grad_dim_),
      grad_square(grad_square_) {
  TORCH_CHECK(sink != nullptr, "TapPlan: sink must be a TapSink, got None");
}

void tap(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& x, const at::Tensor& output, bool side) {
  check_tap_args(plan, output, kTap);
  TORCH_CHECK(x.defined(), kTap, "x must be a tensor");
  auto held = std::make_shared<Tap>(Tap{plan, x.detach()});
  output.register_hook([held, side](const at::TensorBase& grad_base) {
    if (!held->x.defined()) return;  // a second backward through a retained graph: x is gone
    const at::Tensor x = std::move(held->x);
    held->x = at::Tensor();
    if (!grad_base.defined()) return;
    const at::Tensor grad(grad_base);
    const TapPlan& p = *held->plan;
    auto [h, s] = layer_stats(x, grad, p.input_op, p.input_div, p.grad_dim, p.grad_square, p.grad_div, side);
    p.sink->add({std::move(h), p.hn, std::move(s), p.sn});
  });
}

void tap_gradient(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& output, const at::Tensor& h, double hn,
                  bool side) {
  check_tap_args(plan, output, kGradTap);
  TORCH_CHECK(h.defined(), kGradTap, "h must be a tensor");
  auto held = std::make_shared<GradientTap>(GradientTap{plan, h, hn, side});
  output.register_hook([held](const at::TensorBase& grad_base) {
    if (held->fired || !grad_base.defined()) return;  // a second backward through a retained graph
    held->fired = true;
    const at::Tensor grad(grad_base);
    const TapPlan& p = *held->plan;
    at::Tensor s = grad.device().is_cpu() ? channel_stats_reference(grad, p.grad_dim, p.grad_square, p.grad_div)
                                          : channel_stats(grad, p.grad_dim, p.grad_square, p.grad_div, held->side);
    p.sink->add({held->h, held->hn, std::move(s), p.sn});
  });
}

}  // namespace lightning_cafin
