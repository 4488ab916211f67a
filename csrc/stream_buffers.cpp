// The statistics ops' device memory (stream_buffers.h).
#include "stream_buffers.h"

#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

namespace lightning_cafin {
namespace {

// A results block: 1 MiB, a few capture steps' results of ResNet-18 or ResNet-50 (by
// their layers' sizes, about 55 and 155 thousand floats a step).  A result above a quarter
// of it is allocated on its own (a block left mostly empty would be held for as long as
// its other slices are).
constexpr int64_t kBlockFloats = int64_t{1} << 18;
constexpr int64_t kOwnBlockAbove = kBlockFloats / 4;
// The scratch kept between ops: at most 4 MiB a stream (by its plan, ResNet-50's largest
// convolution workspace is about 3 MiB); a larger workspace is allocated for its op alone.
constexpr int64_t kScratchKeptFloats = int64_t{1} << 20;
constexpr int64_t kCounterSlotsLeast = 4096;

struct StreamBuffers {
  at::Tensor results;  // the block results are cut from
  int64_t results_used = 0;
  at::Tensor scratch;
  at::Tensor counters;
};

std::mutex& buffers_mutex() {
  static auto* mu = new std::mutex();
  return *mu;
}

// The buffers of like's device and `stream`; the caller holds buffers_mutex().
StreamBuffers& buffers_of(const at::Tensor& like, cudaStream_t stream) {
  // never destroyed: tensors freed after the CUDA context at exit would crash
  static auto* all = new std::map<std::pair<int, cudaStream_t>, StreamBuffers>();
  return (*all)[{static_cast<int>(like.device().index()), stream}];
}

}  // namespace

int64_t aligned(int64_t n) { return (n + 63) / 64 * 64; }

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

OpStream OpStream::current(const at::Tensor& like) {
  const cudaStream_t stream = current_stream(like);
  return {stream, stream_capturing(stream)};
}

at::Tensor new_f32(int64_t n, const at::Tensor& like) {
  return at::Tensor(at::detail::empty_cuda({n}, at::kFloat, like.device(), at::MemoryFormat::Contiguous));
}

at::Tensor part_of(const at::Tensor& buffer, int64_t offset, int64_t n) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()),
                                                   c10::DispatchKeySet(c10::DispatchKey::CUDA), buffer.dtype());
  impl->set_storage_offset(buffer.storage_offset() + offset);
  impl->set_sizes_contiguous({n});
  return at::Tensor(std::move(impl));
}

at::Tensor result_floats(int64_t n, const at::Tensor& like) {
  return result_floats(n, like, OpStream::current(like));
}

at::Tensor result_floats(int64_t n, const at::Tensor& like, const OpStream& on) {
  if (n > kOwnBlockAbove || on.capturing) return new_f32(n, like);
  const int64_t take = aligned(n);
  const std::lock_guard<std::mutex> lock(buffers_mutex());
  StreamBuffers& b = buffers_of(like, on.stream);
  if (!b.results.defined() || b.results_used + take > b.results.numel()) {
    // the full block is dropped here: its slices hold it until the step has read them
    b.results = new_f32(kBlockFloats, like);
    b.results_used = 0;
  }
  at::Tensor out = part_of(b.results, b.results_used, n);
  b.results_used += take;
  return out;
}

at::Tensor scratch_floats(int64_t n, const at::Tensor& like) {
  return scratch_floats(n, like, OpStream::current(like));
}

at::Tensor scratch_floats(int64_t n, const at::Tensor& like, const OpStream& on) {
  if (n > kScratchKeptFloats || on.capturing) return new_f32(n, like);
  const std::lock_guard<std::mutex> lock(buffers_mutex());
  StreamBuffers& b = buffers_of(like, on.stream);
  // (a smaller buffer dropped here is freed in stream order, after the launches that used it)
  if (!b.scratch.defined() || b.scratch.numel() < n) b.scratch = new_f32(std::max(n, int64_t{4096}), like);
  return b.scratch;
}

unsigned* counter_slots(const at::Tensor& like, int64_t n) {
  const cudaStream_t stream = current_stream(like);
  const std::lock_guard<std::mutex> lock(buffers_mutex());
  at::Tensor& pool = buffers_of(like, stream).counters;
  if (!pool.defined() || pool.numel() < n) {
    if (stream_capturing(stream)) return nullptr;
    // on this stream, so the fill precedes every launch that uses the slots
    pool = at::zeros({std::max(kCounterSlotsLeast, 2 * n)}, like.options().dtype(at::kInt));
  }
  return reinterpret_cast<unsigned*>(pool.data_ptr<int32_t>());
}

}  // namespace lightning_cafin
