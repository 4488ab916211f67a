// Host entry point of the fused AdaFisher / AdaFisherW step.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace lightning_cafin {

// Elements per (tensor, chunk) work item; one CUDA block per work item.  16K rather than
// torch's 64K: with one launch per step the last wave's balance matters, and the GPT's
// step took 0.82-0.83 ms with 16K chunks against 0.85 ms with 64K (H200).
constexpr int kStepChunkSize = 16384;
// Threads per block of the step kernel.
constexpr int kStepBlockSize = 512;
// Tensors per launch of the step kernel, of any size: as many as fit the 32 KiB of kernel
// parameters (64 bytes of StepItem and 4 of unit start each).  Transformer LMs and
// ResNet-50 (149 and 161 tensors) step in one launch; with 32 tensors and 1024 blocks per
// launch, as before, the GPT took 5 launches and each boundary drained ~30 us of waves.
constexpr int kStepMaxTensors = 448;
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
    const std::vector<int64_t>& inners,
    double lr,
    double beta,
    double Lambda,
    double weight_decay,
    bool decoupled,
    const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf,
    const std::optional<at::Tensor>& lr_tensor);

}  // namespace lightning_cafin
