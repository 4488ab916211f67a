// Fused AdaFisher / AdaFisherW optimizer step (ADAFISHER_SPEC.md, "The step").
//
// One multi-tensor launch per (param dtype, momentum dtype) call: every tensor is
// cut into chunks of kStepChunkSize elements, one CUDA block per (tensor, chunk)
// work item.  The per-launch metadata (pointers, sizes, factor pointers, work list)
// is a struct passed by value as a kernel argument, so a launch needs no device
// memory of its own; several launches happen only when that struct is full.
//
// Per element e of a parameter viewed as a (len(S), ncols) row-major matrix:
//   F  = S[e / ncols] * H[col_offset + e % ncols] + Lambda     (F = 1 without factors)
//   g  = grad / grad_scale                                      (when grad_scale given)
//   AdaFisher  : g' = g + wd * p ;  m = beta*m + (1-beta)*g' ;  p -= (lr/bc) * m / F
//   AdaFisherW :                    m = beta*m + (1-beta)*g  ;  p -= lr * (m/bc/F + wd*p)
// with bc = 1 - beta^k, k = the parameter's own step count after the increment.
//
// Step counts are float32 scalars on the device.  The step kernel only READS them
// (k = step + 1, bc computed in double once per block); a second tiny kernel,
// ordered after every step launch on the same stream, increments them.  That keeps
// blocks of one tensor from racing on its counter.  When found_inf is given and
// nonzero, both kernels return at once: nothing at all changes.
//
// Arithmetic is fp32 (params/grads fp32, fp16 or bf16; momentum in the param dtype
// or fp32).  Division is IEEE (the extension must not be built with
// --use_fast_math).  F is built with explicitly rounded multiply and add so that it
// equals the unfused S[:, None] * H[None, :] + Lambda bit for bit.

#include "adafisher_step.h"

// c10's stream header rather than ATen/cuda/CUDAContext.h: the latter pulls in
// cuSPARSE/cuBLAS headers that a bare toolkit (only nvcc + cudart) may lack.
// at::cuda::getCurrentCUDAStream is this same c10 function.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <string>
#include <limits>

namespace lightning_cafin {
namespace {

// ---------------------------------------------------------------------------
// Metadata passed by value.
// ---------------------------------------------------------------------------

struct StepMeta {
  void* p[kStepMaxTensors];
  const void* g[kStepMaxTensors];
  void* m[kStepMaxTensors];
  const float* S[kStepMaxTensors];  // nullptr: no factors (F = 1)
  const float* H[kStepMaxTensors];  // already advanced by the parameter's col_offset
  const float* step[kStepMaxTensors];
  int64_t numel[kStepMaxTensors];
  int32_t ncols[kStepMaxTensors];
  int32_t block_chunk[kStepMaxBlocks];
  uint8_t block_tensor[kStepMaxBlocks];
};

struct StepScalars {
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

struct IncMeta {
  float* step[kIncMaxTensors];
  int n;
};

// The classic CUDA limit on kernel parameters is 4096 bytes; stay below it so that
// the launcher works on every toolkit and architecture.
static_assert(sizeof(StepMeta) + sizeof(StepScalars) + 2 * sizeof(void*) <= 4000,
              "step kernel arguments exceed the 4 KiB kernel-parameter budget");
static_assert(sizeof(IncMeta) + sizeof(void*) <= 4000,
              "counter kernel arguments exceed the 4 KiB kernel-parameter budget");
static_assert(kStepMaxTensors <= 256, "block_tensor is uint8_t");
static_assert(kStepChunkSize % (kStepBlockSize * 8) == 0,
              "chunk must be a whole number of block-wide vector iterations");

// ---------------------------------------------------------------------------
// Loads and stores.
// ---------------------------------------------------------------------------

// 16 bytes of T.
template <typename T>
struct alignas(16) Pack16 {
  T v[16 / sizeof(T)];
};

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);  // round to nearest even for Half / BFloat16
}

// N consecutive elements starting at src (16-byte aligned) into fp32 registers.
template <int N, typename T>
__device__ __forceinline__ void load_aligned(float (&dst)[N], const T* __restrict__ src) {
  constexpr int kPer = 16 / sizeof(T);
  static_assert(N % kPer == 0, "vector width must be a whole number of 16-byte packs");
#pragma unroll
  for (int q = 0; q < N / kPer; ++q) {
    const Pack16<T> pk = reinterpret_cast<const Pack16<T>*>(src)[q];
#pragma unroll
    for (int j = 0; j < kPer; ++j) dst[q * kPer + j] = to_float(pk.v[j]);
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_aligned(T* __restrict__ dst, const float (&src)[N]) {
  constexpr int kPer = 16 / sizeof(T);
  static_assert(N % kPer == 0, "vector width must be a whole number of 16-byte packs");
#pragma unroll
  for (int q = 0; q < N / kPer; ++q) {
    Pack16<T> pk;
#pragma unroll
    for (int j = 0; j < kPer; ++j) pk.v[j] = from_float<T>(src[q * kPer + j]);
    reinterpret_cast<Pack16<T>*>(dst)[q] = pk;
  }
}

template <int N, typename T>
__device__ __forceinline__ void load_partial(float (&dst)[N], const T* __restrict__ src, int valid) {
#pragma unroll
  for (int j = 0; j < N; ++j) dst[j] = (j < valid) ? to_float(src[j]) : 0.f;
}

template <int N, typename T>
__device__ __forceinline__ void store_partial(T* __restrict__ dst, const float (&src)[N], int valid) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (j < valid) dst[j] = from_float<T>(src[j]);
  }
}

__device__ __forceinline__ bool is_aligned16(const void* ptr) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0;
}

// ---------------------------------------------------------------------------
// The step kernel.
// ---------------------------------------------------------------------------

template <typename P, typename M>
__global__ void __launch_bounds__(kStepBlockSize)
adafisher_step_kernel(const StepMeta meta,
                      const StepScalars sc,
                      const float* __restrict__ grad_scale,
                      const float* __restrict__ found_inf) {
  // Elements per thread per iteration: one 16-byte pack of the parameter dtype.
  constexpr int kVec = 16 / sizeof(P);
  constexpr int kStride = kStepBlockSize * kVec;

  if (found_inf != nullptr && *found_inf != 0.f) return;  // uniform over the grid

  const int t = meta.block_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * kStepChunkSize;
  const int64_t left = meta.numel[t] - start;
  const int n = left < kStepChunkSize ? static_cast<int>(left) : kStepChunkSize;

  P* __restrict__ p = static_cast<P*>(meta.p[t]) + start;
  const P* __restrict__ g = static_cast<const P*>(meta.g[t]) + start;
  M* __restrict__ m = static_cast<M*>(meta.m[t]) + start;
  const float* __restrict__ S = meta.S[t];
  const float* __restrict__ H = meta.H[t];
  const bool has_f = S != nullptr;
  const bool aligned = is_aligned16(p) && is_aligned16(g) && is_aligned16(m);

  // Bias correction: once per block, in double, from the count before the increment.
  __shared__ float s_coef;
  if (threadIdx.x == 0) {
    const double k = static_cast<double>(*meta.step[t]) + 1.0;
    const double bc = 1.0 - pow(sc.beta, k);
    // AdaFisher: the step size lr / bc.  AdaFisherW: the factor 1 / bc applied to m.
    s_coef = sc.decoupled ? 1.0f / static_cast<float>(bc) : static_cast<float>(sc.lr / bc);
  }
  const bool has_gs = grad_scale != nullptr;
  const float gs = has_gs ? *grad_scale : 1.f;
  __syncthreads();
  const float coef = s_coef;

  // (row, col) of this thread's first element, advanced incrementally afterwards:
  // one 64-bit division per thread per block instead of one per element.
  // Unsigned 32-bit columns: col + dr < 2 * ncols < 2^32 never wraps.
  const int i0 = static_cast<int>(threadIdx.x) * kVec;
  uint32_t nc = 1, col = 0, dq = 0, dr = 0;
  int64_t row = 0;
  if (has_f) {
    nc = static_cast<uint32_t>(meta.ncols[t]);
    const int64_t e0 = start + i0;
    row = e0 / static_cast<int64_t>(nc);
    col = static_cast<uint32_t>(e0 - row * static_cast<int64_t>(nc));
    dq = static_cast<uint32_t>(kStride) / nc;
    dr = static_cast<uint32_t>(kStride) - dq * nc;
  }

  for (int i = i0; i < n; i += kStride) {
    const int valid = n - i;  // >= 1
    const bool full = aligned && valid >= kVec;
    float pv[kVec], gv[kVec], mv[kVec];
    if (full) {
      load_aligned(pv, p + i);
      load_aligned(gv, g + i);
      load_aligned(mv, m + i);
    } else {
      load_partial(pv, p + i, valid);
      load_partial(gv, g + i, valid);
      load_partial(mv, m + i, valid);
    }

    int64_t rj = row;
    uint32_t cj = col;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float F = 1.f;
      if (has_f && j < valid) {
        F = __fadd_rn(__fmul_rn(__ldg(S + rj), __ldg(H + cj)), sc.lambda_f);
        if (++cj == nc) {
          cj = 0;
          ++rj;
        }
      }
      float gj = gv[j];
      if (has_gs) gj = gj / gs;
      const float pj = pv[j];
      if (!sc.decoupled) {
        if (sc.has_wd) gj = fmaf(sc.wd_f, pj, gj);
        const float mj = fmaf(sc.one_minus_beta_f, gj, __fmul_rn(sc.beta_f, mv[j]));
        mv[j] = mj;
        pv[j] = fmaf(-coef, mj / F, pj);
      } else {
        const float mj = fmaf(sc.one_minus_beta_f, gj, __fmul_rn(sc.beta_f, mv[j]));
        mv[j] = mj;
        float u = __fmul_rn(mj, coef) / F;
        if (sc.has_wd) u = fmaf(sc.wd_f, pj, u);
        pv[j] = fmaf(-sc.lr_f, u, pj);
      }
    }

    if (full) {
      store_aligned(p + i, pv);
      store_aligned(m + i, mv);
    } else {
      store_partial(p + i, pv, valid);
      store_partial(m + i, mv, valid);
    }

    if (has_f) {
      row += dq;
      col += dr;
      if (col >= nc) {
        col -= nc;
        ++row;
      }
    }
  }
}

__global__ void increment_steps_kernel(const IncMeta meta, const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.f) return;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < meta.n) *meta.step[i] += 1.f;
}

// ---------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------

struct Item {
  void* p;
  const void* g;
  void* m;
  const float* S;
  const float* H;
  const float* step;
  int64_t numel;
  int32_t ncols;
};

template <typename P, typename M>
void launch_step_kernels(const std::vector<Item>& items,
                         const StepScalars& sc,
                         const float* grad_scale,
                         const float* found_inf,
                         cudaStream_t stream) {
  StepMeta meta;
  int nt = 0;  // tensor slot being filled
  int nb = 0;  // blocks recorded
  auto launch = [&]() {
    adafisher_step_kernel<P, M><<<nb, kStepBlockSize, 0, stream>>>(meta, sc, grad_scale, found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    nb = 0;
  };
  auto fill_slot = [&](int slot, const Item& it) {
    meta.p[slot] = it.p;
    meta.g[slot] = it.g;
    meta.m[slot] = it.m;
    meta.S[slot] = it.S;
    meta.H[slot] = it.H;
    meta.step[slot] = it.step;
    meta.numel[slot] = it.numel;
    meta.ncols[slot] = it.ncols;
  };

  for (const Item& it : items) {
    if (it.numel == 0) continue;
    fill_slot(nt, it);
    const int64_t nchunks = (it.numel + kStepChunkSize - 1) / kStepChunkSize;
    for (int64_t c = 0; c < nchunks; ++c) {
      meta.block_tensor[nb] = static_cast<uint8_t>(nt);
      meta.block_chunk[nb] = static_cast<int32_t>(c);
      ++nb;
      const bool last_chunk = c == nchunks - 1;
      const bool blocks_full = nb == kStepMaxBlocks;
      const bool tensors_full = last_chunk && nt + 1 == kStepMaxTensors;
      if (blocks_full || tensors_full) {
        launch();
        if (last_chunk) {
          nt = -1;  // the next tensor starts at slot 0
        } else {
          fill_slot(0, it);  // the rest of this tensor continues in slot 0
          nt = 0;
        }
      }
    }
    ++nt;
  }
  if (nb > 0) launch();
}

void launch_increment_kernels(const std::vector<at::Tensor>& steps,
                              const float* found_inf,
                              cudaStream_t stream) {
  IncMeta meta;
  meta.n = 0;
  auto launch = [&]() {
    const int threads = 256;
    const int blocks = (meta.n + threads - 1) / threads;
    increment_steps_kernel<<<blocks, threads, 0, stream>>>(meta, found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    meta.n = 0;
  };
  for (const at::Tensor& s : steps) {
    meta.step[meta.n++] = s.data_ptr<float>();
    if (meta.n == kIncMaxTensors) launch();
  }
  if (meta.n > 0) launch();
}

// Shapes and strides are formatted here rather than streamed as IntArrayRef: on one
// toolchain (torch 2.11 built with another compiler than the extension) streaming an
// ArrayRef into a TORCH_CHECK message crashed the process instead of raising.
std::string dims_str(at::IntArrayRef dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(dims[i]);
  }
  return out + ")";
}

const char* kOp = "adafisher_step_: ";

void check_same_list_size(size_t n, size_t got, const char* name) {
  TORCH_CHECK(got == n, kOp, name, " has ", got, " entries but params has ", n);
}

void check_dense(const at::Tensor& t, const char* name, size_t i, const c10::Device& device) {
  TORCH_CHECK(t.defined(), kOp, name, "[", i, "] is undefined (None)");
  TORCH_CHECK(t.is_cuda(), kOp, name, "[", i, "] must be a CUDA tensor, got a tensor on ",
              t.device());
  TORCH_CHECK(t.device() == device, kOp, name, "[", i, "] is on ", t.device(),
              " but params[0] is on ", device, "; call the op once per device");
}

void check_scalar_f32(const at::Tensor& t, const char* name, const c10::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, kOp, name, " must be on ", device,
              ", got a tensor on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, kOp, name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == 1, kOp, name, " must have exactly one element, got ", t.numel());
}

bool supported_param_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

}  // namespace

void adafisher_step_(const std::vector<at::Tensor>& params,
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
                     const std::optional<at::Tensor>& found_inf) {
  const size_t n = params.size();
  check_same_list_size(n, grads.size(), "grads");
  check_same_list_size(n, exp_avgs.size(), "exp_avgs");
  check_same_list_size(n, steps.size(), "steps");
  check_same_list_size(n, S_list.size(), "S_list");
  check_same_list_size(n, H_list.size(), "H_list");
  check_same_list_size(n, col_offsets.size(), "col_offsets");
  check_same_list_size(n, ncols.size(), "ncols");
  TORCH_CHECK(beta >= 0.0 && beta < 1.0, kOp, "beta must lie in [0, 1), got ", beta);
  if (n == 0) return;

  TORCH_CHECK(params[0].defined(), kOp, "params[0] is undefined (None)");
  TORCH_CHECK(params[0].is_cuda(), kOp, "params[0] must be a CUDA tensor, got a tensor on ",
              params[0].device());
  const c10::Device device = params[0].device();
  const at::ScalarType pdtype = params[0].scalar_type();
  TORCH_CHECK(supported_param_dtype(pdtype), kOp,
              "params must be float32, float16 or bfloat16, got params[0] of dtype ", pdtype);
  TORCH_CHECK(exp_avgs[0].defined(), kOp, "exp_avgs[0] is undefined (None)");
  const at::ScalarType mdtype = exp_avgs[0].scalar_type();
  TORCH_CHECK(mdtype == pdtype || mdtype == at::kFloat, kOp,
              "exp_avgs must have the params' dtype (", pdtype, ") or float32, got ", mdtype);

  std::vector<Item> items;
  items.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const at::Tensor& m = exp_avgs[i];
    const at::Tensor& s = steps[i];
    check_dense(p, "params", i, device);
    check_dense(g, "grads", i, device);
    check_dense(m, "exp_avgs", i, device);
    check_dense(s, "steps", i, device);
    TORCH_CHECK(p.scalar_type() == pdtype, kOp, "params[", i, "] has dtype ", p.scalar_type(),
                " but params[0] has ", pdtype, "; group tensors by dtype");
    TORCH_CHECK(g.scalar_type() == pdtype, kOp, "grads[", i, "] has dtype ", g.scalar_type(),
                " but params[", i, "] has ", pdtype);
    TORCH_CHECK(m.scalar_type() == mdtype, kOp, "exp_avgs[", i, "] has dtype ",
                m.scalar_type(), " but exp_avgs[0] has ", mdtype,
                "; group tensors by momentum dtype");
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() == 1, kOp, "steps[", i,
                "] must be a float32 tensor with one element, got dtype ", s.scalar_type(),
                " and ", s.numel(), " elements");
    TORCH_CHECK(p.is_contiguous(), kOp, "params[", i, "] must be contiguous (strides ",
                dims_str(p.strides()), ")");
    TORCH_CHECK(g.is_contiguous(), kOp, "grads[", i, "] must be contiguous (strides ",
                dims_str(g.strides()), ")");
    TORCH_CHECK(m.is_contiguous(), kOp, "exp_avgs[", i, "] must be contiguous (strides ",
                dims_str(m.strides()), ")");
    TORCH_CHECK(g.sizes() == p.sizes(), kOp, "grads[", i, "] has shape ", dims_str(g.sizes()),
                " but params[", i, "] has shape ", dims_str(p.sizes()));
    TORCH_CHECK(m.sizes() == p.sizes(), kOp, "exp_avgs[", i, "] has shape ", dims_str(m.sizes()),
                " but params[", i, "] has shape ", dims_str(p.sizes()));

    Item it;
    it.p = p.data_ptr();
    it.g = g.data_ptr();
    it.m = m.data_ptr();
    it.step = s.data_ptr<float>();
    it.numel = p.numel();
    it.S = nullptr;
    it.H = nullptr;
    it.ncols = 1;

    const bool has_S = S_list[i].has_value() && S_list[i]->defined();
    const bool has_H = H_list[i].has_value() && H_list[i]->defined();
    TORCH_CHECK(has_S == has_H, kOp, "S_list[", i, "] and H_list[", i,
                "] must both be tensors or both be None");
    if (has_S) {
      const at::Tensor& S = *S_list[i];
      const at::Tensor& H = *H_list[i];
      check_dense(S, "S_list", i, device);
      check_dense(H, "H_list", i, device);
      TORCH_CHECK(S.scalar_type() == at::kFloat, kOp, "S_list[", i, "] must be float32, got ",
                  S.scalar_type());
      TORCH_CHECK(H.scalar_type() == at::kFloat, kOp, "H_list[", i, "] must be float32, got ",
                  H.scalar_type());
      TORCH_CHECK(S.dim() == 1 && S.is_contiguous(), kOp, "S_list[", i,
                  "] must be a contiguous 1-D tensor, got shape ", dims_str(S.sizes()), " strides ",
                  dims_str(S.strides()));
      TORCH_CHECK(H.dim() == 1 && H.is_contiguous(), kOp, "H_list[", i,
                  "] must be a contiguous 1-D tensor, got shape ", dims_str(H.sizes()), " strides ",
                  dims_str(H.strides()));
      const int64_t nc = ncols[i];
      const int64_t off = col_offsets[i];
      TORCH_CHECK(nc >= 1 && nc <= std::numeric_limits<int32_t>::max(), kOp, "ncols[", i,
                  "] must lie in [1, 2^31), got ", nc);
      TORCH_CHECK(p.numel() == S.numel() * nc, kOp, "params[", i, "] has ", p.numel(),
                  " elements but len(S_list[", i, "]) * ncols[", i, "] = ", S.numel(), " * ", nc);
      TORCH_CHECK(off >= 0 && off + nc <= H.numel(), kOp, "col_offsets[", i, "] + ncols[", i,
                  "] = ", off, " + ", nc, " exceeds len(H_list[", i, "]) = ", H.numel());
      if (p.numel() > 0) {
        it.S = S.data_ptr<float>();
        it.H = H.data_ptr<float>() + off;
        it.ncols = static_cast<int32_t>(nc);
      }
    }
    TORCH_CHECK((it.numel + kStepChunkSize - 1) / kStepChunkSize <=
                    std::numeric_limits<int32_t>::max(),
                kOp, "params[", i, "] is too large (", it.numel, " elements)");
    items.push_back(it);
  }

  const float* gs_ptr = nullptr;
  const float* fi_ptr = nullptr;
  if (grad_scale.has_value() && grad_scale->defined()) {
    check_scalar_f32(*grad_scale, "grad_scale", device);
    gs_ptr = grad_scale->data_ptr<float>();
  }
  if (found_inf.has_value() && found_inf->defined()) {
    check_scalar_f32(*found_inf, "found_inf", device);
    fi_ptr = found_inf->data_ptr<float>();
  }

  StepScalars sc;
  sc.lr = lr;
  sc.beta = beta;
  sc.lr_f = static_cast<float>(lr);
  sc.beta_f = static_cast<float>(beta);
  sc.one_minus_beta_f = static_cast<float>(1.0 - beta);
  sc.lambda_f = static_cast<float>(Lambda);
  sc.wd_f = static_cast<float>(weight_decay);
  sc.decoupled = decoupled ? 1 : 0;
  sc.has_wd = weight_decay != 0.0 ? 1 : 0;

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  if (pdtype == at::kFloat) {
    launch_step_kernels<float, float>(items, sc, gs_ptr, fi_ptr, stream);
  } else if (pdtype == at::kHalf) {
    if (mdtype == at::kFloat) {
      launch_step_kernels<at::Half, float>(items, sc, gs_ptr, fi_ptr, stream);
    } else {
      launch_step_kernels<at::Half, at::Half>(items, sc, gs_ptr, fi_ptr, stream);
    }
  } else {
    if (mdtype == at::kFloat) {
      launch_step_kernels<at::BFloat16, float>(items, sc, gs_ptr, fi_ptr, stream);
    } else {
      launch_step_kernels<at::BFloat16, at::BFloat16>(items, sc, gs_ptr, fi_ptr, stream);
    }
  }
  // Ordered after every step launch on the same stream: no block reads a counter
  // that is being incremented.
  launch_increment_kernels(steps, fi_ptr, stream);
}

}  // namespace lightning_cafin
