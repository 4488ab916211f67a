// The sums over splits that the gradient taps' rows-kernel launches leave for later
// (capture_launch.h: RowsItem.deferred, FinishItem), per stream, until one launch per
// stream sums them all.
//
// Why: a launch of the rows kernel ends with its last blocks' tails, a device-wide fence,
// a count and one block summing every split's partials alone, 2.5-8 us a launch, about
// 157 us of ResNet-50's capture step on an H100 with the device idle beside them.  A tap's
// launch instead stops at its partials; the finish sums them later in one launch for every
// layer (the same floats: finish_sums_kernel sums them as the last block would).
//
// Protocol: a tap's layer_stats registers what it deferred (defer_sums), with the tensors
// its finish writes or reads, held until that launch is made; finish_deferred_sums() makes
// every stream's launch, on that stream.  capture_join() runs it before it orders the
// current streams after the side streams, and so does a sink's take (capture_tap.h) before
// it hands out any result: a tap's sums are read only after one of them.  Where the
// caller's current stream is not the one a backward ran on, it is made to wait for that
// stream's finish.  Nothing is deferred on a stream being captured into a CUDA graph.
#pragma once

#include "capture_launch.h"

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <initializer_list>
#include <vector>

namespace lightning_cafin {

// Register `deferred` (the reads a launch on `stream` left to finish, those with .set) on
// like's device; `keep` (the partials' workspace and the results the finish writes) is held
// until the finish launch is made.
void defer_sums(const at::Tensor& like, cudaStream_t stream, std::initializer_list<const DeferredSums*> deferred,
                std::vector<at::Tensor> keep);

// Launch every stream's deferred sums (one launch per stream, on it), then let go of what
// they held.  Cheap when nothing is pending (one atomic read).  Raises, leaving all of it
// pending, where one of those streams or the caller's current one is being captured into
// a CUDA graph (a launch there would run only at the graph's replays).
void finish_deferred_sums();

}  // namespace lightning_cafin
