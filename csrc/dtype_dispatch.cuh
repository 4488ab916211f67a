// The floating dtypes the kernels read (float32, float16, bfloat16), as C++ types: the one
// switch from at::ScalarType to a template argument, shared by the .cu launchers.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime_api.h>

namespace lightning_cafin {

// f(static_cast<T*>(nullptr)) for the C++ type T of dtype; cudaErrorInvalidValue for any
// other dtype (the ops check dtypes first, so that is a bug, reported, never a throw).
template <typename F>
cudaError_t dispatch_float_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(static_cast<float*>(nullptr));
    case at::kHalf:
      return f(static_cast<c10::Half*>(nullptr));
    case at::kBFloat16:
      return f(static_cast<c10::BFloat16*>(nullptr));
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace lightning_cafin
