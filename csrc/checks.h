// Argument checks shared by the g++-compiled op files (adafisher_step_op.cpp,
// capture_ops.cpp): every failed check raises c10::Error (a Python RuntimeError) whose
// message starts with the op ("adafisher_step_: ") and names the argument ("grads[3]").
// The .cu launchers never raise: they return a cudaError_t that check_launch() turns into
// the op's error.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace lightning_cafin {

// Numbers in check messages are formatted with std::to_string, never streamed.  On the
// GPU machine's toolchain (torch 2.11, extension built by /opt/gcc) the extension carries
// its own copy of std::ostream::_M_insert<long>; streaming any integer or double into
// c10::str's ostringstream jumped through a mismatched locale facet and segfaulted (seen
// under cuda-gdb: SIGSEGV in basic_ostream::_M_insert<long> inside lightning_cafin_C.so,
// called from adafisher_step_), so every failed check that carried a number crashed the
// process instead of raising.  Strings and const char* are streamed safely, hence also
// Device::str() and dtype_name() below rather than streaming a Device or a ScalarType.
template <typename T>
std::string num(T v) {
  return std::to_string(v);
}

// "(2, 3, 4)"
inline std::string dims_str(at::IntArrayRef dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ", ";
    out += num(dims[i]);
  }
  return out + ")";
}

// "name[i]": an entry of a list argument (indices as int64_t, never size_t).
inline std::string indexed(const char* name, int64_t i) { return std::string(name) + "[" + num(i) + "]"; }

// torch's name of the dtype: "float32", "bfloat16", "float64"...
inline std::string dtype_name(at::ScalarType s) { return std::string(c10::getDtypeNames(s).first); }

// The dtypes every kernel reads: float32, float16, bfloat16.
inline bool is_kernel_float(at::ScalarType s) { return s == at::kFloat || s == at::kHalf || s == at::kBFloat16; }

inline void check_defined(const at::Tensor& t, const char* op, const std::string& name) {
  TORCH_CHECK(t.defined(), op, name, " is undefined (None)");
}

// t is a CUDA tensor (on any device).
inline void check_cuda(const at::Tensor& t, const char* op, const std::string& name) {
  check_defined(t, op, name);
  TORCH_CHECK(t.is_cuda(), op, name, " must be a CUDA tensor, got a tensor on ", t.device().str());
}

// t is a CUDA tensor on `device`, the device of the argument named `device_of`.
inline void check_cuda_on(const at::Tensor& t, const char* op, const std::string& name, const c10::Device& device,
                          const char* device_of) {
  check_cuda(t, op, name);
  TORCH_CHECK(t.device() == device, op, name, " is on ", t.device().str(), " but ", device_of, " is on ", device.str(),
              "; call the op once per device");
}

inline void check_kernel_float(const at::Tensor& t, const char* op, const std::string& name) {
  TORCH_CHECK(is_kernel_float(t.scalar_type()), op, name, " must be float32, float16 or bfloat16, got ",
              dtype_name(t.scalar_type()));
}

inline void check_dtype(const at::Tensor& t, at::ScalarType want, const char* op, const std::string& name) {
  TORCH_CHECK(t.scalar_type() == want, op, name, " must be ", dtype_name(want), ", got ", dtype_name(t.scalar_type()));
}

inline void check_contiguous(const at::Tensor& t, const char* op, const std::string& name) {
  TORCH_CHECK(t.is_contiguous(), op, name, " must be contiguous (strides ", dims_str(t.strides()), ")");
}

inline void check_contiguous_1d(const at::Tensor& t, const char* op, const std::string& name) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), op, name, " must be a contiguous 1-D tensor, got shape ",
              dims_str(t.sizes()), " strides ", dims_str(t.strides()));
}

inline void check_same_shape(const at::Tensor& t, const at::Tensor& like, const char* op, const std::string& name,
                             const std::string& like_name) {
  TORCH_CHECK(t.sizes() == like.sizes(), op, name, " has shape ", dims_str(t.sizes()), " but ", like_name,
              " has shape ", dims_str(like.sizes()));
}

// A list argument has one entry per entry of the list named `per`.
inline void check_list_size(int64_t got, int64_t want, const char* op, const char* name, const char* per) {
  TORCH_CHECK(got == want, op, name, " has ", num(got), " entries but ", per, " has ", num(want));
}

// A one-element float32 tensor on `device` (grad_scale, found_inf, lr_tensor).
inline void check_device_scalar(const at::Tensor& t, const char* op, const std::string& name,
                                const c10::Device& device, const char* device_of) {
  check_cuda_on(t, op, name, device, device_of);
  check_dtype(t, at::kFloat, op, name);
  TORCH_CHECK(t.numel() == 1, op, name, " must have exactly one element, got ", num(t.numel()));
}

// Raises the op's error for a failed launch (see the note at the top).
inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, "kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace lightning_cafin
