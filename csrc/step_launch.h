// Host/device boundary of the fused step: plain structs and two launchers.
//
// The op itself (argument checks, building the work list) lives in the g++-compiled
// adafisher_step_op.cpp, calls these and raises on the error they return; the .cu holds
// kernels and launchers and throws nothing (as capture_launch.h).  On the GPU machine's
// toolchain an exception thrown from nvcc-compiled host code crashed the process
// instead of reaching Python.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace lightning_cafin {

// One parameter of the step (one slot of a launch's by-value list).
struct StepItem {
  void* p;
  const void* g;
  void* m;
  const float* S;  // nullptr: no factors (F = 1)
  const float* H;  // already advanced by the parameter's col_offset
  const float* step;
  int64_t numel;
  int32_t ncols;
  // 1: memory column m is logical column m.  C > 1: the parameter is stored channels
  // innermost (channels_last / channels_last_3d conv weights, logical (O, C, *k)): memory
  // column m = k * C + c holds logical column c * (ncols / C) + k.
  int32_t inner;
};

struct StepScalars {
  const float* lr_ptr;  // non-null: the learning rate is read here, on the device (lr, lr_f unused)
  double lr;
  double beta;
  float lr_f;
  float beta_f;
  float one_minus_beta_f;
  float lambda_f;
  float wd_f;
  int decoupled;
  int has_wd;
};

// Every launch's error is returned (the first one; no later launch is made), never thrown.
// pdtype float32 / float16 / bfloat16; mdtype pdtype or float32.
cudaError_t launch_adafisher_step(const StepItem* items, size_t n, at::ScalarType pdtype, at::ScalarType mdtype,
                                  const StepScalars& sc, const float* grad_scale, const float* found_inf,
                                  cudaStream_t stream);

// steps[i] += 1 on the device unless *found_inf is nonzero; must follow the step launches
// on the same stream (their blocks read the counts).
cudaError_t launch_step_increments(float* const* steps, size_t n, const float* found_inf, cudaStream_t stream);

}  // namespace lightning_cafin
