// A norm tap's statistics (capture_tap.h's NormTap) left to the end of its backward, where
// one launch per device computes every deferred norm's.
//
// Why: a batch norm's or layer norm's tap costs no read of its activation, but it still
// made one norm_stats launch per call in the backward: 53 of the 112 device operations a
// capture step adds to ResNet-50, each a call into the extension, an allocation cut and a
// kernel launch on the host (on a slow host about 10 us before the package's own work,
// where a capture step is host-bound) and a kernel of about 1.6 us on the device.
//
// Why the end of the backward: the tap needs the bias gradient of this call.  Holding the
// node's gradient tensor past the hook would make AccumulateGrad clone it (a launch and an
// allocation instead of the one saved); where nothing else can reach it, AccumulateGrad
// makes it the bias's .grad instead, and that is what the end of the backward reads.
// Autograd's final callbacks run there, on the caller's current streams, after they waited
// for every gradient (torch's "final_callbacks may use any grad on its device's current
// stream"), before backward() returns: before anything (gradient clipping, loss-scale
// unscaling, an optimizer step) can change .grad.  (Only a final callback queued earlier
// in the same backward runs before it; one that changed a plain leaf's .grad in place would
// be seen.  Neither torch, Lightning nor DDP queues such a one, and DDP's reducer keeps its
// norms in their hooks anyway: it holds their accumulators.)
//
// A call is deferred only where .grad at the end is exactly this call's bias gradient:
// - the backward is a plain backward() (no create_graph; no inputs= nor autograd.grad: every
//   AccumulateGrad runs), inside an autograd graph task, not being captured into a CUDA graph;
// - the bias is a leaf whose AccumulateGrad node is reached by this node's edge alone (its
//   use count is 1: no second call of the norm, no other use of the bias in the loss, no
//   reducer holding it as DDP's does), with no hook on it (tensor, pre, post, retains_grad,
//   post-accumulate: a hook could change .grad in place), and no .grad yet (else
//   AccumulateGrad adds this gradient into it: micro-batches after the first).
// Otherwise the tap launches now, as before.  A backward that fails before its end runs no
// final callback: its deferred norms add nothing (as a tap that never fired), and the
// step reports those layers as not fired.
//
// Each deferred call's (h, hn, s, sn) reaches its plan's sink at the end of the backward,
// in the order the calls' hooks ran; the sums are norm_stats' floats (the same kernel).
#pragma once

#include "capture_tap.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <memory>

namespace lightning_cafin {

// Leave the statistics of this call of a norm to the end of its backward where the
// conditions above hold, and return true; else false, and nothing is taken.  node: the
// norm's backward node (whose post hook calls this); means: what it saved (moved from
// where deferred); bias_grad: the node's bias gradient.
bool defer_norm(const std::shared_ptr<const TapPlan>& plan, torch::autograd::Node& node, at::Tensor& means,
                const at::Tensor& bias_grad);

// Whether norm taps may defer (the default) or always launch in the hook; returns the
// setting before (an A/B of the two in one process, and tests).
bool set_defer_norms(bool on);

}  // namespace lightning_cafin
