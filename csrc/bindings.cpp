// pybind11 bindings of the lightning_cafin CUDA extension.
#include <torch/extension.h>

#include "adafisher_step.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_cafin fused CUDA kernels (AdaFisher / AdaFisherW step)";

  m.def("adafisher_step_", &lightning_cafin::adafisher_step_,
        R"doc(Fused AdaFisher / AdaFisherW step, in place, on the current CUDA stream.

All tensors on one CUDA device.  params and grads share one dtype (float32, float16
or bfloat16); exp_avgs are all in that dtype or all float32; every tensor is
contiguous; steps[i] is a float32 one-element device tensor (incremented by 1).
S_list[i] / H_list[i] are parameter i's float32 contiguous 1-D factor vectors, or
None when it has no factors (F = 1); parameter i is then viewed as a
(len(S_list[i]), ncols[i]) matrix reading H_list[i][col_offsets[i]:col_offsets[i] +
ncols[i]] (col_offsets/ncols are ignored for unfactored entries).
decoupled=False: AdaFisher (L2 decay); True: AdaFisherW (decoupled decay).
grad_scale: optional float32 device scalar, gradients are divided by it.
found_inf: optional float32 device scalar; nonzero means nothing changes at all.
No allocation, no host synchronisation: CUDA-graph capturable.)doc",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("steps"),
        py::arg("S_list"), py::arg("H_list"), py::arg("col_offsets"), py::arg("ncols"),
        py::arg("lr"), py::arg("beta"), py::arg("Lambda"), py::arg("weight_decay"),
        py::arg("decoupled"), py::arg("grad_scale") = py::none(),
        py::arg("found_inf") = py::none());

  m.attr("CHUNK_SIZE") = lightning_cafin::kStepChunkSize;
  m.attr("BLOCK_SIZE") = lightning_cafin::kStepBlockSize;
  m.attr("MAX_TENSORS_PER_LAUNCH") = lightning_cafin::kStepMaxTensors;
  m.attr("MAX_BLOCKS_PER_LAUNCH") = lightning_cafin::kStepMaxBlocks;
  m.attr("MAX_STEPS_PER_INCREMENT_LAUNCH") = lightning_cafin::kIncMaxTensors;
}
