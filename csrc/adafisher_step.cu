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
#include "step_launch.h"
#include "vector_io.cuh"

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

using namespace vector_io;

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


struct IncMeta {
  float* step[kIncMaxTensors];
  int n;
};

// Since CUDA 12.1 a kernel may take 32764 bytes of parameters on Volta and later (the
// classic limit was 4096); the torch builds this extension targets are CUDA 12.6+.
#if !defined(CUDART_VERSION) || CUDART_VERSION < 12010
#error "the fused step passes up to 32 KiB of kernel parameters: it needs CUDA 12.1 or newer"
#endif
static_assert(sizeof(StepMeta) + sizeof(StepScalars) + 2 * sizeof(void*) <= 32000,
              "step kernel arguments exceed the 32 KiB kernel-parameter budget");
static_assert(sizeof(IncMeta) + sizeof(void*) <= 4000,
              "counter kernel arguments exceed the 4 KiB kernel-parameter budget");
static_assert(kStepMaxTensors <= 256, "block_tensor is uint8_t");
static_assert(kStepChunkSize % (kStepBlockSize * 8) == 0,
              "chunk must be a whole number of block-wide vector iterations");

// ---------------------------------------------------------------------------
// Loads and stores.
// ---------------------------------------------------------------------------

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
    const double lr = sc.lr_ptr != nullptr ? static_cast<double>(*sc.lr_ptr) : sc.lr;
    s_coef = sc.decoupled ? 1.0f / static_cast<float>(bc) : static_cast<float>(lr / bc);
  }
  const float lr_f = sc.lr_ptr != nullptr ? *sc.lr_ptr : sc.lr_f;
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
        pv[j] = fmaf(-lr_f, u, pj);
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


template <typename P, typename M>
void launch_step_kernels(const StepItem* items, size_t n_items,
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
  auto fill_slot = [&](int slot, const StepItem& it) {
    meta.p[slot] = it.p;
    meta.g[slot] = it.g;
    meta.m[slot] = it.m;
    meta.S[slot] = it.S;
    meta.H[slot] = it.H;
    meta.step[slot] = it.step;
    meta.numel[slot] = it.numel;
    meta.ncols[slot] = it.ncols;
  };

  for (size_t k = 0; k < n_items; ++k) {
    const StepItem& it = items[k];
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

void launch_increment_kernels(float* const* steps, size_t n_steps,
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
  for (size_t k = 0; k < n_steps; ++k) {
    meta.step[meta.n++] = steps[k];
    if (meta.n == kIncMaxTensors) launch();
  }
  if (meta.n > 0) launch();
}

}  // namespace

void launch_adafisher_step(const StepItem* items, size_t n, at::ScalarType pdtype, at::ScalarType mdtype,
                           const StepScalars& sc, const float* grad_scale, const float* found_inf,
                           cudaStream_t stream) {
  if (pdtype == at::kFloat) {
    launch_step_kernels<float, float>(items, n, sc, grad_scale, found_inf, stream);
  } else if (pdtype == at::kHalf) {
    if (mdtype == at::kFloat) {
      launch_step_kernels<at::Half, float>(items, n, sc, grad_scale, found_inf, stream);
    } else {
      launch_step_kernels<at::Half, at::Half>(items, n, sc, grad_scale, found_inf, stream);
    }
  } else if (mdtype == at::kFloat) {
    launch_step_kernels<at::BFloat16, float>(items, n, sc, grad_scale, found_inf, stream);
  } else {
    launch_step_kernels<at::BFloat16, at::BFloat16>(items, n, sc, grad_scale, found_inf, stream);
  }
}

void launch_step_increments(float* const* steps, size_t n, const float* found_inf, cudaStream_t stream) {
  launch_increment_kernels(steps, n, found_inf, stream);
}

}  // namespace lightning_cafin
