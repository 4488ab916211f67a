// Vector loads and stores shared by the step and capture kernels: 16-byte packs of T read
// into fp32 registers and written back with round-to-nearest-even, plus the element-wise
// fallbacks for unaligned or tail data. Header-only device templates (one definition for
// both .cu files, which had their own copies).
#pragma once

#include <cstdint>

namespace lightning_cafin {
namespace vector_io {

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

// N elements of T as stored (not widened to fp32): a pack loaded ahead of its use holds
// 16 bytes in 4 registers whatever T, where N floats would take N.
template <int N, typename T>
struct RawPack {
  T v[N];
};

// N consecutive elements at src (16-byte aligned) as stored, in 16-byte loads.
template <int N, typename T>
__device__ __forceinline__ void load_packs(RawPack<N, T>& dst, const T* __restrict__ src) {
  constexpr int kPer = 16 / sizeof(T);
  static_assert(N % kPer == 0, "vector width must be a whole number of 16-byte packs");
#pragma unroll
  for (int q = 0; q < N / kPer; ++q) {
    const Pack16<T> pk = reinterpret_cast<const Pack16<T>*>(src)[q];
#pragma unroll
    for (int j = 0; j < kPer; ++j) dst.v[q * kPer + j] = pk.v[j];
  }
}

template <int N, typename T>
__device__ __forceinline__ void widen(float (&dst)[N], const RawPack<N, T>& src) {
#pragma unroll
  for (int j = 0; j < N; ++j) dst[j] = to_float(src.v[j]);
}

// N consecutive elements starting at src (16-byte aligned) into fp32 registers.
template <int N, typename T>
__device__ __forceinline__ void load_aligned(float (&dst)[N], const T* __restrict__ src) {
  RawPack<N, T> raw;
  load_packs(raw, src);
  widen(dst, raw);
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
__device__ __forceinline__ void store_partial(T* __restrict__ dst, const float (&src)[N], int valid) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (j < valid) dst[j] = from_float<T>(src[j]);
  }
}

// N consecutive elements at src as stored: 16-byte loads where `full` (src 16-byte aligned
// and N valid), else the `valid` first ones element by element and zeros after them.
template <int N, typename T>
__device__ __forceinline__ void load_raw(RawPack<N, T>& dst, const T* __restrict__ src, bool full, int valid) {
  if (full) {
    load_packs(dst, src);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) dst.v[j] = (j < valid) ? src[j] : from_float<T>(0.f);
  }
}

// 16 read-only bytes at p (16-byte aligned) that a single pass streams: not kept in L1
// (nothing reads them again), with a hint that the L2 fetch the 256 bytes around them from
// DRAM in one go (the next lanes' and rows' loads then find them there).  The rows kernel
// reads so: on one H100, against __ldg, the package's kernels per capture step went from
// 2612 to 2469 us on ResNet-50 and from 2597 to 2442 us on the GPT
// (docs/results/ab-streaming-loads-h100-ce4cff8.txt).
// (The hint needs sm_80; older targets load as __ldg does.)
__device__ __forceinline__ uint4 load_streaming16(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
#else
  return __ldg(static_cast<const uint4*>(p));
#endif
}

__host__ __device__ __forceinline__ bool is_aligned16(const void* ptr) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0;
}

}  // namespace vector_io
}  // namespace lightning_cafin
