// Gradient taps: a layer's capture statistics taken in C++ when the gradient of its output
// arrives, with no Python in the backward pass.
//
// The capture forward hook (lightning_cafin/capture/forward_capture.py) calls the layer's
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
//
// A training-mode batch norm, or a layer norm over the last dim of an input of 3 or more
// dims (a plan with mean_scale > 0), needs neither pass over its activation and gradient:
// its statistics are sums of the input (per channel; per dim-1 index for a layer norm) and
// the output gradient's sums over every dim but the bias's, and autograd has both anyway.
// The op saved its means for its backward (per channel, or per row of the normalised
// dim), and its backward node returns the bias gradient.  So tap() registers a post hook
// on the norm's backward node instead: h = the means (a layer norm's summed over every dim
// but dim 1) * mean_scale, s = the node's bias gradient (copied: autograd may keep the
// gradient tensor as bias.grad); in a backward that computes no bias gradient
// (autograd.grad, or backward(inputs=...), without the bias) s is summed from the node's
// output gradient instead, as the ordinary tap sums it.  That hook belongs to this one
// call of the norm (a node per forward), so two forwards before one backward add two
// pairs, as the tensor hooks do.  In a plain backward, where its bias gradient goes to the
// bias's AccumulateGrad alone and unhooked, the hook only notes the call (keeping that
// gradient's memory), and the end of the backward computes every such norm's statistics in
// one launch (deferred_norms.h).
// Where the output is not such a node's (SyncBatchNorm, GroupNorm, RMSNorm, a norm whose
// bias is frozen or absent), tap() registers the ordinary tap.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
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
  friend std::shared_ptr<struct TakenSums> take_single(const struct SinkSet&);
  mutable std::mutex mu_;
  std::vector<Result> results_;
};

// Every layer's sums of one capture step, held in C++ for the factor update: handing two
// lists of a hundred tensors to Python and back cost more host time than everything else
// a kept launch does (about 2 microseconds per layer).
struct TakenSums {
  std::vector<at::Tensor> h, s;
};

// The usual capture step's sums in one call (factors.py, KeptLaunch): every sink's one
// result (h, s), taken only where each sink holds exactly one, with h and s float32,
// contiguous, 1-D, of nh[i] and ns[i] elements on the device of like[i], counted hn[i] and
// sn[i]; else nothing is taken (nullptr) and the caller takes the general path.  What it
// replaces: a call into the extension per layer, and per layer the Python checks of what
// the previous capture step already established.
std::shared_ptr<TakenSums> take_single(
    const std::vector<std::shared_ptr<TapSink>>& sinks, const std::vector<at::Tensor>& like,
    const std::vector<int64_t>& nh, const std::vector<double>& hn, const std::vector<int64_t>& ns,
    const std::vector<double>& sn);

// take_single's arguments, checked (one entry per sink, no None, no sink twice) and
// converted once: a kept launch takes its sums with the same set at every capture step,
// where converting six lists of a hundred entries from Python cost about 2 microseconds
// per layer on the H200's host.
struct SinkSet {
  std::vector<std::shared_ptr<TapSink>> sinks;
  std::vector<c10::Device> devices;  // like[i]'s device
  std::vector<int64_t> nh, ns;
  std::vector<double> hn, sn;

  SinkSet(std::vector<std::shared_ptr<TapSink>> sinks, const std::vector<at::Tensor>& like, std::vector<int64_t> nh,
          std::vector<double> hn, std::vector<int64_t> ns, std::vector<double> sn);
};
std::shared_ptr<TakenSums> take_single(const SinkSet& set);

// One layer's tap for one pair of shapes: the layer's sink and layer_stats' arguments,
// made once and kept by the capture hook (layer_capture.py, LayerCapture.tap_plan), so that a tap
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
  // > 0: a norm's plan, h from its saved means * mean_scale (see above); 0: none
  double mean_scale;
  // taps registered on a norm's backward node, those of them whose statistics were left to
  // the end of their backward (deferred_norms.h), and tap_read calls that found the layer's
  // autocast copy of x (for tests and diagnostics)
  mutable std::atomic<int64_t> norm_taps{0}, deferred_norm_taps{0}, cast_taps{0};

  TapPlan(std::shared_ptr<TapSink> sink, std::vector<int64_t> input_op, double input_div, int64_t grad_dim,
          bool grad_square, double grad_div, double hn, double sn, double mean_scale = 0.0);
};

// The copy of x that a Linear-like layer computed on under autocast, as autograd saved it
// for the weight's gradient, as a 2-D (rows, x's last dim) tensor of the output's dtype,
// where the graph shows it is x cast; undefined elsewhere.  The output must come from the
// matrix product itself (AddmmBackward0, MmBackward0) or a view of it (a 3-D input's
// flattening), whose saved left operand reaches x's own graph node through views
// (ViewBackward0, UnsafeViewBackward0, ReshapeAliasBackward0) and exactly one cast
// (ToCopyBackward0), with x's element count and last dim.  Views and a cast keep the elements' row-major order, so the copy's
// per-column sums over its rows are the per-feature sums over x's leading dims of the
// values the layer multiplied (x's, rounded to the output's dtype).  Nothing is found under
// saved-tensor hooks (activation checkpointing, offloading: the saved copy is theirs), for
// a frozen weight (nothing saved), or for an x without a graph node of its own (a leaf or
// a tensor that needs no gradient: the cast cannot be told from the graph).
at::Tensor autocast_copy(const at::Tensor& x, const at::Tensor& output);

// `x` is held (itself: a module returning its input, detached) until the hook fires.
void tap(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& x, const at::Tensor& output, bool side);
void tap_gradient(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& output, const at::Tensor& h, double hn,
                  bool side);
// As tap_gradient with h = input_stats(x, input_op, input_div) computed now, on the current
// stream (hn: the plan's): for an x that may change or be gone by the backward (a layer
// computing on a cast copy of it, a frozen weight, saved-tensor hooks), read in one call.
// Except where a Linear-like layer (input_op (0, -1, square)) computed on an autocast copy
// of x that autograd saved for the weight's gradient (autocast_copy, above): then the
// ordinary tap holds that copy instead of x, and the backward reads it with the gradient in
// one layer_stats call (beside the backward on the side stream where `side`).  The copy
// cannot change before then (no one else holds it), has half or less of x's bytes, is what
// the layer multiplied, and costs the forward no launch: under bf16 autocast a
// transformer's float32 LayerNorm outputs were read in a forward that is host-bound.  And
// where a norm's plan (mean_scale > 0) finds the norm's saved means (tap()'s norm tap: a
// layer norm given bf16 under autocast computes on a float32 cast), that tap, which reads
// nothing now, except under saved-tensor hooks (their unpack would run in the forward).
void tap_read(const std::shared_ptr<const TapPlan>& plan, const at::Tensor& x, const at::Tensor& output, bool side);

}  // namespace lightning_cafin
