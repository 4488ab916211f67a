// A norm tap's statistics (capture_tap.h's NormTap) left to the end of its backward, where
// one launch per device computes every deferred norm's.
//
// Why: a batch norm's or layer norm's tap costs no read of its activation, but it still
// made one norm_stats launch per call in the backward: 53 of the 112 device operations a
// capture step adds to ResNet-50, each a call into the extension, an allocation cut and a
// kernel launch on the host (on a slow host about 10 us before the package's own work,
// where a capture step is host-bound) and a kernel of about 1.6 us on the device.
//
// Why the end of the backward: the tap needs this call's bias gradient, which its backward
// node hands on to the bias's AccumulateGrad.  Holding that tensor past the hook would make
// AccumulateGrad copy it (a launch and an allocation instead of the one saved: it takes the
// tensor itself as .grad only while nothing else references it), so the hook keeps its
// memory alone, through a tensor of its own on the same storage.  Autograd's final callbacks
// run at the end, on the caller's current streams, after they waited for every gradient
// (torch's "final_callbacks may use any grad on its device's current stream"), before
// backward() returns.  The memory is read there whatever became of .grad meanwhile: FSDP2's
// post-backward, for one, moves the unsharded gradients into its reduce-scatter and drops
// them from .grad during the backward or in a final callback queued before this one.
//
// A call is deferred only where that memory holds this call's bias gradient, unchanged, at
// the end:
// - the backward is a plain backward() (no create_graph; no inputs= nor autograd.grad: every
//   AccumulateGrad runs), inside an autograd graph task, not being captured into a CUDA graph;
// - the gradient is a plain strided tensor (not a wrapper subclass such as DTensor);
// - the bias is a leaf whose AccumulateGrad node is reached by this node's edge alone (its
//   use count is 1: no second call of the norm, no other use of the bias in the loss, whose
//   gradient autograd would add into this one in place; no reducer holding it as DDP's
//   does), with no hook on it (tensor, pre, post, retains_grad, post-accumulate: a hook may
//   change the gradient or .grad in place).
// Where .grad is already set (micro-batches after the first), AccumulateGrad adds this
// gradient into it and leaves the gradient's own memory as it was: deferred as well.
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
