// The gradient taps' statistics off the autograd thread (opt-in: set_tap_thread, from
// taps.py's LIGHTNING_CAFIN_TAP_THREAD).
//
// Why: a capture step of a host-bound model (ResNet-18 in bf16 + channels_last) spends its
// backward's extra host time in the taps themselves (layer_stats, norm_stats: argument
// checks, planning, allocation and one or two launches per layer, ~0.6 ms of 41 layers on
// a fast host), on the autograd thread, which launches the backward's own kernels.  With
// the thread on, a tap hands its work to one worker thread and returns; the worker runs it
// with the tap's current CUDA stream current, in the order the taps fired, while the
// autograd thread goes on.
//
// What stays the same: the work queued holds the tensors it reads (the layer's input and
// gradient, a norm's means and bias gradient) until it has been launched, on the stream the
// tap saw, so the caching allocator never hands their memory to a later kernel before the
// read; the backward that fired the taps waits for all of them at its end (an autograd
// final callback) and raises the first error among them, so nothing the backward's caller
// does next (gradient clipping, a loss scaler's unscale_, the optimizer's take of the sums)
// can come before a statistic's launch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>

namespace lightning_cafin {

void set_tap_thread(bool on);
bool tap_thread();
// The works the worker has run without an error, ever (tests and diagnostics).
int64_t tap_thread_jobs();

// Run `work` (a tap's statistics and its sink add) on the tap thread, after everything
// queued before it, with `like`'s device's current CUDA stream (as the caller sees it)
// current there and grad mode off; at once where the thread is off.  Called from a tap
// inside a backward pass, which then waits for the work at its end.
void run_tap_work(const at::Tensor& like, std::function<void()> work);

// Wait until every queued work has run (without the GIL where the caller holds it), then
// raise the first error any of them raised since the last wait.
void tap_thread_drain();

}  // namespace lightning_cafin
