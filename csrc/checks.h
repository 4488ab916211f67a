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

// An entry of a list argument named only when a check fails: the checks below take it or
// a string, and spell it out inside the failure message alone (a per-entry string built
// for every tensor of every call cost host time on each step).
struct Entry {
  const char* list;
  int64_t i;
};
inline std::string name_of(const Entry& e) { return indexed(e.list, e.i); }
inline const std::string& name_of(const std::string& s) { return s; }
inline std::string name_of(const char* s) { return s; }

// torch's name of the dtype: "float32", "bfloat16", "float64"...
inline std::string dtype_name(at::ScalarType s) { return std::string(c10::getDtypeNames(s).first); }

// The dtypes every kernel reads: float32, float16, bfloat16.
inline bool is_kernel_float(at::ScalarType s) { return s == at::kFloat || s == at::kHalf || s == at::kBFloat16; }

template <typename N>
void check_defined(const at::Tensor& t, const char* op, const N& name) {
  TORCH_CHECK(t.defined(), op, name_of(name), " is undefined (None)");
}

// t is a CUDA tensor (on any device).
template <typename N>
void check_cuda(const at::Tensor& t, const char* op, const N& name) {
  check_defined(t, op, name);
  TORCH_CHECK(t.is_cuda(), op, name_of(name), " must be a CUDA tensor, got a tensor on ", t.device().str());
}

// t is a CUDA tensor on `device`, the device of the argument named `device_of`.
template <typename N>
void check_cuda_on(const at::Tensor& t, const char* op, const N& name, const c10::Device& device,
                   const char* device_of) {
  check_cuda(t, op, name);
  TORCH_CHECK(t.device() == device, op, name_of(name), " is on ", t.device().str(), " but ", device_of, " is on ", device.str(),
              "; call the op once per device");
}

template <typename N>
void check_kernel_float(const at::Tensor& t, const char* op, const N& name) {
  TORCH_CHECK(is_kernel_float(t.scalar_type()), op, name_of(name), " must be float32, float16 or bfloat16, got ",
              dtype_name(t.scalar_type()));
}

template <typename N>
void check_dtype(const at::Tensor& t, at::ScalarType want, const char* op, const N& name) {
  TORCH_CHECK(t.scalar_type() == want, op, name_of(name), " must be ", dtype_name(want), ", got ", dtype_name(t.scalar_type()));
}

template <typename N>
void check_contiguous(const at::Tensor& t, const char* op, const N& name) {
  TORCH_CHECK(t.is_contiguous(), op, name_of(name), " must be contiguous (strides ", dims_str(t.strides()), ")");
}

template <typename N>
void check_contiguous_1d(const at::Tensor& t, const char* op, const N& name) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), op, name_of(name), " must be a contiguous 1-D tensor, got shape ",
              dims_str(t.sizes()), " strides ", dims_str(t.strides()));
}

// t is dense: contiguous, or non-overlapping and dense in another memory order (channels_last).
template <typename N>
void check_dense(const at::Tensor& t, const char* op, const N& name) {
  TORCH_CHECK(t.is_contiguous() || t.is_non_overlapping_and_dense(), op, name_of(name),
              " must be dense: contiguous or non-overlapping and dense (strides ", dims_str(t.strides()), ")");
}

// t (logical (O, C, *k) with C = inner) is stored channels innermost, as channels_last and
// channels_last_3d store a convolution's weight: C with stride 1, then the k dims in their
// order, dim 0 outermost (the strides of size-1 dims are not looked at).
template <typename N>
void check_channels_innermost(const at::Tensor& t, int64_t inner, const char* op, const N& name) {
  bool ok = t.dim() >= 3 && t.size(1) == inner && (inner == 1 || t.stride(1) == 1);
  int64_t expected = inner;
  for (int64_t d = t.dim() - 1; ok && d >= 2; --d) {
    ok = t.size(d) == 1 || t.stride(d) == expected;
    expected *= t.size(d);
  }
  ok = ok && (t.size(0) == 1 || t.stride(0) == expected);
  TORCH_CHECK(ok, op, name_of(name), " is not stored channels innermost with ", num(inner),
              " channels (shape ", dims_str(t.sizes()), ", strides ", dims_str(t.strides()), ")");
}

// t has like's memory layout: both contiguous, or the same strides.
template <typename N, typename L>
void check_same_layout(const at::Tensor& t, const at::Tensor& like, const char* op, const N& name, const L& like_name) {
  TORCH_CHECK(like.is_contiguous() ? t.is_contiguous() : t.strides() == like.strides(), op, name_of(name),
              like.is_contiguous() ? " must be contiguous, as " : " must have the strides of ", name_of(like_name),
              " (strides ", dims_str(t.strides()), " vs ", dims_str(like.strides()), ")");
}

template <typename N, typename L>
void check_same_shape(const at::Tensor& t, const at::Tensor& like, const char* op, const N& name, const L& like_name) {
  TORCH_CHECK(t.sizes() == like.sizes(), op, name_of(name), " has shape ", dims_str(t.sizes()), " but ", name_of(like_name),
              " has shape ", dims_str(like.sizes()));
}

// A list argument has one entry per entry of the list named `per`.
inline void check_list_size(int64_t got, int64_t want, const char* op, const char* name, const char* per) {
  TORCH_CHECK(got == want, op, name_of(name), " has ", num(got), " entries but ", per, " has ", num(want));
}

// A one-element float32 tensor on `device` (grad_scale, found_inf, lr_tensor).
template <typename N>
void check_device_scalar(const at::Tensor& t, const char* op, const N& name, const c10::Device& device,
                         const char* device_of) {
  check_cuda_on(t, op, name, device, device_of);
  check_dtype(t, at::kFloat, op, name);
  TORCH_CHECK(t.numel() == 1, op, name_of(name), " must have exactly one element, got ", num(t.numel()));
}

// Raises the op's error for a failed launch (see the note at the top).
inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, "kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace lightning_cafin
