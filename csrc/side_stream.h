// The capture statistics' side stream: the statistics kernels (memory-bound) run beside
// the backward pass's convolutions and matrix products (compute-bound) on a second
// stream per device, ordered in C++ so that each layer costs the host a few
// microseconds instead of a Python stream switch.
//
// Protocol: each statistics op opened with SideScope(want = true) waits for the work the
// current stream has enqueued so far, marks its inputs as used by the side stream (the
// caching allocator then keeps their memory until the side stream is done with them)
// and allocates its outputs on the side stream.  Before the statistics are consumed,
// capture_join() makes every device's current stream wait for its side stream; after
// they are consumed, capture_release() makes the side stream wait for the current one
// (outputs freed after consumption return to the side stream's pool, and must not be
// reused while the consumers may still read them).  A stream being captured into a CUDA
// graph never uses the side stream.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include <initializer_list>
#include <optional>
#include <vector>

namespace lightning_cafin {

class SideScope {
 public:
  // `like` picks the device; `want` false (or a capturing stream) leaves the current stream.
  SideScope(const at::Tensor& like, bool want);
  SideScope(const SideScope&) = delete;
  SideScope& operator=(const SideScope&) = delete;
  // mark a tensor read on the side stream (no-op when the scope stayed on the current stream)
  void reads(const at::Tensor& t) const;
  bool active() const { return guard_.has_value(); }

 private:
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
};

// Make the side stream of reads[0]'s device current on this thread, after it waits for
// the current stream's work so far, with every tensor of `reads` marked as read there:
// one ordering for all the statistics ops of a layer.  Returns false (nothing changed)
// for CPU tensors or a capturing stream; every true must be paired with side_exit().
bool side_enter(const std::vector<at::Tensor>& reads);
// Restore the stream that the matching side_enter() replaced.
void side_exit();

// Whether the side stream used from now on is one of torch's high-priority streams (the
// block scheduler then starts its kernels' blocks before pending ones of default-priority
// streams: the backward pass's) or a default-priority one (the default); returns the
// setting before.
bool set_side_high_priority(bool high);

// The current stream of every device with unjoined side work waits for that work.
void capture_join();
// The side streams wait for the current streams; the side work is then forgotten.
void capture_release();

}  // namespace lightning_cafin
