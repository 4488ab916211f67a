// Fused AdaFisher / AdaFisherW optimizer step (docs/ADAFISHER_SPEC.md, "The step").
//
// One multi-tensor launch per (param dtype, momentum dtype) call, for up to
// kStepMaxTensors tensors: every tensor is cut into chunks of kStepChunkSize elements,
// one CUDA block per (tensor, chunk).  The by-value metadata and the block's (tensor,
// chunk) lookup are multi_tensor_launch.cuh's;
// this file holds the update math (one __device__ function per optimizer), the vector
// loop that applies it, and the launchers, which return errors and throw nothing.
//
// Per element e of a parameter viewed as a (len(S), ncols) row-major matrix:
//   F  = S[e / ncols] * H[col_offset + e % ncols] + Lambda     (F = 1 without factors)
// (a parameter stored channels innermost, inner = C > 1, reads H at the logical column of
// its memory column: c * (ncols / C) + k for memory column k * C + c)
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
#include "dtype_dispatch.cuh"
#include "multi_tensor_launch.cuh"
#include "step_launch.h"
#include "vector_io.cuh"

#include <cstdint>
#include <type_traits>

namespace lightning_cafin {
namespace {

using namespace vector_io;

// The step kernel's by-value list: kStepMaxTensors parameters of any size per launch.
// The step counters' list: one thread per counter.
using StepList = LaunchList<StepItem, kStepMaxTensors, /*kRanged=*/true>;
using CounterList = LaunchList<float*, kIncMaxTensors>;
constexpr int kIncBlockSize = 256;

// Since CUDA 12.1 a kernel may take 32764 bytes of parameters on Volta and later (the
// classic limit was 4096); the torch builds this extension targets are CUDA 12.6+.
#if !defined(CUDART_VERSION) || CUDART_VERSION < 12010
#error "the fused step passes up to 32 KiB of kernel parameters: it needs CUDA 12.1 or newer"
#endif
static_assert(sizeof(StepList) + sizeof(StepScalars) + 2 * sizeof(void*) <= kParamBytesLarge,
              "step kernel arguments exceed the 32 KiB kernel-parameter budget");
static_assert(sizeof(CounterList) + sizeof(void*) <= kParamBytesClassic,
              "counter kernel arguments exceed the 4 KiB kernel-parameter budget");
static_assert(kStepChunkSize % (kStepBlockSize * 8) == 0,
              "chunk must be a whole number of block-wide vector iterations");

// ---------------------------------------------------------------------------
// The update math, per element, in fp32.  Every rounding is explicit (fmaf, __fmul_rn,
// IEEE division): the fused step rounds like the unfused reference.
// ---------------------------------------------------------------------------

// F = S[row] * H[col] + Lambda, each operation rounded on its own, as the unfused
// S[:, None] * H[None, :] + Lambda rounds.
__device__ __forceinline__ float fisher_diagonal(const float* __restrict__ S, const float* __restrict__ H,
                                                 int64_t row, uint32_t col, float lambda) {
  return __fadd_rn(__fmul_rn(__ldg(S + row), __ldg(H + col)), lambda);
}

// The block's coefficient from the parameter's step count before this step:
// AdaFisher the step size lr / bc, AdaFisherW the momentum factor 1 / bc, with
// bc = 1 - beta^k, k = count + 1, computed in double.
__device__ __forceinline__ float bias_coefficient(const StepScalars& sc, float count) {
  const double k = static_cast<double>(count) + 1.0;
  const double bc = 1.0 - pow(sc.beta, k);
  const double lr = sc.lr_ptr != nullptr ? static_cast<double>(*sc.lr_ptr) : sc.lr;
  return sc.decoupled ? 1.0f / static_cast<float>(bc) : static_cast<float>(lr / bc);
}

// AdaFisher (L2 decay): g' = g + wd * p;  m = beta*m + (1-beta)*g';  p -= (lr/bc) * m / F.
__device__ __forceinline__ void adafisher_update(float& p, float& m, float g, float F, float step_size,
                                                 const StepScalars& sc) {
  const float p0 = p;
  if (sc.has_wd) g = fmaf(sc.wd_f, p0, g);
  const float m1 = fmaf(sc.one_minus_beta_f, g, __fmul_rn(sc.beta_f, m));
  m = m1;
  p = fmaf(-step_size, m1 / F, p0);
}

// AdaFisherW (decoupled decay): m = beta*m + (1-beta)*g;  p -= lr * (m/bc/F + wd*p).
__device__ __forceinline__ void adafisherw_update(float& p, float& m, float g, float F, float inv_bc, float lr,
                                                  const StepScalars& sc) {
  const float p0 = p;
  const float m1 = fmaf(sc.one_minus_beta_f, g, __fmul_rn(sc.beta_f, m));
  m = m1;
  float u = __fmul_rn(m1, inv_bc) / F;
  if (sc.has_wd) u = fmaf(sc.wd_f, p0, u);
  p = fmaf(-lr, u, p0);
}

// ---------------------------------------------------------------------------
// The kernels.
// ---------------------------------------------------------------------------

template <typename P, typename M>
__global__ void __launch_bounds__(kStepBlockSize)
adafisher_step_kernel(const StepList list,
                      const StepScalars sc,
                      const float* __restrict__ grad_scale,
                      const float* __restrict__ found_inf) {
  // Elements per thread per iteration: one 16-byte pack of the parameter dtype.
  constexpr int kVec = 16 / sizeof(P);
  constexpr int kStride = kStepBlockSize * kVec;

  if (found_inf != nullptr && *found_inf != 0.f) return;  // uniform over the grid

  const UnitOf at = unit_of_block(list, static_cast<int32_t>(blockIdx.x));
  const StepItem& item = list.item[at.slot];
  const int64_t start = static_cast<int64_t>(at.unit) * kStepChunkSize;
  const int64_t left = item.numel - start;
  const int n = left < kStepChunkSize ? static_cast<int>(left) : kStepChunkSize;

  P* __restrict__ p = static_cast<P*>(item.p) + start;
  const P* __restrict__ g = static_cast<const P*>(item.g) + start;
  M* __restrict__ m = static_cast<M*>(item.m) + start;
  const float* __restrict__ S = item.S;
  const float* __restrict__ H = item.H;
  const bool has_f = S != nullptr;
  const bool aligned = is_aligned16(p) && is_aligned16(g) && is_aligned16(m);

  // A pack's loads, as stored (widened to fp32 when it is updated): 16-byte loads, or
  // element by element at the tail of a chunk and for tensors not 16-byte aligned.
  using PackP = RawPack<kVec, P>;
  using PackM = RawPack<kVec, M>;
  auto load = [&](int i, PackP& pr, PackP& gr, PackM& mr) {
    const int valid = n - i;
    const bool full = aligned && valid >= kVec;
    load_raw(pr, p + i, full, valid);
    load_raw(gr, g + i, full, valid);
    load_raw(mr, m + i, full, valid);
  };

  // fp32 parameters and momentum: the first pack's loads go out before the block waits for
  // its coefficient, and each later pack's before the one in hand is updated, so a thread
  // keeps two packs of loads in flight where it kept one, and a block's start (the
  // coefficient's read and pow) no longer leaves the memory idle.  (For 2-byte types the
  // pack ahead took the kernel from 52 to about 120 registers, one block of 512 per SM: they
  // load each pack when its turn comes.)
  constexpr bool kAhead = sizeof(P) == 4 && sizeof(M) == 4;
  const int i0 = static_cast<int>(threadIdx.x) * kVec;
  PackP pr, gr;
  PackM mr;
  if (kAhead && i0 < n) load(i0, pr, gr, mr);

  // Bias correction: once per block.
  __shared__ float s_coef;
  if (threadIdx.x == 0) s_coef = bias_coefficient(sc, *item.step);
  const float lr_f = sc.lr_ptr != nullptr ? *sc.lr_ptr : sc.lr_f;
  const bool has_gs = grad_scale != nullptr;
  const float gs = has_gs ? *grad_scale : 1.f;
  __syncthreads();
  const float coef = s_coef;

  // (row, col) of this thread's first element, advanced incrementally afterwards:
  // one 64-bit division per thread per block instead of one per element.
  // Unsigned 32-bit columns: col + dr < 2 * ncols < 2^32 never wraps.
  uint32_t nc = 1, col = 0, dq = 0, dr = 0;
  int64_t row = 0;
  if (has_f) {
    nc = static_cast<uint32_t>(item.ncols);
    const int64_t e0 = start + i0;
    row = e0 / static_cast<int64_t>(nc);
    col = static_cast<uint32_t>(e0 - row * static_cast<int64_t>(nc));
    dq = static_cast<uint32_t>(kStride) / nc;
    dr = static_cast<uint32_t>(kStride) - dq * nc;
  }
  // Channels innermost (item.inner = C > 1, a channels_last conv weight): memory column
  // k * C + c reads H at c * kk + k, kk = ncols / C.
  const uint32_t inner = has_f ? static_cast<uint32_t>(item.inner) : 1u;
  const uint32_t kk = nc / inner;
  // Rows of a whole number of packs and H 16-byte aligned: every pack's columns are
  // [col, col + kVec) of one row, col a multiple of kVec (the chunk and the thread's first
  // element are multiples of kVec, and so is kStride), so H is read a pack at a time.
  const bool h_packs = has_f && inner == 1 && nc % kVec == 0 && is_aligned16(H);

  for (int i = i0; i < n; i += kStride) {
    const int valid = n - i;  // >= 1
    PackP pn, gn;  // (kAhead) the next pack's, in flight while this one is updated
    PackM mn;
    if constexpr (kAhead) {
      if (i + kStride < n) load(i + kStride, pn, gn, mn);
    } else {
      load(i, pr, gr, mr);
    }
    float pv[kVec], gv[kVec], mv[kVec];
    widen(pv, pr);
    widen(gv, gr);
    widen(mv, mr);

    // The pack's F: where its columns lie in one row and H is read in 16-byte loads
    // (h_packs), one read of S and kVec / 4 of H; else element by element.  The same values
    // and roundings either way.
    float F[kVec];
    if (h_packs && valid >= kVec) {
      const float s = __ldg(S + row);
      float hv[kVec];
      load_aligned(hv, H + col);
#pragma unroll
      for (int j = 0; j < kVec; ++j) F[j] = __fadd_rn(__fmul_rn(s, hv[j]), sc.lambda_f);
    } else if (inner > 1) {  // (one division per pack: the pack's first (k, c))
      int64_t rj = row;
      uint32_t k = col / inner;
      uint32_t c = col - k * inner;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        F[j] = 1.f;
        if (j < valid) {
          F[j] = fisher_diagonal(S, H, rj, c * kk + k, sc.lambda_f);
          if (++c == inner) {
            c = 0;
            if (++k == kk) {
              k = 0;
              ++rj;
            }
          }
        }
      }
    } else {
      int64_t rj = row;
      uint32_t cj = col;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        F[j] = 1.f;
        if (has_f && j < valid) {
          F[j] = fisher_diagonal(S, H, rj, cj, sc.lambda_f);
          if (++cj == nc) {
            cj = 0;
            ++rj;
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float gj = gv[j];
      if (has_gs) gj = gj / gs;
      if (!sc.decoupled) {
        adafisher_update(pv[j], mv[j], gj, F[j], coef, sc);
      } else {
        adafisherw_update(pv[j], mv[j], gj, F[j], coef, lr_f, sc);
      }
    }

    if (aligned && valid >= kVec) {
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
    if constexpr (kAhead) {
      pr = pn;
      gr = gn;
      mr = mn;
    }
  }
}

__global__ void increment_steps_kernel(const CounterList list, const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.f) return;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < list.count) *list.item[i] += 1.f;
}

// ---------------------------------------------------------------------------
// Launchers.
// ---------------------------------------------------------------------------

int64_t step_chunks(const StepItem& it) { return (it.numel + kStepChunkSize - 1) / kStepChunkSize; }

template <typename P, typename M>
cudaError_t launch_step_kernels(const StepItem* items, size_t n, const StepScalars& sc, const float* grad_scale,
                                const float* found_inf, cudaStream_t stream) {
  return launch_items<StepList>(items, n, step_chunks, [&](const StepList& list, int blocks) {
    adafisher_step_kernel<P, M><<<blocks, kStepBlockSize, 0, stream>>>(list, sc, grad_scale, found_inf);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t launch_adafisher_step(const StepItem* items, size_t n, at::ScalarType pdtype, at::ScalarType mdtype,
                                  const StepScalars& sc, const float* grad_scale, const float* found_inf,
                                  cudaStream_t stream) {
  return dispatch_float_dtype(pdtype, [&](auto* tag) -> cudaError_t {
    using P = std::remove_pointer_t<decltype(tag)>;
    if (mdtype == at::kFloat) return launch_step_kernels<P, float>(items, n, sc, grad_scale, found_inf, stream);
    if (mdtype != pdtype) return cudaErrorInvalidValue;
    return launch_step_kernels<P, P>(items, n, sc, grad_scale, found_inf, stream);
  });
}

cudaError_t launch_step_increments(float* const* steps, size_t n, const float* found_inf, cudaStream_t stream) {
  return launch_items<CounterList>(steps, n, OneUnitEach{}, [&](const CounterList& list, int count) {
    const int blocks = (count + kIncBlockSize - 1) / kIncBlockSize;
    increment_steps_kernel<<<blocks, kIncBlockSize, 0, stream>>>(list, found_inf);
    return cudaGetLastError();
  });
}

}  // namespace lightning_cafin
