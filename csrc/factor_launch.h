// A capture step's factor update kept across capture steps (factors.py, KeptLaunch): the
// layers' launch items built and checked once, and the NaN flags written by the kernel
// straight into pinned host memory.
//
// What it replaces, per capture step of the usual kind (the same layers, factors and sums'
// sizes as the previous one): factor_update_'s checks and item building for every layer
// (about 100 microseconds for ResNet-18's 41 layers on a slow host, where such a step is
// host-bound), and for the flags a device tensor, its non-blocking copy to a pinned buffer
// and an event record through Python (about 70 more).  Here a step fills two pointers per
// layer, makes one launch and records one event; HostFlags reads the flags once the event
// has completed.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <vector>

#include "capture_launch.h"
#include "checks.h"

namespace lightning_cafin {

struct TakenSums;

// One layer's factor-update item from its stored factors and the plan's numbers, checked
// (kind, flags, positive divisors; errors start with `op`), as factor_update_ and
// FactorLaunch both make it: the sums' pointers h, s and their length nh are the caller's.
FactorItem factor_item(const char* op, int64_t i, const at::Tensor& H, const at::Tensor& S, int64_t kind,
                       int64_t flags, double h_div, double s_div, double s_scale, double extra);

// The layer count L of a factor update's per-layer lists (`sizes`: each list's length),
// checked: every list has one entry per layer, and 1 <= L <= INT32_MAX.
int64_t factor_layer_count(const char* op, std::initializer_list<size_t> sizes);

// A factor update's per-layer vector (a sum or a factor, `name`), checked: float32,
// contiguous, 1-D, of 1 to INT32_MAX elements, on `device` (that of `first`, named in the error).
void check_factor_vector(const at::Tensor& t, const char* op, const Entry& name, const c10::Device& device,
                         const char* first);

// One pinned, device-mapped int32 buffer for a launch's NaN flags and the event recorded
// after that launch; reused by later launches once read and complete.
struct FlagSlot {
  int32_t* host = nullptr;
  int32_t* device_ptr = nullptr;
  cudaEvent_t event = nullptr;
  FlagSlot(int64_t n, int device);
  ~FlagSlot();
  FlagSlot(const FlagSlot&) = delete;
  FlagSlot& operator=(const FlagSlot&) = delete;
};

// One launch's NaN flags (1: that layer's statistics held a NaN and its factors were left
// as they were), on the host once its launch has completed.
class HostFlags {
 public:
  HostFlags(std::shared_ptr<FlagSlot> slot, int64_t n) : slot_(std::move(slot)), n_(n) {}
  // The flags, waiting for the launch the first time (without the GIL); the slot is then
  // given back for reuse.
  std::vector<int32_t> values();
  // Whether values() would not wait.
  bool ready();
  int64_t size() const { return n_; }

 private:
  std::mutex mu_;
  std::shared_ptr<FlagSlot> slot_;  // (none once read)
  std::vector<int32_t> values_;
  int64_t n_;
};

// factor_update_'s per-layer arguments after the sums (H, S, kinds, flags, h_div, s_div,
// s_scale, extra), checked as factor_update_ checks them and turned into launch items once.
// run() takes the sums take_single took (checked there: float32, contiguous, 1-D, of the
// sizes and device the kept launch expects), launches the update on the current stream of
// the factors' device and returns its flags.
class FactorLaunch {
 public:
  FactorLaunch(std::vector<at::Tensor> H, std::vector<at::Tensor> S, const std::vector<int64_t>& kinds,
               const std::vector<int64_t>& flags, const std::vector<double>& h_div, const std::vector<double>& s_div,
               const std::vector<double>& s_scale, const std::vector<double>& extra);
  std::shared_ptr<HostFlags> run(const TakenSums& taken, double c_old, double c_new);
  int64_t size() const { return static_cast<int64_t>(items_.size()); }

 private:
  std::shared_ptr<FlagSlot> free_slot();

  std::vector<at::Tensor> H_, S_;  // (held: the items point into them)
  std::vector<int32_t> append_;    // per layer, H's entries past h's (the bias column: 1, else 0)
  std::vector<int32_t> two_cols_;  // per layer, 1 for a two-column layer (H has 2 entries, h any)
  std::vector<FactorItem> items_;
  c10::Device device_;
  std::vector<std::shared_ptr<FlagSlot>> slots_;
};

}  // namespace lightning_cafin
