// Deferred sums over splits (deferred_sums.h).
#include "deferred_sums.h"

#include "checks.h"
#include "stream_buffers.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <mutex>
#include <utility>

namespace lightning_cafin {
namespace {

struct Pending {
  c10::DeviceIndex device;
  cudaStream_t stream;
  std::vector<FinishItem> items;
  std::vector<at::Tensor> keep;
};

struct Registry {
  std::mutex mu;
  std::vector<Pending> pending;  // one entry per (device, stream), in the order first used
  std::atomic<bool> any{false};
};

Registry& registry() {
  // never destroyed: tensors freed after the CUDA context at exit would crash
  static auto* r = new Registry();
  return *r;
}

}  // namespace

void defer_sums(const at::Tensor& like, cudaStream_t stream, std::initializer_list<const DeferredSums*> deferred,
                std::vector<at::Tensor> keep) {
  std::vector<FinishItem> items;
  for (const DeferredSums* d : deferred) {
    if (d != nullptr && d->set) items.push_back(d->item);
  }
  if (items.empty()) return;
  const c10::DeviceIndex device = like.device().index();
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  Pending* p = nullptr;
  for (Pending& q : r.pending) {
    if (q.device == device && q.stream == stream) p = &q;
  }
  if (p == nullptr) {
    r.pending.push_back(Pending{device, stream, {}, {}});
    p = &r.pending.back();
  }
  p->items.insert(p->items.end(), items.begin(), items.end());
  for (at::Tensor& t : keep) p->keep.push_back(std::move(t));
  r.any.store(true, std::memory_order_release);
}

void finish_deferred_sums() {
  Registry& r = registry();
  if (!r.any.load(std::memory_order_acquire)) return;
  std::vector<Pending> work;
  std::vector<cudaStream_t> takers;  // the caller's current stream on each one's device
  {
    const std::lock_guard<std::mutex> lock(r.mu);
    // Every stream checked before any work is taken out: a refusal leaves all of it pending
    // (a caller that goes on takes the statistics later, none of them left unsummed).
    // (a launch now would only be recorded into the graph, and run at its replays)
    const char* refused =
        "finish_deferred_sums: the gradient taps' statistics of a backward run outside a CUDA graph are taken ";
    const char* fix = "; take them (the optimizer step) before the capture begins";
    for (const Pending& p : r.pending) {
      const c10::cuda::CUDAGuard guard(p.device);
      TORCH_CHECK(!stream_capturing(p.stream), refused, "while their stream is being captured into one", fix);
      takers.push_back(c10::cuda::getCurrentCUDAStream(p.device).stream());
      TORCH_CHECK(takers.back() == p.stream || !stream_capturing(takers.back()), refused,
                  "on a stream being captured into one", fix);
    }
    work.swap(r.pending);
    r.any.store(false, std::memory_order_release);
  }
  for (size_t k = 0; k < work.size(); ++k) {
    const Pending& p = work[k];
    const c10::cuda::CUDAGuard guard(p.device);
    check_launch(launch_finish_sums(p.items.data(), static_cast<int>(p.items.size()), p.stream),
                 "finish_deferred_sums: ");
    // the stream that takes the sums (the caller's current one) waits for the finish where
    // the backward ran on another: a wait the caller made after the backward (wait_stream)
    // came before this launch, so it does not cover it
    const cudaStream_t taker = takers[k];
    if (taker != p.stream) {
      cudaEvent_t done = nullptr;
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      C10_CUDA_CHECK(cudaEventRecord(done, p.stream));
      C10_CUDA_CHECK(cudaStreamWaitEvent(taker, done, 0));
      C10_CUDA_CHECK(cudaEventDestroy(done));  // (the wait enqueued holds what it needs)
    }
  }
  // `work` drops the kept tensors here: their memory returns to the caching allocator of
  // the stream it was taken on, for work ordered after the finish launches made above
}

}  // namespace lightning_cafin
