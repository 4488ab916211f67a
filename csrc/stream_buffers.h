// The device memory the statistics ops (capture_ops.cpp) write to, taken without an
// allocator call per op where that is safe.
//
// A capture step's backward makes every captured layer's statistics op allocate its
// results and its workspace and free the workspace again, and the step frees the results
// after the factor update: on ResNet-18 about 120 caching-allocator calls a capture step
// (three per convolution or linear layer, one per norm, one per layer at the step), each a
// microsecond or two of host time in a step that is host-bound (bf16 + channels_last), and
// about 320 on ResNet-50.  Here each (device, stream) has
//
// - a results block, from which each op's results are cut in turn (`result_floats`): one
//   allocation per block instead of one per op, and no allocator call when the step drops
//   them (a slice only releases its share of the block, which is freed with its last
//   slice);
// - a scratch buffer (`scratch_floats`), grown when an op needs more: a workspace is only
//   used by the launches of the op that took it, and launches on one stream run in order,
//   so every op on the stream can use the same one;
// - the kernels' zeroed counter slots (`counter_slots`), the same way.
//
// On a stream being captured into a CUDA graph, results and scratch are allocated per op
// as before: memory taken outside the graph's pool and written by its replays could by then
// belong to something else.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace lightning_cafin {

// n rounded up to a multiple of 64: parts of one float buffer start there (256 bytes: the
// kernels' vector loads, and the caching allocator's own alignment).
int64_t aligned(int64_t n);

// Whether work on `stream` is being captured into a CUDA graph.  An error asking (the
// legacy stream while another stream is captured) counts as yes, the safe answer for
// every caller (memory per op, no side stream), and is cleared: the next launch's check
// would report it as its own.
bool stream_capturing(cudaStream_t stream);

// The current stream of t's device: the one the statistics ops launch on and take memory for.
cudaStream_t current_stream(const at::Tensor& t);

// n floats on like's device, from the caching allocator on the current stream (at::empty
// without its dispatch).
at::Tensor new_f32(int64_t n, const at::Tensor& like);

// Floats [offset, offset + n) of `buffer` as a 1-D tensor of their own on its storage
// (narrow without its dispatch).  Not an autograd view: no statistic needs a gradient.
at::Tensor part_of(const at::Tensor& buffer, int64_t offset, int64_t n);

// The stream an op runs on (the current stream of its tensors' device) and whether it is
// being captured into a CUDA graph, asked once per op: a statistics op asked the driver up
// to three times (its results, its workspace, whether its sums may be deferred), 167 calls
// and about 0.1 ms of a profiled ResNet-50 capture step's backward
// (docs/results/profile-capture-resnet50-h100-385ef91.txt).  Valid while that stream stays
// current and its capture state unchanged: within one op.
struct OpStream {
  cudaStream_t stream;
  bool capturing;
  static OpStream current(const at::Tensor& like);
};

// n floats for results that live until the step reads them, on like's device and the
// current stream (`on`, where the op has asked already): a 256-byte aligned slice of that
// stream's results block.
at::Tensor result_floats(int64_t n, const at::Tensor& like);
at::Tensor result_floats(int64_t n, const at::Tensor& like, const OpStream& on);

// At least n floats of workspace for the launches of one op on the current stream (`on`, as
// above), which must be made before the next call on that stream.  The tensor holds the
// memory: keep it until those launches are made.
at::Tensor scratch_floats(int64_t n, const at::Tensor& like);
at::Tensor scratch_floats(int64_t n, const at::Tensor& like, const OpStream& on);

// n zeroed counter slots for the kernels' last-block reductions (capture_launch.h), from
// the current stream's pool: a launch's last blocks reset the slots they used and launches
// on one stream run in order, so the same slots serve every launch with no clearing.  Null
// when the stream has no pool big enough and is being captured into a CUDA graph (a zero
// fill made now would only run at replay): the caller then reduces each column in one block.
unsigned* counter_slots(const at::Tensor& like, int64_t n);

}  // namespace lightning_cafin
