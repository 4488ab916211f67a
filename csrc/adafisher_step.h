// Host entry point of the fused AdaFisher / AdaFisherW step.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace lightning_cafin {

// Elements per (tensor, chunk) work item; one CUDA block per work item.
constexpr int kStepChunkSize = 65536;
// Threads per block of the step kernel.
constexpr int kStepBlockSize = 512;
// Capacity of one launch's by-value metadata.  1024 blocks (about 2 waves of 512-thread
// blocks on a 132-SM GPU) keep the device full during a launch; with 320, as torch's
// multi-tensor launches use, a 1e9-element step was 48 launches each at ~60% occupancy.
constexpr int kStepMaxTensors = 32;
constexpr int kStepMaxBlocks = 1024;
// Step counters incremented per launch of the counter kernel.
constexpr int kIncMaxTensors = 480;

// Applies one AdaFisher (decoupled=false, L2 decay) or AdaFisherW (decoupled=true)
// update in place to every params[i] / exp_avgs[i] and increments steps[i] by one,
// all on the current CUDA stream, without host synchronisation and without
// allocating.  See csrc/adafisher_step.cu for the exact contract.
void adafisher_step_(
    const std::vector<at::Tensor>& params,
    const std::vector<at::Tensor>& grads,
    const std::vector<at::Tensor>& exp_avgs,
    const std::vector<at::Tensor>& steps,
    const std::vector<std::optional<at::Tensor>>& S_list,
    const std::vector<std::optional<at::Tensor>>& H_list,
    const std::vector<int64_t>& col_offsets,
    const std::vector<int64_t>& ncols,
    double lr,
    double beta,
    double Lambda,
    double weight_decay,
    bool decoupled,
    const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& lr_tensor);

}  // namespace lightning_cafin
