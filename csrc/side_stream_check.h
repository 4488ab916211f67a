// Whether two streams' work runs side by side on the device.
//
// The capture side stream (side_stream.h) pays only where its statistics kernels run
// beside the backward pass on the current stream.  But a CUDA stream's work goes to one of
// the device's few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), given out
// in turn as streams are made, and two streams on one queue run one after the other in
// launch order, as if they were one stream.  Which queue a new stream gets depends on how
// many streams the process (torch, cuDNN, NCCL, the user) made before it, so the side
// stream is checked once, when it is made, rather than trusted.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lightning_cafin {

// The time from the start of a spin of `ns` nanoseconds on `first` to the end of one on
// `second` launched right after it, over `ns`: about 1 where the two run side by side, about
// 2 where `second` waits behind `first`.  Waits for both streams' earlier work first (it is
// called once per side stream made, not per step).
double beside_ratio(cudaStream_t first, cudaStream_t second, int64_t ns);

}  // namespace lightning_cafin
