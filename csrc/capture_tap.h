// Gradient taps: a layer's capture statistics taken in C++ when the gradient of its output
// arrives, with no Python in the backward pass.
//
// The capture forward hook (lightning_cafin/capture/hooks.py) calls the layer's
// TapPlan.tap once per captured layer with the layer's input x and its output; it
// registers a C++ tensor hook on the output.  In the backward pass the hook
// calls layer_stats(x, grad, ...), adds (h, hn, s, sn) to the layer's TapSink and lets go
// of x.  What it replaces: a Python tensor hook, whose registration, call into the
// interpreter and op-argument parsing cost the host tens of microseconds per layer on a
// slow host, where a capture step is host-bound.
//
// Semantics are the Python hook's: registered on the output before any in-place change
// of it, the hook receives the gradient of the value it was registered on; x is held
// only until the hook fires (autograd keeps x for the weight's gradient anyway); a second
// backward through a retained graph finds x gone and adds nothing.  An error in
// layer_stats is raised by the backward call.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

namespace lightning_cafin {

// One layer's statistics from the taps that fired since they were last taken: filled on
// the autograd thread, taken by the optimizer after the backward pass.
class TapSink {
 public:
  using Result = std::tuple<at::Tensor, double, at::Tensor, double>;  // (h, hn, s, sn)
  void add(Result r);
  std::vector<Result> take();
  int64_t size() const;

 private:
  mutable std::mutex mu_;
  std::vector<Result> results_;
};

// One layer's tap for one pair of shapes: the layer's sink and layer_stats' arguments,
// made once and kept by the capture hook (hooks.py, LayerCapture.tap_plan), so that a tap
// costs the forward one call with three arguments.  tap() registers on `output` (which
// must require grad) the tap described above.  Where the input's statistics were read in
// the forward (h, hn: a frozen weight, a layer computing on an autocast copy, activation
// checkpointing), tap_gradient()'s hook computes only the gradient's,
// channel_stats(grad, grad_dim, grad_square, grad_div, side), and adds (h, hn, s, sn).
struct TapPlan {
  std::shared_ptr<TapSink> sink;
  std::vector<int64_t> input_op;
  double input_div, grad_div, hn, sn;
  int64_t grad_dim;
  bool grad_square;

  TapPlan(std::shared_ptr<TapSink> sink, std::vector<int64_t> input_op, double input_div, int64_t grad_dim,
          bool grad_square, double grad_div, double hn, double sn);
};

// `x` is held (detached) until the hook fires.
void tap(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& x, const at::Tensor& output, bool side);
void tap_gradient(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& output, const at::Tensor& h, double hn,
                  bool side);

}  // namespace lightning_cafin
