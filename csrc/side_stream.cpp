// See side_stream.h.  One side stream and one ordering event per device and priority,
// created on first use and kept for the process (an event may be recorded again as soon as
// a wait on it has been enqueued: the wait captures the record that preceded it).
#include "side_stream.h"
#include "deferred_sums.h"
#include "stream_buffers.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

namespace lightning_cafin {
namespace {

struct DeviceSide {
  c10::cuda::CUDAStream stream;
  cudaEvent_t event = nullptr;
  bool pending = false;  // side work not yet joined into the current stream
};

std::mutex& side_mutex() {
  static std::mutex mu;
  return mu;
}

// Default priority unless set: on H100s, whether the side stream's kernels ran beside the
// backward pass's followed the stream, not its priority (in one process the default-priority
// one did and the high-priority one not, in another the other way round:
// docs/results/side-stream-priority-h100-e4859e1.txt).
std::atomic<bool>& high_priority() {
  static std::atomic<bool> high{false};
  return high;
}

// never destroyed: streams and events must outlive every exit-time tensor free.  Keyed by
// (device, high priority): a change of priority takes the other stream from then on, and
// work pending on the one before is still joined and released (each_pending).
std::map<std::pair<int, bool>, DeviceSide>& sides() {
  static auto* m = new std::map<std::pair<int, bool>, DeviceSide>();
  return *m;
}

DeviceSide& side_for(int device) {
  auto& m = sides();
  const bool high = high_priority().load();
  auto it = m.find({device, high});
  if (it == m.end()) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    DeviceSide d{c10::cuda::getStreamFromPool(high, static_cast<c10::DeviceIndex>(device))};
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&d.event, cudaEventDisableTiming));
    it = m.emplace(std::make_pair(device, high), d).first;
  }
  return it->second;
}

// the streams side_enter() replaced, innermost last (per thread: backward hooks may run
// on the autograd engine's device threads)
thread_local std::vector<c10::cuda::CUDAStream> t_replaced;

// `waiter` waits for what `done` has enqueued so far.
void order(cudaEvent_t ev, cudaStream_t done, cudaStream_t waiter) {
  C10_CUDA_CHECK(cudaEventRecord(ev, done));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, ev, 0));
}

// The side stream of `device`, made to wait for the current stream's work so far and
// marked pending; none while the current stream is being captured into a CUDA graph.
std::optional<c10::cuda::CUDAStream> order_side_after_current(c10::DeviceIndex device) {
  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(device);
  if (stream_capturing(cur.stream())) return std::nullopt;
  std::lock_guard<std::mutex> lock(side_mutex());
  DeviceSide& d = side_for(device);
  order(d.event, cur.stream(), d.stream.stream());
  d.pending = true;
  return d.stream;
}

// The caching allocator keeps t's memory until `side` is done with it.
void record_read(const at::Tensor& t, const c10::cuda::CUDAStream& side) {
  if (t.defined() && t.is_cuda() && t.storage().data_ptr().get())
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), side);
}

// f(side state, that device's current stream) for every device with side work
// not yet released.
template <typename F>
void each_pending(F&& f) {
  std::lock_guard<std::mutex> lock(side_mutex());
  for (auto& [key, d] : sides()) {
    if (!d.pending) continue;
    const int device = key.first;
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    f(d, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
  }
}

}  // namespace

bool set_side_high_priority(bool high) { return high_priority().exchange(high); }

SideScope::SideScope(const at::Tensor& like, bool want) {
  if (!want || !like.is_cuda()) return;
  if (auto side = order_side_after_current(like.device().index())) guard_.emplace(*side);
}

void SideScope::reads(const at::Tensor& t) const {
  if (guard_.has_value()) record_read(t, guard_->current_stream());
}

bool side_enter(const std::vector<at::Tensor>& reads) {
  if (reads.empty() || !reads[0].defined() || !reads[0].is_cuda()) return false;
  const c10::DeviceIndex device = reads[0].device().index();
  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(device);
  const auto side = order_side_after_current(device);
  if (!side) return false;
  for (const at::Tensor& t : reads) record_read(t, *side);
  t_replaced.push_back(cur);
  c10::cuda::setCurrentCUDAStream(*side);
  return true;
}

void side_exit() {
  TORCH_CHECK(!t_replaced.empty(), "capture_side_exit() without a matching capture_side_enter()");
  c10::cuda::setCurrentCUDAStream(t_replaced.back());
  t_replaced.pop_back();
}

void capture_join() {
  finish_deferred_sums();  // (on their streams: the side streams' finish is then part of what is joined)
  each_pending([](DeviceSide& d, cudaStream_t cur) {
    if (stream_capturing(cur)) {
      // a graph cannot wait on work outside it: finish the side work first
      C10_CUDA_CHECK(cudaStreamSynchronize(d.stream.stream()));
    } else {
      order(d.event, d.stream.stream(), cur);
    }
  });
}

void capture_release() {
  each_pending([](DeviceSide& d, cudaStream_t cur) {
    if (!stream_capturing(cur)) order(d.event, cur, d.stream.stream());
    d.pending = false;
  });
}

}  // namespace lightning_cafin
