// Gradient taps (capture_tap.h).
#include "capture_tap.h"

#include "capture_ops.h"
#include "checks.h"
#include "deferred_norms.h"
#include "deferred_sums.h"
#include "record_op.h"

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/generated/Functions.h>

#include <unordered_set>
#include <utility>

namespace lightning_cafin {
namespace {

const char* kTap = "TapPlan.tap: ";
const char* kGradTap = "TapPlan.tap_gradient: ";
const char* kReadTap = "TapPlan.tap_read: ";

// The gradient's sums by the plan's grad op (the ATen reference for a CPU gradient).
at::Tensor gradient_sums(const TapPlan& p, const at::Tensor& grad, bool side) {
  return grad.device().is_cpu() ? channel_stats_reference(grad, p.grad_dim, p.grad_square, p.grad_div)
                                : channel_stats(grad, p.grad_dim, p.grad_square, p.grad_div, side);
}

// A tap on a layer output's gradient: a pre hook of the output's backward node, as a tensor
// hook is, but one object, where register_hook makes a std::function, a hook list and a pre
// hook calling it (on a CPU, with the input held undetached below, ~0.7 of the ~1.8
// microseconds a repeated tap added to a Linear layer's forward).  `take` gets the
// gradient of output `output_nr` (undefined where the backward computes none).
struct OutputTap : torch::autograd::FunctionPreHook {
  std::shared_ptr<const TapPlan> plan;
  bool side;
  int output_nr = 0;

  OutputTap(std::shared_ptr<const TapPlan> p, bool side_) : plan(std::move(p)), side(side_) {}
  virtual void take(const at::TensorBase& grad) = 0;
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (output_nr < static_cast<int>(grads.size())) take(grads[output_nr]);
    return grads;
  }
};

// Put `t` on output's gradient: on its backward node, or as a tensor hook on an output
// that has none (a leaf).
void on_gradient(const at::Tensor& output, std::unique_ptr<OutputTap> t) {
  const auto node = output.grad_fn();
  if (node != nullptr) {
    t->output_nr = static_cast<int>(output.output_nr());
    node->add_tensor_pre_hook(std::move(t));
    return;
  }
  std::shared_ptr<OutputTap> held(std::move(t));
  output.register_hook([held](const at::TensorBase& grad) { held->take(grad); });
}

// The ordinary tap: layer_stats of (x, grad), added to the sink, once per graph.
struct LayerTap final : OutputTap {
  at::Tensor x;  // released when the tap fires

  LayerTap(std::shared_ptr<const TapPlan> p, at::Tensor x_, bool side_) : OutputTap(std::move(p), side_), x(std::move(x_)) {}
  void take(const at::TensorBase& grad_base) override {
    if (!x.defined()) return;  // a second backward through a retained graph: x is gone
    const at::Tensor input = std::move(x);
    x = at::Tensor();
    if (!grad_base.defined()) return;
    const at::Tensor grad(grad_base);
    const TapPlan& p = *plan;
    auto [h, s] = layer_stats_for_tap(input, grad, p.input_op, p.input_div, p.grad_dim, p.grad_square, p.grad_div,
                                      side);
    p.sink->add({std::move(h), p.hn, std::move(s), p.sn});
  }
};

// The gradient-only tap (tap_gradient, tap_read): s from the gradient, added with h, once per graph.
struct GradientTap final : OutputTap {
  at::Tensor h;  // the input's statistics, read in the forward
  double hn;
  bool fired = false;

  GradientTap(std::shared_ptr<const TapPlan> p, at::Tensor h_, double hn_, bool side_)
      : OutputTap(std::move(p), side_), h(std::move(h_)), hn(hn_) {}
  void take(const at::TensorBase& grad_base) override {
    if (fired || !grad_base.defined()) return;  // a second backward through a retained graph
    fired = true;
    const at::Tensor grad(grad_base);
    plan->sink->add({h, hn, gradient_sums(*plan, grad, side), plan->sn});
  }
};

// The means a norm saved for its backward, where `node` is the backward node of a
// training-mode batch norm (native, cuDNN, MIOpen, with-update: per channel, 1-D) or of a
// layer norm (per row: the input's shape with the normalised dims 1); undefined elsewhere.
// (NodePtr: what Tensor::grad_fn returns, std::shared_ptr or c10::intrusive_ptr by torch version.)
template <typename NodePtr>
at::Tensor saved_means(const NodePtr& node) {
  namespace gen = torch::autograd::generated;
  torch::autograd::Node* n = node.get();
  if (auto* f = dynamic_cast<gen::NativeBatchNormBackward0*>(n)) return f->training ? f->result1_.unpack(node) : at::Tensor();
  if (auto* f = dynamic_cast<gen::CudnnBatchNormBackward0*>(n)) return f->training ? f->result1_.unpack(node) : at::Tensor();
  if (auto* f = dynamic_cast<gen::MiopenBatchNormBackward0*>(n)) return f->training ? f->result1_.unpack(node) : at::Tensor();
  if (auto* f = dynamic_cast<gen::BatchNormWithUpdateBackward0*>(n)) return f->result1_.unpack(node);
  if (auto* f = dynamic_cast<gen::NativeLayerNormBackward0*>(n)) return f->result1_.unpack(node);
  return {};
}

// The post hook of one norm call's backward node (see capture_tap.h): its grad_inputs are
// the gradients of (input, weight, bias).
struct NormTap final : torch::autograd::FunctionPostHook {
  std::shared_ptr<const TapPlan> plan;
  at::Tensor means;  // released when the hook fires
  torch::autograd::Node* node;  // the node this hook is on (which calls it, so is alive then)

  NormTap(std::shared_ptr<const TapPlan> p, at::Tensor m, torch::autograd::Node* n)
      : plan(std::move(p)), means(std::move(m)), node(n) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grad_inputs,
                                            const torch::autograd::variable_list& grad_outputs) override {
    // a second backward through a retained graph finds the means gone and adds nothing
    if (!means.defined()) return grad_inputs;
    const at::Tensor bias_grad = grad_inputs.size() >= 3 ? grad_inputs[2] : at::Tensor();
    const at::Tensor grad = grad_outputs.empty() ? at::Tensor() : grad_outputs[0];
    if (!bias_grad.defined() && !grad.defined()) return grad_inputs;
    at::Tensor m = std::move(means);
    means = at::Tensor();
    // (asked before grad mode is turned off here: a backward with create_graph is not deferred)
    if (bias_grad.defined() && defer_norm(plan, *node, m, bias_grad)) return grad_inputs;
    const TapPlan& p = *plan;
    at::NoGradGuard no_grad;  // a backward with create_graph=True records nothing of this
    // h from the means, s the bias gradient copied (not bias.grad itself), in one launch;
    // where this backward computes no bias gradient (autograd.grad or backward(inputs=...)
    // without the bias), s is the sum it would have been, from the output's gradient, as
    // the ordinary tap takes it
    auto [h, s] = norm_stats(m, bias_grad.defined() ? bias_grad : at::empty({0}, m.options()), p.mean_scale);
    if (!bias_grad.defined()) s = gradient_sums(p, grad, /*side=*/false);
    p.sink->add({std::move(h), p.hn, std::move(s), p.sn});
    return grad_inputs;
  }
};

// Register a NormTap where `output` is a training batch norm's or a layer norm's output with
// a bias that needs its gradient; false (nothing registered) elsewhere, and under saved-tensor
// hooks (checkpointing, offloading), whose unpack of the means would run here, in the forward.
bool tap_norm(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& output) {
  if (at::SavedTensorDefaultHooks::get_hooks().has_value()) return false;
  const auto node = output.grad_fn();
  if (node == nullptr || output.output_nr() != 0 || node->num_outputs() < 3 || !node->next_edge(2).is_valid() ||
      output.dim() < 2) {
    return false;
  }
  at::Tensor means = saved_means(node);
  if (!means.defined()) return false;
  const bool per_channel = means.dim() == 1 && means.size(0) == output.size(1);
  const bool per_row = means.dim() == output.dim() && means.dim() >= 3 && means.size(1) == output.size(1);
  if (!per_channel && !per_row) return false;
  node->add_post_hook(std::make_unique<NormTap>(plan, std::move(means), node.get()));
  plan->norm_taps.fetch_add(1, std::memory_order_relaxed);
  return true;
}

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
  finish_deferred_sums();  // (the results handed out hold their sums from here on)
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Result> out;
  out.swap(results_);
  return out;
}

int64_t TapSink::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(results_.size());
}

SinkSet::SinkSet(std::vector<std::shared_ptr<TapSink>> sinks_, const std::vector<at::Tensor>& like,
                 std::vector<int64_t> nh_, std::vector<double> hn_, std::vector<int64_t> ns_, std::vector<double> sn_)
    : sinks(std::move(sinks_)), nh(std::move(nh_)), ns(std::move(ns_)), hn(std::move(hn_)), sn(std::move(sn_)) {
  const size_t L = sinks.size();
  TORCH_CHECK(like.size() == L && nh.size() == L && hn.size() == L && ns.size() == L && sn.size() == L,
              "take_single: every list must have one entry per sink");
  std::unordered_set<const TapSink*> seen;  // (locking one sink twice would deadlock)
  seen.reserve(L);
  devices.reserve(L);
  for (size_t i = 0; i < L; ++i) {
    TORCH_CHECK(sinks[i] != nullptr && like[i].defined(), "take_single: sinks and like must hold no None");
    TORCH_CHECK(seen.insert(sinks[i].get()).second, "take_single: sinks[", num(static_cast<int64_t>(i)),
                "] appears twice in the list");
    devices.push_back(like[i].device());
  }
}

std::shared_ptr<TakenSums> take_single(
    const std::vector<std::shared_ptr<TapSink>>& sinks, const std::vector<at::Tensor>& like,
    const std::vector<int64_t>& nh, const std::vector<double>& hn, const std::vector<int64_t>& ns,
    const std::vector<double>& sn) {
  return take_single(SinkSet(sinks, like, nh, hn, ns, sn));
}

std::shared_ptr<TakenSums> take_single(const SinkSet& set) {
  LIGHTNING_CAFIN_RECORD_OP("take_single");
  finish_deferred_sums();  // (the sums taken hold their values from here on)
  const size_t L = set.sinks.size();
  auto fits = [](const at::Tensor& t, int64_t n, const c10::Device& place) {
    return t.defined() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == n && t.is_contiguous() &&
           t.device() == place;
  };
  std::vector<std::unique_lock<std::mutex>> locks;  // every sink held from the checks to the take
  locks.reserve(L);
  for (size_t i = 0; i < L; ++i) {
    locks.emplace_back(set.sinks[i]->mu_);
    const auto& r = set.sinks[i]->results_;
    if (r.size() != 1) return nullptr;
    const auto& [h, h_count, s, s_count] = r[0];
    if (h_count != set.hn[i] || s_count != set.sn[i] || !fits(h, set.nh[i], set.devices[i]) ||
        !fits(s, set.ns[i], set.devices[i]))
      return nullptr;
  }
  auto out = std::make_shared<TakenSums>();
  out->h.reserve(L);
  out->s.reserve(L);
  for (size_t i = 0; i < L; ++i) {
    auto& r = set.sinks[i]->results_;
    out->h.push_back(std::move(std::get<0>(r[0])));
    out->s.push_back(std::move(std::get<2>(r[0])));
    r.clear();
  }
  return out;
}

TapPlan::TapPlan(std::shared_ptr<TapSink> sink_, std::vector<int64_t> input_op_, double input_div_, int64_t grad_dim_,
                 bool grad_square_, double grad_div_, double hn_, double sn_, double mean_scale_)
    : sink(std::move(sink_)),
      input_op(std::move(input_op_)),
      input_div(input_div_),
      grad_div(grad_div_),
      hn(hn_),
      sn(sn_),
      grad_dim(grad_dim_),
      grad_square(grad_square_),
      mean_scale(mean_scale_) {
  TORCH_CHECK(sink != nullptr, "TapPlan: sink must be a TapSink, got None");
  TORCH_CHECK(mean_scale >= 0.0, "TapPlan: mean_scale must be >= 0 (0: not a norm's plan), got ", mean_scale);
}

// (see capture_tap.h)
at::Tensor autocast_copy(const at::Tensor& x, const at::Tensor& output) {
  namespace gen = torch::autograd::generated;
  using torch::autograd::Node;
  if (at::SavedTensorDefaultHooks::get_hooks().has_value() || !x.requires_grad() || x.grad_fn() == nullptr) return {};
  const Node* const source = x.grad_fn().get();
  Node* top = output.grad_fn().get();
  if (top == nullptr) return {};
  auto is_view = [](const Node* n) {
    return dynamic_cast<const gen::ViewBackward0*>(n) != nullptr ||
           dynamic_cast<const gen::UnsafeViewBackward0*>(n) != nullptr ||
           dynamic_cast<const gen::ReshapeAliasBackward0*>(n) != nullptr;
  };
  if (is_view(top)) {
    if (top->num_outputs() < 1 || !top->next_edge(0).is_valid()) return {};
    top = top->next_edge(0).function.get();
  }
  at::Tensor saved;
  const torch::autograd::Edge* edge = nullptr;
  if (auto* f = dynamic_cast<gen::AddmmBackward0*>(top)) {
    saved = f->mat1_.unpack();
    if (top->num_outputs() >= 2) edge = &top->next_edge(1);
  } else if (auto* f = dynamic_cast<gen::MmBackward0*>(top)) {
    saved = f->self_.unpack();
    if (top->num_outputs() >= 1) edge = &top->next_edge(0);
  }
  if (!saved.defined() || edge == nullptr || saved.dim() != 2 || saved.scalar_type() != output.scalar_type() ||
      saved.numel() != x.numel() || x.dim() < 1 || saved.size(1) != x.size(-1)) {
    return {};
  }
  int casts = 0;
  for (int step = 0; step < 4 && edge->is_valid(); ++step) {
    const Node* n = edge->function.get();
    if (n == source) return casts == 1 && edge->input_nr == x.output_nr() ? saved : at::Tensor();
    if (dynamic_cast<const gen::ToCopyBackward0*>(n) != nullptr) {
      ++casts;
    } else if (!is_view(n)) {
      return {};
    }
    if (n->num_outputs() < 1) return {};
    edge = &n->next_edge(0);
  }
  return {};
}

void tap(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& x, const at::Tensor& output, bool side) {
  LIGHTNING_CAFIN_RECORD_OP("tap");
  check_tap_args(plan, output, kTap);
  TORCH_CHECK(x.defined(), kTap, "x must be a tensor");
  if (plan->mean_scale > 0.0 && tap_norm(plan, output)) return;
  // x itself, not a detached copy (an op dispatched per layer): the hook sits on the output's
  // node, which x's graph cannot reach, so holding x keeps alive nothing autograd does not
  // hold anyway (the node's edge to x's, the conv's or matmul's saved x), except where a
  // module returns its input: that one is held detached
  const bool is_output = x.unsafeGetTensorImpl() == output.unsafeGetTensorImpl();
  on_gradient(output, std::make_unique<LayerTap>(plan, is_output ? x.detach() : x, side));
}

void tap_gradient(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& output, const at::Tensor& h, double hn,
                  bool side) {
  LIGHTNING_CAFIN_RECORD_OP("tap_gradient");
  check_tap_args(plan, output, kGradTap);
  TORCH_CHECK(h.defined(), kGradTap, "h must be a tensor");
  on_gradient(output, std::make_unique<GradientTap>(plan, h, hn, side));
}

void tap_read(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& x, const at::Tensor& output, bool side) {
  LIGHTNING_CAFIN_RECORD_OP("tap_read");
  check_tap_args(plan, output, kReadTap);
  TORCH_CHECK(x.defined(), kReadTap, "x must be a tensor");
  // a norm computing on a cast of x (a layer norm given bf16 under autocast runs in float32):
  // its saved means are autograd's, so the norm tap reads nothing in the forward, as tap()'s
  // does (not under saved-tensor hooks: tap_norm)
  if (plan->mean_scale > 0.0 && tap_norm(plan, output)) return;
  // a Linear-like layer on an autocast copy of x: the copy, which autograd holds until the
  // layer's backward and nothing can change, is read with the gradient there, in one launch
  if (plan->input_op.size() == 3 && plan->input_op[0] == 0 && plan->input_op[1] == -1) {
    at::Tensor copy = autocast_copy(x, output);
    if (copy.defined()) {
      on_gradient(output, std::make_unique<LayerTap>(plan, std::move(copy), side));
      plan->cast_taps.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  // x as given, not a detached copy (an op dispatched per layer): input_stats records nothing
  on_gradient(output, std::make_unique<GradientTap>(plan, input_stats(x, plan->input_op, plan->input_div), plan->hn, side));
}

}  // namespace lightning_cafin
