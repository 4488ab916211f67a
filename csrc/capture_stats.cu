// Factor-capture kernels (docs/ADAFISHER_SPEC.md, "Supported modules" and "Normalisation").
//
// * conv input statistics without patches: x^2 summed over the batch into a small fp32
//   map, then every kernel tap's window sum of that map (groups pooled, zeros padding);
// * per-channel sums / sums of squares of an activation or output gradient in one pass;
// * the capture step's finalise + inf mapping + min-max normalisation + NaN guard +
//   fold, for every captured layer in one launch.
//
// All accumulation is fp32 whatever the input dtype (fp32, fp16, bf16); partial sums are
// combined in a fixed order, so every result is deterministic.  Launchers return the
// launch's cudaError_t and never throw (see capture_launch.h).  The fold uses explicitly
// rounded multiplies and adds (no contraction), so it equals the unfused torch ops.

#include "capture_launch.h"
#include "dtype_dispatch.cuh"
#include "multi_tensor_launch.cuh"
#include "vector_io.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

namespace lightning_cafin {
namespace {

using namespace vector_io;

// The 16 bytes of a pack of T, loaded as one uint4, into fp32.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& w, float (&dst)[16 / sizeof(T)]) {
  Pack16<T> pk;
  static_assert(sizeof(pk) == sizeof(w), "a pack is 16 bytes");
  memcpy(&pk, &w, sizeof(w));
#pragma unroll
  for (int j = 0; j < 16 / static_cast<int>(sizeof(T)); ++j) dst[j] = to_float(pk.v[j]);
}

// V consecutive elements at p (16-byte aligned when V > 1: one 16-byte pack) into fp32,
// the pack streamed (load_streaming16: every caller reads its tensor once).
template <int V, typename T>
__device__ __forceinline__ void load_vec(float (&dst)[V], const T* __restrict__ p) {
  if constexpr (V == 1) {
    dst[0] = to_float(p[0]);
  } else {
    static_assert(V == 16 / sizeof(T), "V must be one element or one 16-byte pack");
    unpack16<T>(load_streaming16(p), dst);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Part k of [0, n) cut into `parts` ranges of ceil(n / parts) elements (the last ones
// may be short or empty): how every kernel below splits its reduction across blocks.
struct Range {
  int64_t lo, hi;
};

__device__ __forceinline__ Range split_range(int64_t n, int parts, int k) {
  const int64_t per = (n + parts - 1) / parts;
  const int64_t lo = static_cast<int64_t>(k) * per;
  return {lo < n ? lo : n, lo + per < n ? lo + per : n};
}

// Part k of [0, n) cut into `parts` ranges whose sizes differ by one at most (32-bit:
// phase 2's ranges of the batch-split maps, at most 64 of them).
__device__ __forceinline__ void even_range(int n, int parts, int k, int& lo, int& hi) {
  lo = n * k / parts;
  hi = n * (k + 1) / parts;
}

// v[u] = sum_{k < nmaps} maps[off[u] + k * M] for P positions at once (phase 2's read of
// the batch-split partial maps), each added in order k = 0, 1, ..., every position's loads
// of four maps in flight together: one load at a time, a chunk's positions were a chain of
// dependent L2 round trips, most of a small layer's phase 2, and position by position
// phase 2 of a channels_last layer took longer than reading the activation.  off[u] must
// be a position of the map (a thread's positions past its chunk pass one inside it and drop
// the sum).
template <int P>
__device__ __forceinline__ void sum_maps_at(const float* __restrict__ maps, const int64_t (&off)[P], int nmaps,
                                            int64_t M, float (&v)[P]) {
#pragma unroll
  for (int u = 0; u < P; ++u) v[u] = 0.f;
  int k = 0;
  for (; k + 4 <= nmaps; k += 4) {
    float l[4][P];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int u = 0; u < P; ++u) l[j][u] = maps[off[u] + (k + j) * M];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int u = 0; u < P; ++u) v[u] += l[j][u];
    }
  }
  for (; k < nmaps; ++k) {
    float l[P];
#pragma unroll
    for (int u = 0; u < P; ++u) l[u] = maps[off[u] + k * M];
#pragma unroll
    for (int u = 0; u < P; ++u) v[u] += l[u];
  }
}

// The one-position case: sum_{k < nmaps} m[k * M], in the same order.
__device__ __forceinline__ float sum_maps(const float* __restrict__ m, int nmaps, int64_t M) {
  const int64_t off[1] = {0};
  float v[1];
  sum_maps_at<1>(m, off, nmaps, M, v);
  return v[0];
}

// Positions a thread of the channel-side-by-side kernels sums at once (sum_maps_at).
constexpr int kPositionsInFlight = 4;

// The last-block reduction: every block along y has stored its partial for column
// blockIdx.x; true (in every thread) in the one block that finished that column last,
// which then sums the partials in a fixed order.  The counter is reset by that block, so
// the slots stay zero between launches on one stream (see capture_launch.h).
// One thread per block counts, after the barrier, with a device-scope acquire-release add:
// its release half publishes every store the barrier ordered before it (the block's
// partials, whichever thread wrote them: a release is cumulative), its acquire half gives
// the last block the others' published partials (the barrier after it passes them on to
// the block's threads).  This is cooperative groups' grid barrier's pattern; every thread
// fencing (fence.sc.gpu) before the barrier did the same with 16 fences a block.
__device__ bool finished_last(unsigned* counter, unsigned parts) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned before;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
#else
    __threadfence();
    before = atomicAdd(counter, 1u);
    __threadfence();
#endif
    last = before + 1u == parts;
    if (last) *counter = 0u;
  }
  __syncthreads();
  return last;
}

// sum_{k < n} p[k * stride], added in order k = 0, 1, ... (read through L2: other blocks
// wrote them during this launch), kChainLoads loads in flight: one at a time, a last
// block's sum over its chunks' partials was a chain of dependent L2 round trips.
constexpr int kChainLoads = 8;
__device__ __forceinline__ float sum_partials(const float* partials, int n, int64_t stride) {
  float acc = 0.f;
  int k = 0;
  for (; k + kChainLoads <= n; k += kChainLoads) {
    float u[kChainLoads];
#pragma unroll
    for (int j = 0; j < kChainLoads; ++j) u[j] = __ldcg(partials + static_cast<int64_t>(k + j) * stride);
#pragma unroll
    for (int j = 0; j < kChainLoads; ++j) acc += u[j];
  }
  for (; k < n; ++k) acc += __ldcg(partials + static_cast<int64_t>(k) * stride);
  return acc;
}

// Sum over the block (kCaptureBlock threads); the result is valid in every thread.
__device__ float block_sum(float v, float* smem /* >= 32 floats */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float r = 0.f;
  if (warp == 0) {
    r = lane < (kCaptureBlock / 32) ? smem[lane] : 0.f;
    r = warp_sum(r);
    if (lane == 0) smem[0] = r;
  }
  __syncthreads();
  return smem[0];
}

// ---------------------------------------------------------------------------
// Phase 1 of the conv input statistics: dst[split * M + i] = sum_{b in split} x[b, i]^2.
// A block of kThreads threads takes V * kThreads consecutive i (block bx of the grid's
// row) for one split of the batch; its own kernel below, or a launch it shares with a
// gradient's read.
// ---------------------------------------------------------------------------
// The thread's V sums of phase 1 (zeros, and false, past M).
template <typename T, int V, int kThreads>
__device__ __forceinline__ bool batch_sumsq_values(const T* __restrict__ x, int64_t batch_stride, int64_t B, int64_t M,
                                                   int nsplit, int64_t bx, int split, float (&acc)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  const int64_t i = (bx * kThreads + threadIdx.x) * V;
  if (i >= M) return false;
  const Range rb = split_range(B, nsplit, split);
  const int64_t b0 = rb.lo, b1 = rb.hi;
  const T* p = x + b0 * batch_stride + i;
  int64_t b = b0;
  // kRowsInFlight rows' loads issued before any is summed: one 16-byte load per thread
  // at a time left a 2-blocks-per-SM grid reading at about 2.7 TB/s on the H200
  for (; b + kRowsInFlight <= b1; b += kRowsInFlight, p += kRowsInFlight * batch_stride) {
    float u[kRowsInFlight][V];
#pragma unroll
    for (int k = 0; k < kRowsInFlight; ++k) load_vec<V>(u[k], p + k * batch_stride);
#pragma unroll
    for (int k = 0; k < kRowsInFlight; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = fmaf(u[k][j], u[k][j], acc[j]);
    }
  }
  for (; b < b1; ++b, p += batch_stride) {
    float u[V];
    load_vec<V>(u, p);
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = fmaf(u[j], u[j], acc[j]);
  }
  return true;
}

template <typename T, int V, int kThreads>
__device__ __forceinline__ void batch_sumsq_block(const T* __restrict__ x, int64_t batch_stride, int64_t B, int64_t M,
                                                  int nsplit, float* __restrict__ dst, int64_t bx, int split) {
  float acc[V];
  if (!batch_sumsq_values<T, V, kThreads>(x, batch_stride, B, M, nsplit, bx, split, acc)) return;
  float* out = dst + static_cast<int64_t>(split) * M + (bx * kThreads + threadIdx.x) * V;
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = acc[j];
}

template <typename T, int V>
__global__ void __launch_bounds__(kCaptureBlock) batch_sumsq_kernel(const T* __restrict__ x, int64_t batch_stride,
                                                                    int64_t B, int64_t M, int nsplit,
                                                                    float* __restrict__ dst) {
  batch_sumsq_block<T, V, kCaptureBlock>(x, batch_stride, B, M, nsplit, dst, blockIdx.x, blockIdx.y);
}

// ---------------------------------------------------------------------------
// Phase 2: one block per (weight column, position chunk).
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kCaptureBlock) window_sums_kernel(const float* __restrict__ maps, int nmaps,
                                                                    ConvInputArgs a, int col_chunks,
                                                                    float* __restrict__ partials,
                                                                    unsigned* __restrict__ counters,
                                                                    float* __restrict__ dst) {
  __shared__ float smem[32];
  const int taps = a.kh * a.kw;
  const int col = blockIdx.x;
  const int K = gridDim.x;
  const int c = col / taps;
  const int r = col - c * taps;
  const int ki = r / a.kw, kj = r - ki * a.kw;
  const int Cg = static_cast<int>(a.C / a.groups);
  const int64_t HW = a.H * a.W;
  const int64_t M = a.C * HW;
  const int L = a.Ho * a.Wo;
  const Range rq = split_range(static_cast<int64_t>(a.groups) * L, col_chunks, blockIdx.y);
  const int y_off = ki * a.dh - a.pt, x_off = kj * a.dw - a.pl;
  float acc = 0.f;
  for (int64_t q = rq.lo + threadIdx.x; q < rq.hi; q += kCaptureBlock) {
    const int grp = static_cast<int>(q / L);
    const int pos = static_cast<int>(q - static_cast<int64_t>(grp) * L);
    const int oy = pos / a.Wo, ox = pos - oy * a.Wo;
    const int y = oy * a.sh + y_off, xx = ox * a.sw + x_off;
    if (y < 0 || y >= a.H || xx < 0 || xx >= a.W) continue;
    const int64_t ch = static_cast<int64_t>(grp) * Cg + c;
    const int64_t idx = a.map_hwc ? (static_cast<int64_t>(y) * a.W + xx) * a.C + ch : ch * HW + static_cast<int64_t>(y) * a.W + xx;
    acc += sum_maps(maps + idx, nmaps, M);  // the batch-split partial maps (nmaps == 1: the map itself)
  }
  acc = block_sum(acc, smem);
  if (col_chunks == 1) {
    if (threadIdx.x == 0) dst[col] = acc;
    return;
  }
  if (threadIdx.x == 0) partials[static_cast<int64_t>(blockIdx.y) * K + col] = acc;
  if (finished_last(counters + col, col_chunks) && threadIdx.x == 0) dst[col] = sum_partials(partials + col, col_chunks, K);
}

// The taps (ki, kj) whose window covers map position (y, x): bit ki of `rows` where row y
// is under tap row ki of some output row (y = oy*sh + ki*dh - pt), bit kj of `cols` alike;
// false where no tap covers it.
template <int MAXK>
__device__ __forceinline__ bool tap_masks(const ConvInputArgs& a, int y, int x, unsigned& rows, unsigned& cols) {
  rows = 0u;
  cols = 0u;
#pragma unroll
  for (int k = 0; k < MAXK; ++k) {
    const int ty = y + a.pt - k * a.dh, tx = x + a.pl - k * a.dw;
    if (k < a.kh && ty >= 0 && ty % a.sh == 0 && ty / a.sh < a.Ho) rows |= 1u << k;
    if (k < a.kw && tx >= 0 && tx % a.sw == 0 && tx / a.sw < a.Wo) cols |= 1u << k;
  }
  return rows != 0u && cols != 0u;
}

// acc[ki * MAXK + kj] += v for every covering tap
template <int MAXK>
__device__ __forceinline__ void add_to_taps(float* acc, unsigned rows, unsigned cols, float v) {
#pragma unroll
  for (int ki = 0; ki < MAXK; ++ki) {
#pragma unroll
    for (int kj = 0; kj < MAXK; ++kj) {
      if ((rows >> ki) & (cols >> kj) & 1u) acc[ki * MAXK + kj] += v;
    }
  }
}

// A thread's share of one channel's positions in the chunk [first, hi): positions first,
// first + step, ..., each map value (the nmaps partial maps at offset(e), sum_maps_at)
// added to the taps whose window covers it, in that order; both channel-side-by-side
// kernels below run this loop, with their own step and map order.
template <int MAXK, typename Offset>
__device__ __forceinline__ void add_positions_to_taps(const float* __restrict__ maps, int nmaps, int64_t M,
                                                      const ConvInputArgs& a, int first, int hi, int step,
                                                      Offset offset, float (&acc)[MAXK * MAXK]) {
  const int W = static_cast<int>(a.W);
  for (int e0 = first; e0 < hi; e0 += step * kPositionsInFlight) {
    int64_t off[kPositionsInFlight];
    unsigned rows[kPositionsInFlight], cols[kPositionsInFlight];
    float v[kPositionsInFlight];
#pragma unroll
    for (int u = 0; u < kPositionsInFlight; ++u) {
      // (a position past the chunk reads one inside it and adds it nowhere)
      const int e = e0 + u * step < hi ? e0 + u * step : e0;
      const int y = e / W, x = e - y * W;
      if (!tap_masks<MAXK>(a, y, x, rows[u], cols[u]) || e0 + u * step >= hi) rows[u] = 0u;
      off[u] = offset(e);
    }
    sum_maps_at(maps, off, nmaps, M, v);
#pragma unroll
    for (int u = 0; u < kPositionsInFlight; ++u) add_to_taps<MAXK>(acc, rows[u], cols[u], v[u]);
  }
}

// The last block of a tile sums its `items` columns' chunk partials: `groups` threads per
// item take every groups-th chunk (sum_partials: their loads in flight together; a serial
// sum of 64 chunks was most of a 1 x 1 layer's time), then the groups are added in order
// (deterministic).  `column(t, col)` gives item t's column, false past the last one;
// smem holds at least kThreads floats (the block's threads).
template <int kThreads = kCaptureBlock, typename Column>
__device__ void sum_chunks_in_order(const float* __restrict__ partials, int chunks, int items, int64_t K,
                                    Column column, float* smem, float* __restrict__ dst) {
  const int groups = items >= kThreads ? 1 : kThreads / items;
  __syncthreads();  // every thread is done with what the block kept in smem
  for (int t = threadIdx.x; t < items * groups; t += kThreads) {
    const int item = t % items, g = t / items;
    int64_t col;
    float part = 0.f;
    if (column(item, col) && g < chunks) {  // chunks g, g + groups, ...
      part = sum_partials(partials + static_cast<int64_t>(g) * K + col, (chunks - g + groups - 1) / groups,
                          static_cast<int64_t>(groups) * K);
    }
    smem[t] = part;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < items; t += kThreads) {
    int64_t col;
    if (!column(t, col)) continue;
    float total = 0.f;
    for (int g = 0; g < groups; ++g) total += smem[g * items + t];
    dst[col] = total;
  }
}

// ---------------------------------------------------------------------------
// Phase 2 for maps in (H, W, C) order (channels_last inputs), one group, kernels of at
// most MAXK x MAXK: block (channel tile, chunk: a range of positions in a range of the
// split maps, WindowChunks).  The generic kernel above puts
// its threads along the positions of one channel, which in this order reads one float in
// every C: an uncoalesced gather of every map value once per tap.  Here `lanes` threads
// (a power of two, the fewest that span the channels, at most 32) read one position's
// channels side by side, a block covers kCaptureBlock / lanes positions per pass, and
// every thread reads each map value once and adds it to the taps whose window covers it.
// Partial sums per chunk are summed in chunk order by the chunk that finishes last.
// ---------------------------------------------------------------------------
template <int MAXK>
__global__ void __launch_bounds__(kCaptureBlock) window_sums_hwc_kernel(const float* __restrict__ maps, int nmaps,
                                                                        ConvInputArgs a, int lanes, int chunks,
                                                                        int map_groups, float* __restrict__ partials,
                                                                        unsigned* __restrict__ counters,
                                                                        float* __restrict__ dst) {
  constexpr int kTaps = MAXK * MAXK;
  __shared__ float smem[kCaptureBlock * kTaps];
  const int taps = a.kh * a.kw;
  const int cl = threadIdx.x % lanes, ry = threadIdx.x / lanes;
  const int pass = kCaptureBlock / lanes;
  const int C = static_cast<int>(a.C);
  const int c = blockIdx.x * lanes + cl;
  const int64_t M = a.C * a.H * a.W;
  const Range rp = split_range(a.H * a.W, chunks / map_groups, static_cast<int>(blockIdx.y) / map_groups);
  int m_lo, m_hi;  // the chunk's maps
  even_range(nmaps, map_groups, static_cast<int>(blockIdx.y) % map_groups, m_lo, m_hi);
  float acc[kTaps];
#pragma unroll
  for (int t = 0; t < kTaps; ++t) acc[t] = 0.f;
  if (c < C) {  // positions e, e + pass, ... of the chunk, in the chunk's maps
    add_positions_to_taps<MAXK>(maps + m_lo * M, m_hi - m_lo, M, a, static_cast<int>(rp.lo) + ry,
                                static_cast<int>(rp.hi), pass, [&](int e) { return static_cast<int64_t>(e) * C + c; }, acc);
  }
  // smem[(ry * kTaps + tap) * lanes + cl]; item t < lanes * taps (as many as 288, so a
  // thread may take two) is one (channel, tap) summed over the pass's rows, in order
#pragma unroll
  for (int t = 0; t < kTaps; ++t) smem[(ry * kTaps + t) * lanes + cl] = acc[t];
  __syncthreads();
  const int items = lanes * taps;
  const int64_t K = static_cast<int64_t>(C) * taps;
  // item t: channel blockIdx.x * lanes + t % lanes, tap t / lanes = ki * kw + kj; column
  // channel * taps + tap; false past the last channel
  auto column = [&](int t, int64_t& col) {
    const int ch = blockIdx.x * lanes + t % lanes;
    col = static_cast<int64_t>(ch) * taps + t / lanes;
    return ch < C;
  };
  for (int t = threadIdx.x; t < items; t += kCaptureBlock) {
    int64_t col;
    if (!column(t, col)) continue;
    const int tap = t / lanes, slot = (tap / a.kw) * MAXK + tap % a.kw;
    float s = 0.f;
    for (int y = 0; y < pass; ++y) s += smem[(y * kTaps + slot) * lanes + t % lanes];
    if (chunks == 1) {
      dst[col] = s;
    } else {
      partials[static_cast<int64_t>(blockIdx.y) * K + col] = s;
    }
  }
  if (chunks == 1 || !finished_last(counters + blockIdx.x, chunks)) return;
  sum_chunks_in_order(partials, chunks, items, K, column, smem, dst);
}

// ---------------------------------------------------------------------------
// Phase 2 for maps in (C, H, W) order (contiguous inputs), one group, kernels of at most
// MAXK x MAXK: block (tile of kChwChannels channels, position chunk).  The per-column
// kernel reads every map value once per tap (nine times for a 3 x 3 kernel), each block
// summing one tap over the positions; here each warp takes one channel, its lanes read
// consecutive positions (coalesced), every value is read once and added to the taps
// whose window covers it, and each tap's sum is the warp's.  Partial sums per chunk are
// summed in chunk order by the chunk that finishes last.
// ---------------------------------------------------------------------------
constexpr int kChwChannels = kCaptureBlock / 32;

template <int MAXK>
__global__ void __launch_bounds__(kCaptureBlock) window_sums_chw_kernel(const float* __restrict__ maps, int nmaps,
                                                                        ConvInputArgs a, int chunks,
                                                                        float* __restrict__ partials,
                                                                        unsigned* __restrict__ counters,
                                                                        float* __restrict__ dst) {
  constexpr int kTaps = MAXK * MAXK;
  __shared__ float smem[kCaptureBlock];
  const int taps = a.kh * a.kw;
  const int lane = threadIdx.x % 32;
  const int C = static_cast<int>(a.C);
  const int c0 = blockIdx.x * kChwChannels;
  const int c = c0 + static_cast<int>(threadIdx.x / 32);
  const int64_t HW = a.H * a.W;
  const int64_t M = a.C * HW;
  const Range rp = split_range(HW, chunks, blockIdx.y);
  float acc[kTaps];
#pragma unroll
  for (int t = 0; t < kTaps; ++t) acc[t] = 0.f;
  if (c < C) {  // positions e, e + 32, ... of the chunk (C * H * W fits an int)
    add_positions_to_taps<MAXK>(maps, nmaps, M, a, static_cast<int>(rp.lo) + lane, static_cast<int>(rp.hi), 32,
                                [&](int e) { return static_cast<int64_t>(c) * HW + e; }, acc);
  }
#pragma unroll
  for (int t = 0; t < kTaps; ++t) acc[t] = warp_sum(acc[t]);
  const int64_t K = static_cast<int64_t>(C) * taps;
  if (lane == 0 && c < C) {
    for (int t = 0; t < taps; ++t) {
      const float s = acc[(t / a.kw) * MAXK + t % a.kw];
      const int64_t col = static_cast<int64_t>(c) * taps + t;
      if (chunks == 1) {
        dst[col] = s;
      } else {
        partials[static_cast<int64_t>(blockIdx.y) * K + col] = s;
      }
    }
  }
  if (chunks == 1 || !finished_last(counters + blockIdx.x, chunks)) return;
  // the block's columns are contiguous: channel c0's taps, then the next channel's
  const int items = kChwChannels * taps;
  auto column = [&](int t, int64_t& col) {
    col = static_cast<int64_t>(c0) * taps + t;
    return col < K;
  };
  sum_chunks_in_order(partials, chunks, items, K, column, smem, dst);
}

// ---------------------------------------------------------------------------
// Per-channel statistics, channels in the middle (sp == 1, P > 1): block (o, split).
// ---------------------------------------------------------------------------
// A channel's whole sum, times post_mul when asked (torch's division by a scalar).
__device__ __forceinline__ float finish(const ChannelArgs& a, float sum) { return a.apply_post ? sum * a.post_mul : sum; }

// Channel o's sum over split `split` of the rows (and, in the block that finishes the
// channel last, its whole sum): its own kernel below, or a launch it shares.
template <typename T, int V>
__device__ __forceinline__ void channel_middle_block(const ChannelArgs& a, const T* __restrict__ t, int nsplit,
                                                    float* __restrict__ partials, unsigned* __restrict__ counters,
                                                    float* __restrict__ dst, int64_t o, int split, float* smem) {
  const Range ra = split_range(a.A, nsplit, split);
  const int64_t a0 = ra.lo, a1 = ra.hi;
  const int64_t PV = a.P / V;
  const T* base = t + o * a.so;
  float acc = 0.f;
  if (PV >= kCaptureBlock / 2) {  // long rows: rows outer, threads along the row
    // kRowsInFlight rows' loads issued before any is summed (a row of 256 vectors is one
    // load per thread: row by row, each thread had one load in flight)
    int64_t r = a0;
    for (; r + kRowsInFlight <= a1; r += kRowsInFlight) {
      const T* row = base + r * a.sa;
      for (int64_t e = threadIdx.x; e < PV; e += kCaptureBlock) {
        float v[kRowsInFlight][V];
#pragma unroll
        for (int k = 0; k < kRowsInFlight; ++k) load_vec<V>(v[k], row + k * a.sa + e * V);
#pragma unroll
        for (int k = 0; k < kRowsInFlight; ++k) {
#pragma unroll
          for (int j = 0; j < V; ++j) acc = a.square ? fmaf(v[k][j], v[k][j], acc) : acc + v[k][j];
        }
      }
    }
    for (; r < a1; ++r) {
      const T* row = base + r * a.sa;
#pragma unroll 4
      for (int64_t e = threadIdx.x; e < PV; e += kCaptureBlock) {
        float v[V];
        load_vec<V>(v, row + e * V);
#pragma unroll
        for (int j = 0; j < V; ++j) acc = a.square ? fmaf(v[j], v[j], acc) : acc + v[j];
      }
    }
  } else {  // short rows: threads over (row, element) flattened
    const int64_t n = (a1 - a0) * PV;
#pragma unroll 4
    for (int64_t e = threadIdx.x; e < n; e += kCaptureBlock) {
      const int64_t r = e / PV;
      const int64_t k = e - r * PV;
      float v[V];
      load_vec<V>(v, base + (a0 + r) * a.sa + k * V);
#pragma unroll
      for (int j = 0; j < V; ++j) acc = a.square ? fmaf(v[j], v[j], acc) : acc + v[j];
    }
  }
  acc = block_sum(acc, smem);
  if (nsplit == 1) {
    if (threadIdx.x == 0) dst[o] = finish(a, acc);
    return;
  }
  if (threadIdx.x == 0) partials[static_cast<int64_t>(split) * a.O + o] = acc;
  if (finished_last(counters + o, nsplit) && threadIdx.x == 0) dst[o] = finish(a, sum_partials(partials + o, nsplit, a.O));
}

template <typename T, int V>
__global__ void __launch_bounds__(kCaptureBlock) channel_middle_kernel(ChannelArgs a, const T* __restrict__ t,
                                                                       int nsplit, float* __restrict__ partials,
                                                                       unsigned* __restrict__ counters,
                                                                       float* __restrict__ dst) {
  __shared__ float smem[32];
  channel_middle_block<T, V>(a, t, nsplit, partials, counters, dst, blockIdx.x, blockIdx.y, smem);
}

// ---------------------------------------------------------------------------
// Per-channel statistics, channels innermost (so == 1): block (channel tile, split).
// `lanes` threads (a power of two, the fewest that span the channels, at most 32) cover
// a row's channels of the tile, so a warp reads 32 / lanes rows at once and narrow rows
// (64 bf16 channels: 8 vectors) keep every lane busy; each thread keeps kUnroll rows'
// loads in flight, held as the loaded bytes until summed (16 registers for four 16-byte
// loads, not 32 floats: what keeps two 512-thread blocks on an SM).  Rows r run over
// (a, p), offset a*sa + p*sp.  Every 16-byte read streams (load_streaming16: no L1
// allocation, a 256-byte L2 fetch): 5-6% less device time than __ldg on ResNet-50's and the
// GPT's capture steps (H100).  How a row is read (channel_rows_shape picks it):
//  * kVector: every tile's row starts on the 16-byte grid; lane l reads channels
//    [l*V, l*V + V) of the tile as one 16-byte load.
//  * kShifted: 2-byte rows that start anywhere (an odd vocabulary's logits, a sliced
//    view): lane l reads the l-th 16 bytes of the grid from the tile's first element
//    down, and takes its V channels from its own bytes and its right neighbour's (a
//    shuffle, then a funnel shift by the row's offset from the grid).  The last lane only
//    lends its bytes, so a tile is 31 vectors wide.  On the H200 an 8192 x 50257 bf16
//    LM-head gradient took 258 us so (3.2 TB/s), 327 us read one element a lane.
//  * kScalar: one element a lane: fp32 rows off the grid (a warp reads 128 bytes), and
//    2-byte rows narrower than 32 vectors.
// (kBlock and kUnroll are template arguments so that other shapes can be measured
// against the defaults.)
// ---------------------------------------------------------------------------

// The 16 bytes that start `shift` (0..15) bytes into lo:hi (lo at the lower address).
// The word offset is a template argument: indexed at run time, the words took six
// selects each, and the kernel was bound by issuing them.
template <int Q>
__device__ __forceinline__ uint4 bytes_at_words(const uint4& lo, const uint4& hi, unsigned bits) {
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  return make_uint4(__funnelshift_r(w[Q], w[Q + 1], bits), __funnelshift_r(w[Q + 1], w[Q + 2], bits),
                    __funnelshift_r(w[Q + 2], w[Q + 3], bits), __funnelshift_r(w[Q + 3], w[Q + 4], bits));
}

// (shift is the same across a warp: the rows kernel's shifted read gives a warp one row.)
__device__ __forceinline__ uint4 bytes_at(const uint4& lo, const uint4& hi, int shift) {
  const unsigned bits = static_cast<unsigned>(shift & 3) * 8u;
  switch (shift >> 2) {
    case 0:
      return bytes_at_words<0>(lo, hi, bits);
    case 1:
      return bytes_at_words<1>(lo, hi, bits);
    case 2:
      return bytes_at_words<2>(lo, hi, bits);
    default:
      return bytes_at_words<3>(lo, hi, bits);
  }
}

__device__ __forceinline__ uint4 shfl_down16(const uint4& v, int lanes) {
  return make_uint4(__shfl_down_sync(0xffffffffu, v.x, 1, lanes), __shfl_down_sync(0xffffffffu, v.y, 1, lanes),
                    __shfl_down_sync(0xffffffffu, v.z, 1, lanes), __shfl_down_sync(0xffffffffu, v.w, 1, lanes));
}

template <int V>
__device__ __forceinline__ void add_stats(const ChannelArgs& a, const float (&v)[V], float (&acc)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = a.square ? fmaf(v[j], v[j], acc[j]) : acc[j] + v[j];
}

// What one of the rows kernel's reads gives a lane: 16 bytes (kRowsWidth elements) read as
// one uint4, or one element off the grid (kScalar); widen_rows_raw makes them floats.
template <typename T, RowsRead kRead>
constexpr int kRowsWidth = kRead == RowsRead::kScalar ? 1 : 16 / static_cast<int>(sizeof(T));
template <typename T, RowsRead kRead>
using RowsRaw = std::conditional_t<kRead == RowsRead::kScalar, T, uint4>;

template <typename T, RowsRead kRead>
__device__ __forceinline__ void widen_rows_raw(const RowsRaw<T, kRead>& raw, float (&v)[kRowsWidth<T, kRead>]) {
  if constexpr (kRead == RowsRead::kScalar) {
    v[0] = to_float(raw);
  } else {
    unpack16<T>(raw, v);
  }
}

// A thread's share of a split's rows where they lie at one stride (a flat tensor: every
// row q at q * rs): its first row at p, then every pass-th row (`step` elements on), while
// `left` (the split's rows from p on, less `pass` a row) is above zero, summed in that
// order.  The pointer steps by a constant; the general path works
// each row's address out (a 64-bit multiply, a stride test, the flag read again from the
// launch's parameters) and held the SM's issue slots at 0.45 a cycle for 73% of the DRAM
// bandwidth on a 205 MB bf16 gradient (H100, Nsight Compute).  Whole groups of kUnroll
// loads in flight, then the rest one at a time: the same rows, in the same order, as a
// group padded with zeros adds.
template <typename T, RowsRead kRead, int kUnroll, bool kSquare>
__device__ __forceinline__ void sum_flat_rows(const T* __restrict__ p, int64_t step, int64_t left, int pass,
                                              float (&acc)[kRowsWidth<T, kRead>]) {
  constexpr int V = kRowsWidth<T, kRead>;
  using Raw = RowsRaw<T, kRead>;
  auto load = [](const T* q) -> Raw {
    if constexpr (kRead == RowsRead::kScalar) {
      return *q;
    } else {
      return load_streaming16(q);
    }
  };
  auto add = [&](const Raw& raw) {
    float v[V];
    widen_rows_raw<T, kRead>(raw, v);
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = kSquare ? fmaf(v[j], v[j], acc[j]) : acc[j] + v[j];
  };
  const int64_t group = static_cast<int64_t>(pass) * kUnroll;
  for (; left > static_cast<int64_t>(pass) * (kUnroll - 1); left -= group, p += kUnroll * step) {
    Raw raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = load(p + u * step);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) add(raw[u]);
  }
  for (; left > 0; left -= pass, p += step) add(load(p));
}

// The sums of a tile's splits, for its channels [tile0, tile0 + width) of O: `nsplit` rows
// of partials (row k at partials + k * O), summed by one block of kBlock threads in a fixed
// order.  `groups` threads per column (or per four columns, read as one float4 where the
// rows allow) take every groups-th split, then thread c adds the groups in order
// (deterministic).  Its loads are what a launch waits for at its end, so as many are kept
// in flight as the block can.  Thread c's total (0 for c >= width); smem holds kBlock * V
// floats, and every thread of the block calls it (two barriers).  The rows kernel's last
// block of a tile calls it, and finish_sums_kernel for a deferred read: the same sums.
template <int V, int kBlock>
__device__ __forceinline__ float sum_split_partials(const float* __restrict__ partials, int nsplit, int64_t O,
                                                    int64_t tile0, int width, float* smem) {
  __syncthreads();  // every thread is done with what smem held
  int groups;
  if (V >= 4 && O % 4 == 0) {  // smem holds kBlock * V >= groups * width floats
    const int quads = width / 4;
    groups = kBlock / quads;
    const int g = threadIdx.x / quads, q = threadIdx.x % quads;
    float4 part = make_float4(0.f, 0.f, 0.f, 0.f);
    if (g < groups && tile0 + 4 * q < O) {
#pragma unroll 8
      for (int k = g; k < nsplit; k += groups) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(partials + static_cast<int64_t>(k) * O + tile0 + 4 * q));
        part.x += v.x;
        part.y += v.y;
        part.z += v.z;
        part.w += v.w;
      }
    }
    if (g < groups) {  // (a tile of 31 vectors leaves threads past the last group)
      float* slot = smem + g * width + 4 * q;
      slot[0] = part.x;
      slot[1] = part.y;
      slot[2] = part.z;
      slot[3] = part.w;
    }
  } else {
    groups = kBlock / width;
    const int g = threadIdx.x / width, cc = threadIdx.x % width;
    float part = 0.f;
    if (g < groups && tile0 + cc < O) {
#pragma unroll 8
      for (int k = g; k < nsplit; k += groups) part += __ldcg(partials + static_cast<int64_t>(k) * O + tile0 + cc);
    }
    smem[threadIdx.x] = part;
  }
  __syncthreads();
  const int c = threadIdx.x;
  float total = 0.f;
  if (c < width && tile0 + c < O) {
    for (int k = 0; k < groups; ++k) total += smem[k * width + c];
  }
  return total;
}

// One block of the rows kernel over one item (RowsItem): its block b is tile b % tiles
// and split b / tiles (the order of a (tiles, splits) grid).  `smem` holds kBlock * V floats.
// True where this block wrote its tile's sums to dst (the tile's one split, or its last).
template <typename T, RowsRead kRead, int kBlock, int kUnroll>
__device__ __forceinline__ bool channel_rows_block(const RowsItem& item, int b, float* smem) {
  constexpr int V = kRowsWidth<T, kRead>;
  const ChannelArgs& a = item.a;
  const T* __restrict__ t = static_cast<const T*>(a.t);
  const int lanes = item.lanes, nsplit = item.nsplit;
  float* __restrict__ partials = item.partials;
  unsigned* __restrict__ counters = item.counters;
  float* __restrict__ dst = item.dst;
  const int bx = b % item.tiles, by = b / item.tiles;
  const int cl = threadIdx.x % lanes, ry = threadIdx.x / lanes;
  const int pass = kBlock / lanes;   // rows per block pass
  const int stride = lanes * V;      // smem floats per pass row
  const int width = kRead == RowsRead::kShifted ? stride - V : stride;  // channels per tile
  const int64_t tile0 = static_cast<int64_t>(bx) * width;
  const int64_t o = tile0 + static_cast<int64_t>(cl) * V;
  const Range rr = split_range(a.A * a.P, nsplit, by);
  const bool flat = a.P == 1 || a.sa == a.P * a.sp;
  const int64_t rs = a.P == 1 ? a.sa : a.sp;
  auto row = [&](int64_t q) { return t + (flat ? q * rs : (q / a.P) * a.sa + (q % a.P) * a.sp) + tile0; };
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  if constexpr (kRead == RowsRead::kShifted) {
    // Every lane takes part in the shuffles (lanes == 32: a warp is one row).  The last
    // lane's sums (the next tile's first vector) and a last tile's channels past O (the
    // next row's) are summed like the others and never written: the sums below read
    // columns c < width, and write only channels below O.
    const int64_t tile_bytes = (a.O - tile0 < width ? a.O - tile0 : width) * static_cast<int64_t>(sizeof(T));
    for (int64_t r = rr.lo + ry; r < rr.hi; r += static_cast<int64_t>(pass) * kUnroll) {
      uint4 raw[kUnroll];
      int shift[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t q = r + static_cast<int64_t>(u) * pass;
        raw[u] = make_uint4(0u, 0u, 0u, 0u);
        shift[u] = 0;
        if (q < rr.hi) {
          const uintptr_t first = reinterpret_cast<uintptr_t>(row(q));
          shift[u] = static_cast<int>(first & 15u);
          const uintptr_t mine = first - shift[u] + 16u * static_cast<unsigned>(cl);
          // the 16 bytes on the grid that hold any of the tile's bytes lie in its allocation
          if (mine < first + tile_bytes) raw[u] = load_streaming16(reinterpret_cast<const void*>(mine));
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float v[V];
        unpack16<T>(bytes_at(raw[u], shfl_down16(raw[u], lanes), shift[u]), v);
        add_stats<V>(a, v, acc);
      }
    }
  } else if (o < a.O && flat) {
    if (a.square) {
      sum_flat_rows<T, kRead, kUnroll, true>(t + (rr.lo + ry) * rs + o, static_cast<int64_t>(pass) * rs,
                                              rr.hi - rr.lo - ry, pass, acc);
    } else {
      sum_flat_rows<T, kRead, kUnroll, false>(t + (rr.lo + ry) * rs + o, static_cast<int64_t>(pass) * rs,
                                               rr.hi - rr.lo - ry, pass, acc);
    }
  } else if (o < a.O) {
    using Raw = RowsRaw<T, kRead>;
    for (int64_t r = rr.lo + ry; r < rr.hi; r += static_cast<int64_t>(pass) * kUnroll) {
      Raw raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t q = r + static_cast<int64_t>(u) * pass;
        if constexpr (kRead == RowsRead::kScalar) {
          raw[u] = q < rr.hi ? row(q)[cl] : T(0.f);
        } else {
          raw[u] = q < rr.hi ? load_streaming16(row(q) + cl * V) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float v[V];
        widen_rows_raw<T, kRead>(raw[u], v);
        add_stats<V>(a, v, acc);
      }
    }
  }
  // smem[ry * stride + cl * V + j]: thread c < width sums column c over the pass's rows, in order
#pragma unroll
  for (int j = 0; j < V; ++j) smem[threadIdx.x * V + j] = acc[j];
  __syncthreads();
  const int c = threadIdx.x;
  float s = 0.f;
  if (c < width) {
    for (int y = 0; y < pass; ++y) s += smem[y * stride + c];
  }
  const bool mine = c < width && tile0 + c < a.O;
  if (nsplit == 1) {
    if (mine) dst[tile0 + c] = finish(a, s);
    return true;
  }
  if (mine) partials[static_cast<int64_t>(by) * a.O + tile0 + c] = s;
  if (item.deferred) return false;  // (finish_sums_kernel sums the splits later, as below)
  if (!finished_last(counters + bx, nsplit)) return false;
  const float total = sum_split_partials<V, kBlock>(partials, nsplit, a.O, tile0, width, smem);
  if (mine) dst[tile0 + c] = finish(a, total);
  return true;
}

// A launch reads one or two tensors (RowsPair): a layer's input and its output's gradient
// in one launch where one kernel reads both (a capture step's host pays per launch, per
// layer).  Blocks [0, first_blocks) are the first item's, the rest the second's.  The body
// is inlined once per item, each reading its item from the launch's parameters at fixed
// offsets (__grid_constant__: no copy to local memory), which the constant cache gives
// again wherever the body reads them: the registers of the one-item kernel.
template <typename T, RowsRead kRead, int kBlock = kRowsBlock, int kUnroll = kRowsUnroll>
__global__ void __launch_bounds__(kBlock) channel_rows_kernel(const __grid_constant__ RowsPair pair) {
  constexpr int V = kRowsWidth<T, kRead>;
  __shared__ float smem[kBlock * V];
  const int b = static_cast<int>(blockIdx.x);
  if (b < pair.first_blocks) {
    channel_rows_block<T, kRead, kBlock, kUnroll>(pair.first, b, smem);
  } else {
    channel_rows_block<T, kRead, kBlock, kUnroll>(pair.second, b - pair.first_blocks, smem);
  }
}

// The sums of deferred reads (FinishItem): a block per tile of each item, summing its splits
// as the rows kernel's last block does (sum_split_partials with the read's vec), so that a
// read's sums are the same floats deferred or not.  Where the rows kernel's blocks leave
// their partials to it, a capture step's launches end without their last blocks' tails (a
// device-wide fence, a count, then one block summing up to hundreds of rows of partials
// alone), which took about 157 us of ResNet-50's capture-step kernels on an H100
// (docs/results/probe-rows-tail-hint-h100-56664b3.txt); these sums run in one launch.
constexpr int kFinishMaxItems = 256;
using FinishList = LaunchList<FinishItem, kFinishMaxItems, /*kRanged=*/true>;
static_assert(sizeof(FinishList) <= kParamBytesLarge, "finish_sums_kernel's list exceeds the kernel-parameter budget");

template <int V>
__device__ __forceinline__ void finish_tile(const FinishItem& f, int bx, float* smem) {
  const int64_t tile0 = static_cast<int64_t>(bx) * f.width;
  const float total = sum_split_partials<V, kRowsBlock>(f.partials, f.nsplit, f.O, tile0, f.width, smem);
  const int c = threadIdx.x;
  if (c < f.width && tile0 + c < f.O) f.dst[tile0 + c] = f.apply_post ? total * f.post_mul : total;
}

__global__ void __launch_bounds__(kRowsBlock) finish_sums_kernel(const __grid_constant__ FinishList list) {
  __shared__ float smem[kRowsBlock * 8];
  const UnitOf at = unit_of_block(list, static_cast<int32_t>(blockIdx.x));
  const FinishItem& f = list.item[at.slot];
  if (f.vec == 8) {  // (the same for the whole block: its barriers are reached by all)
    finish_tile<8>(f, at.unit, smem);
  } else if (f.vec == 4) {
    finish_tile<4>(f, at.unit, smem);
  } else {
    finish_tile<1>(f, at.unit, smem);
  }
}

// Block b of phase 1's part of a shared launch (blocks of kThreads threads, 16 bytes a
// thread): position block b % blocks_x of split b / blocks_x.
template <typename T, int kThreads>
__device__ __forceinline__ void sumsq_item_block(const SumsqItem& s, int b) {
  batch_sumsq_block<T, 16 / static_cast<int>(sizeof(T)), kThreads>(static_cast<const T*>(s.x), s.batch_stride, s.B,
                                                                   s.M, s.nsplit, s.maps, b % s.blocks_x,
                                                                   b / s.blocks_x);
}

// Phase 1 of a convolution's input statistics and its output gradient's rows read, in
// one launch (SumsqAndRows): a launch fewer per convolution in a capture step's backward,
// whose host pays per launch.  Phase 1's blocks come first, kRowsBlock threads each.
template <typename T>
__global__ void __launch_bounds__(kRowsBlock) sumsq_and_rows_kernel(const __grid_constant__ SumsqAndRows job) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  __shared__ float smem[kRowsBlock * V];
  const int b = static_cast<int>(blockIdx.x);
  if (b < job.sumsq_blocks) {
    sumsq_item_block<T, kRowsBlock>(job.sumsq, b);
  } else {
    channel_rows_block<T, RowsRead::kVector, kRowsBlock, kRowsUnroll>(job.rows, b - job.sumsq_blocks, smem);
  }
}

// A 3 x 3 convolution's input statistics from its border or parity sums (capture_launch.h,
// BorderTaps), with its output gradient's rows read in the same launch where job.items
// holds one past the nine sums'.  Each item's blocks are the rows kernel's; the block
// that writes a tile's sums of a border item counts it on the tile's counter, and the last
// of the nine to do so writes the tile's taps: each a fixed expression of the nine sums, so
// the result does not depend on which block finishes last.
template <typename T>
__global__ void __launch_bounds__(kRowsBlock, 2) border_taps_kernel(const __grid_constant__ BorderTaps job) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  __shared__ float smem[kRowsBlock * V];
  const int b = static_cast<int>(blockIdx.x);
  int i = 0;
  while (i + 1 < kBorderItems && b >= job.starts[i + 1]) ++i;
  const RowsItem& item = job.items[i];
  const int local = b - job.starts[i];
  const bool wrote = channel_rows_block<T, RowsRead::kVector, kRowsBlock, kRowsUnroll>(item, local, smem);
  if (i >= kBorderSums || !wrote) return;
  const int bx = local % item.tiles;
  if (!finished_last(job.tile_counters + bx, kBorderSums)) return;
  const int64_t c = static_cast<int64_t>(bx) * item.lanes * V + threadIdx.x;
  if (threadIdx.x >= item.lanes * V || c >= item.a.O) return;
  float v[kBorderSums];
#pragma unroll
  for (int k = 0; k < kBorderSums; ++k) v[k] = __ldcg(job.items[k].dst + c);
  // Tap (ki, kj) = ((its class's sum - the left-out row's) - the left-out column's) + their
  // corner (a term that is not left out is 0, and adds or takes nothing).  Where nearly all
  // of a channel's x^2 lies in what is left out, the difference can round below the true
  // sum, which is >= 0: below 0 it is written as 0 (a NaN or an inf stays as it is, for the
  // factor update's check).
  float base[3][3], rows_out[3][3], cols_out[3][3], corner[3][3];
  if (!job.parity) {
    // (kBorderSums' order: total, top row, bottom row, left column, right column, then the
    // corners top-left, top-right, bottom-left, bottom-right; tap row ki leaves out the bottom
    // row (0), the top (2), tap column kj the right column (0), the left (2))
    const float row_left_out[3] = {v[2], 0.f, v[1]}, col_left_out[3] = {v[4], 0.f, v[3]};
    const float corners[3][3] = {{v[8], 0.f, v[7]}, {0.f, 0.f, 0.f}, {v[6], 0.f, v[5]}};
#pragma unroll
    for (int ki = 0; ki < 3; ++ki) {
#pragma unroll
      for (int kj = 0; kj < 3; ++kj) {
        base[ki][kj] = v[0];
        rows_out[ki][kj] = row_left_out[ki];
        cols_out[ki][kj] = col_left_out[kj];
        corner[ki][kj] = corners[ki][kj];
      }
    }
  } else {
    // (the order: classes even x even, even x odd, odd x even, odd x odd, the last row's even
    // and odd columns, the last column's even and odd rows, the last corner; tap row 1 the
    // even rows, 2 the odd, 0 the odd but the last; columns likewise)
#pragma unroll
    for (int ki = 0; ki < 3; ++ki) {
#pragma unroll
      for (int kj = 0; kj < 3; ++kj) {
        const int odd_row = ki != 1, odd_col = kj != 1;
        base[ki][kj] = v[2 * odd_row + odd_col];
        rows_out[ki][kj] = ki == 0 ? v[4 + odd_col] : 0.f;
        cols_out[ki][kj] = kj == 0 ? v[6 + odd_row] : 0.f;
        corner[ki][kj] = ki == 0 && kj == 0 ? v[8] : 0.f;
      }
    }
  }
#pragma unroll
  for (int ki = 0; ki < 3; ++ki) {
#pragma unroll
    for (int kj = 0; kj < 3; ++kj) {
      const float t = ((base[ki][kj] - rows_out[ki][kj]) - cols_out[ki][kj]) + corner[ki][kj];
      job.out[c * 9 + ki * 3 + kj] = t < 0.f ? 0.f : t;
    }
  }
}

// ---------------------------------------------------------------------------
// Phase 2 folded into phase 1's launch (capture_launch.h, WindowFold).
// ---------------------------------------------------------------------------
// The fold's last block: dst[col] = the posblocks' partial sums of column col added in
// block order, for every col < K (several threads a column where the columns are fewer
// than the threads: sum_chunks_in_order).  smem holds at least kThreads floats.
template <int kThreads>
__device__ void sum_blocks_in_order(const float* __restrict__ cols, int n, int64_t K, float* smem,
                                    float* __restrict__ dst) {
  if (K >= kThreads) {
    // a thread's columns two at a time, eight blocks' partials of each in flight (a
    // column at a time, its few loads would be a round trip to L2 a column in sequence)
    for (int64_t c = threadIdx.x; c < K; c += 2 * kThreads) {
      const int64_t c1 = c + kThreads < K ? c + kThreads : c;  // (past K: re-reads c, written nowhere)
      float a0 = 0.f, a1 = 0.f;
      for (int k = 0; k < n; k += kChainLoads) {
        float u0[kChainLoads], u1[kChainLoads];
#pragma unroll
        for (int j = 0; j < kChainLoads; ++j) {
          const int64_t row = static_cast<int64_t>(k + j < n ? k + j : k) * K;  // (past n: re-reads k, added nowhere)
          u0[j] = __ldcg(cols + row + c);
          u1[j] = __ldcg(cols + row + c1);
        }
#pragma unroll
        for (int j = 0; j < kChainLoads; ++j) {
          if (k + j < n) {
            a0 += u0[j];
            a1 += u1[j];
          }
        }
      }
      dst[c] = a0;
      if (c + kThreads < K) dst[c + kThreads] = a1;
    }
    return;
  }
  const auto column = [](int t, int64_t& col) {
    col = t;
    return true;
  };
  sum_chunks_in_order<kThreads>(cols, n, static_cast<int>(K), K, column, smem, dst);
}

// Block b of phase 1 with its windows folded in: position block bx = b % blocks_x (P
// whole positions of the map, E = kRowsBlock * V elements) of split b / blocks_x.  smem
// holds at least kRowsBlock * max(V, MAXK * MAXK) floats, and E + P at least (P <= kRowsBlock).
template <typename T, int MAXK>
__device__ void sumsq_fold_block(const SumsqItem& s, const WindowFold& f, int b, float* smem) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  constexpr int kTaps = MAXK * MAXK;
  constexpr int E = kRowsBlock * V;
  const int bx = b % s.blocks_x, split = b / s.blocks_x;
  const int64_t M = s.M;
  const int64_t i = (static_cast<int64_t>(bx) * kRowsBlock + threadIdx.x) * V;
  float v[V];
  const bool live = batch_sumsq_values<T, V, kRowsBlock>(static_cast<const T*>(s.x), s.batch_stride, s.B, M, s.nsplit,
                                                         bx, split, v);
  if (s.nsplit > 1) {
    if (live) {
      float* out = s.maps + static_cast<int64_t>(split) * M + i;
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = v[j];
    }
    if (!finished_last(f.counters + bx, s.nsplit)) return;
    // the last split to finish: the batch's sums at the block's elements, split by split
    // in order, four splits' loads in flight (read through L2: other blocks wrote them)
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = 0.f;
    if (live) {
      const float* m = s.maps + i;
      for (int k = 0; k < s.nsplit; k += 4) {
        float4 u[4][V / 4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int64_t at = static_cast<int64_t>(k + q < s.nsplit ? k + q : k) * M;  // (past the last: re-read, added nowhere)
#pragma unroll
          for (int w = 0; w < V / 4; ++w) u[q][w] = __ldcg(reinterpret_cast<const float4*>(m + at) + w);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (k + q >= s.nsplit) break;
#pragma unroll
          for (int w = 0; w < V / 4; ++w) {
            v[4 * w] += u[q][w].x;
            v[4 * w + 1] += u[q][w].y;
            v[4 * w + 2] += u[q][w].z;
            v[4 * w + 3] += u[q][w].w;
          }
        }
      }
    }
  }
  // the block's map values as smem[p * C + c] (p: its positions, in order; zeros past M),
  // and after them each position's covering taps (tap_masks: rows in bits 0-7, columns
  // above), found once a position rather than once a channel
  const ConvInputArgs& a = f.a;
  const int C = static_cast<int>(a.C), taps = a.kh * a.kw, W = static_cast<int>(a.W);
  const int64_t K = static_cast<int64_t>(C) * taps;
  const int P = E / C;
  const int64_t pos0 = static_cast<int64_t>(bx) * P, HW = a.H * a.W;
  unsigned* const masks = reinterpret_cast<unsigned*>(smem + E);
#pragma unroll
  for (int j = 0; j < V; ++j) smem[threadIdx.x * V + j] = v[j];
  if (static_cast<int>(threadIdx.x) < P) {
    const int64_t pos = pos0 + threadIdx.x;
    unsigned rows = 0u, cols = 0u;
    if (pos < HW) {
      const int y = static_cast<int>(pos / W), x = static_cast<int>(pos - static_cast<int64_t>(y) * W);
      if (!tap_masks<MAXK>(a, y, x, rows, cols)) rows = cols = 0u;
    }
    masks[threadIdx.x] = rows | (cols << 8);
  }
  __syncthreads();
  // thread (g, cl) adds positions g, g + G, ... of channel c0 + cl to the taps covering them
  const int Cw = C < kRowsBlock ? C : kRowsBlock, G = kRowsBlock / Cw;
  const int g = static_cast<int>(threadIdx.x) / Cw, cl = static_cast<int>(threadIdx.x) % Cw;
  float* const cols_out = f.posblocks > 1 ? f.cols + static_cast<int64_t>(bx) * K : f.dst;
  for (int c0 = 0; c0 < C; c0 += Cw) {  // (one pass where C <= kRowsBlock)
    float acc[kTaps];
#pragma unroll
    for (int t = 0; t < kTaps; ++t) acc[t] = 0.f;
    for (int p = g; p < P; p += G) {
      const unsigned mk = masks[p];
      add_to_taps<MAXK>(acc, mk & 0xffu, mk >> 8, smem[p * C + c0 + cl]);
    }
    if (G == 1) {  // the thread has its channel's whole sums over the block
      for (int t = 0; t < taps; ++t) cols_out[static_cast<int64_t>(c0 + cl) * taps + t] = acc[(t / a.kw) * MAXK + t % a.kw];
      continue;
    }
    // G groups of the block's positions: their sums as smem[(g * taps + tap) * C + cl],
    // added in group order
    __syncthreads();  // every thread has read the map values and masks it adds
    for (int t = 0; t < taps; ++t) smem[(g * taps + t) * C + cl] = acc[(t / a.kw) * MAXK + t % a.kw];
    __syncthreads();
    for (int it = threadIdx.x; it < C * taps; it += kRowsBlock) {
      const int c = it % C, t = it / C;
      float total = 0.f;
      for (int q = 0; q < G; ++q) total += smem[(q * taps + t) * C + c];
      cols_out[static_cast<int64_t>(c) * taps + t] = total;
    }
  }
  if (f.posblocks == 1) return;
  // the blocks' partial sums in two levels, each a last block's: groups of kFoldGroup
  // blocks, then the groups (a first form, one last block summing every block's and each
  // thread finding its taps itself, took 1041.8 us on ResNet-50's 19 window layers where
  // this takes 848.7 on an H100: docs/results/ab-window-fold-h100-b07805c.txt)
  const int groups = (f.posblocks + kFoldGroup - 1) / kFoldGroup, grp = bx / kFoldGroup;
  const int first = grp * kFoldGroup, count = min(kFoldGroup, f.posblocks - first);
  unsigned* const group_counters = f.counters + (s.nsplit > 1 ? f.posblocks : 0);
  float* const group_cols = f.cols + static_cast<int64_t>(f.posblocks) * K;
  if (!finished_last(group_counters + grp, count)) return;
  sum_blocks_in_order<kRowsBlock>(f.cols + first * K, count, K, smem,
                                  groups > 1 ? group_cols + static_cast<int64_t>(grp) * K : f.dst);
  if (groups == 1 || !finished_last(group_counters + groups, groups)) return;
  sum_blocks_in_order<kRowsBlock>(group_cols, groups, K, smem, f.dst);
}

// Phase 1 and its windows (WindowFold), with a gradient's rows read in the same launch
// where job.rows has blocks: a convolution's input statistics and its gradient's in one
// launch.  Two blocks an SM (the rows read's occupancy, whose registers this kernel's
// other branch must not raise).
template <typename T, int MAXK>
__global__ void __launch_bounds__(kRowsBlock, 2) sumsq_windows_and_rows_kernel(const __grid_constant__ SumsqAndRows job) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  __shared__ float smem[kRowsBlock * (V > MAXK * MAXK ? V : MAXK * MAXK) + kRowsBlock];
  const int b = static_cast<int>(blockIdx.x);
  if (b < job.sumsq_blocks) {
    sumsq_fold_block<T, MAXK>(job.sumsq, job.fold, b, smem);
  } else {
    channel_rows_block<T, RowsRead::kVector, kRowsBlock, kRowsUnroll>(job.rows, b - job.sumsq_blocks, smem);
  }
}

// The same with the gradient read channel by channel (channels in the middle: NCHW), in
// blocks of kCaptureBlock threads; channel o's split k is block sumsq_blocks + k * O + o.
template <typename T>
__global__ void __launch_bounds__(kCaptureBlock) sumsq_and_middle_kernel(const __grid_constant__ SumsqAndMiddle job) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));  // (the gradient's vector read)
  __shared__ float smem[32];
  const int b = static_cast<int>(blockIdx.x);
  if (b < job.sumsq_blocks) {
    sumsq_item_block<T, kCaptureBlock>(job.sumsq, b);
  } else {
    const int k = b - job.sumsq_blocks, O = static_cast<int>(job.middle.O);  // (k < the grid's blocks: an int)
    channel_middle_block<T, V>(job.middle, static_cast<const T*>(job.middle.t), job.nsplit, job.partials,
                               job.counters, job.dst, k % O, k / O, smem);
  }
}

// ---------------------------------------------------------------------------
// The factor update: one block per layer, kFactorMaxLayers layers per launch.
// ---------------------------------------------------------------------------
using FactorList = LaunchList<FactorItem, kFactorMaxLayers>;

static_assert(sizeof(FactorList) + 2 * sizeof(float) + sizeof(void*) <= kParamBytesClassic,
              "factor kernel arguments exceed the 4 KiB kernel-parameter budget");

__device__ __forceinline__ float map_inf(float v) {
  return v == INFINITY ? 1.f : (v == -INFINITY ? 0.f : v);
}

__device__ __forceinline__ float h_raw(const FactorItem& it, int j, float two_col_h0) {
  if (it.kind == 1) return j == 0 ? two_col_h0 : it.extra;
  if (j < it.nh) return __fmul_rn(it.h[j], it.inv_hn);
  return it.extra;
}

__device__ __forceinline__ float s_raw(const FactorItem& it, int i) {
  float v = it.s[i];
  if (it.flags & kFactorScaleS) v = __fmul_rn(v, it.inv_sscale);
  if (it.kind == 1) v = __fmul_rn(v, v);
  return __fmul_rn(v, it.inv_sn);
}

struct MinMaxNan {
  float lo, hi;
  int nan;
};

__device__ MinMaxNan block_min_max_nan(float lo, float hi, int nan, float* smem /* >= 96 */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    nan |= __shfl_xor_sync(0xffffffffu, nan, o);
  }
  __syncthreads();
  if (lane == 0) {
    smem[warp] = lo;
    smem[32 + warp] = hi;
    smem[64 + warp] = static_cast<float>(nan);
  }
  __syncthreads();
  MinMaxNan r;
  r.lo = smem[0];
  r.hi = smem[32];
  r.nan = 0;
  for (int w = 0; w < kCaptureBlock / 32; ++w) {
    r.lo = fminf(r.lo, smem[w]);
    r.hi = fmaxf(r.hi, smem[32 + w]);
    r.nan |= smem[64 + w] != 0.f;
  }
  return r;
}

// Block (layer, chunk): every chunk's block finds its layer's min / max over the whole
// vectors (the same reductions in the same order, so every block agrees), then normalises and
// folds its own kFactorChunk entries of H and S.  With one block a layer, the 50257
// divisions of an LM head's S by one SM took ~100 us on the H200.
constexpr int kFactorChunk = 4096;

__global__ void __launch_bounds__(kCaptureBlock) factor_update_kernel(FactorList list, float c_old, float c_new,
                                                                      int32_t* __restrict__ nan_flags) {
  __shared__ float smem[96];
  const FactorItem& it = list.item[blockIdx.x];
  int32_t* const nan_flag = nan_flags + list.first + blockIdx.x;
  const int nH = it.kind == 1 ? 2 : it.nh + ((it.flags & kFactorAppend) ? 1 : 0);
  const int chunk = blockIdx.y;
  const int64_t lo = static_cast<int64_t>(chunk) * kFactorChunk, hi = lo + kFactorChunk;
  if (chunk > 0 && lo >= (nH > it.ns ? nH : it.ns)) return;  // (this layer's vectors are shorter)

  float h0 = 0.f;  // two-column layers: sum h^2 * inv_hn
  if (it.kind == 1) {
    float acc = 0.f;
    for (int j = threadIdx.x; j < it.nh; j += kCaptureBlock) acc = fmaf(it.h[j], it.h[j], acc);
    h0 = __fmul_rn(block_sum(acc, smem), it.inv_hn);
  }

  // min / max (after the inf mapping) and NaN of both vectors
  float hlo = INFINITY, hhi = -INFINITY, slo = INFINITY, shi = -INFINITY;
  int nan = 0;  // a NaN in H_raw or S_raw
  for (int j = threadIdx.x; j < nH; j += kCaptureBlock) {
    const float v = h_raw(it, j, h0);
    nan |= v != v;
    const float m = map_inf(v);
    hlo = fminf(hlo, m);
    hhi = fmaxf(hhi, m);
  }
  for (int i = threadIdx.x; i < it.ns; i += kCaptureBlock) {
    const float v = s_raw(it, i);
    nan |= v != v;
    const float m = map_inf(v);
    slo = fminf(slo, m);
    shi = fmaxf(shi, m);
  }
  const MinMaxNan hr = block_min_max_nan(hlo, hhi, nan, smem);
  const MinMaxNan sr = block_min_max_nan(slo, shi, 0, smem);
  if (hr.nan) {
    if (chunk == 0 && threadIdx.x == 0) *nan_flag = 1;
    return;
  }
  if (chunk == 0 && threadIdx.x == 0) *nan_flag = 0;
  const bool init = (it.flags & kFactorInit) != 0;
  const float hd = __fadd_rn(__fsub_rn(hr.hi, hr.lo), 1e-6f);
  for (int j = static_cast<int>(lo) + threadIdx.x; j < nH && j < hi; j += kCaptureBlock) {
    const float v = __fdiv_rn(__fsub_rn(map_inf(h_raw(it, j, h0)), hr.lo), hd);
    const float old = init ? 1.f : it.H[j];
    it.H[j] = __fadd_rn(__fmul_rn(old, c_old), __fmul_rn(v, c_new));
  }
  const float sd = __fadd_rn(__fsub_rn(sr.hi, sr.lo), 1e-6f);
  for (int i = static_cast<int>(lo) + threadIdx.x; i < it.ns && i < hi; i += kCaptureBlock) {
    const float v = __fdiv_rn(__fsub_rn(map_inf(s_raw(it, i)), sr.lo), sd);
    const float old = init ? 1.f : it.S[i];
    it.S[i] = __fadd_rn(__fmul_rn(old, c_old), __fmul_rn(v, c_new));
  }
}

// A norm item's element i as float32, its dtype read per item (one launch holds items of
// several dtypes: a bf16 model's bias gradients beside float32 means).
__device__ __forceinline__ float load_as_float(const void* p, int64_t i, at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return to_float(static_cast<const c10::Half*>(p)[i]);
    case at::kBFloat16:
      return to_float(static_cast<const c10::BFloat16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// Per norm item, one warp per entry of h (lanes stride over the A * R summed values), then
// one thread per entry of s, in blocks after h's (capture_launch.h, NormItem): its units
// are norm_h_blocks + blocks_for(n_bias).
constexpr int kNormWarps = kCaptureBlock / 32;
constexpr int kNormMaxItems = 128;
using NormList = LaunchList<NormItem, kNormMaxItems, /*kRanged=*/true>;
static_assert(sizeof(NormList) <= kParamBytesLarge, "norm_stats_kernel's list exceeds the kernel-parameter budget");

__host__ __device__ __forceinline__ int64_t norm_h_blocks(const NormItem& a) {
  return (a.T + kNormWarps - 1) / kNormWarps;
}

__global__ void __launch_bounds__(kCaptureBlock) norm_stats_kernel(const __grid_constant__ NormList list) {
  const UnitOf u = unit_of_block(list, static_cast<int32_t>(blockIdx.x));
  const NormItem& a = list.item[u.slot];
  const int64_t h_blocks = norm_h_blocks(a);
  if (u.unit < h_blocks) {
    const int64_t t = static_cast<int64_t>(u.unit) * kNormWarps + threadIdx.x / 32;
    if (t >= a.T) return;  // (whole warps)
    const int64_t n = a.A * a.R;
    float acc = 0.f;
    for (int64_t i = threadIdx.x % 32; i < n; i += 32) {
      const int64_t row = i / a.R;
      acc += load_as_float(a.means, (row * a.T + t) * a.R + (i - row * a.R), a.means_dtype);
    }
    acc = warp_sum(acc);
    if (threadIdx.x % 32 == 0) a.h[t] = __fmul_rn(acc, a.mean_scale);
    return;
  }
  const int64_t i = (static_cast<int64_t>(u.unit) - h_blocks) * kCaptureBlock + threadIdx.x;
  if (i < a.n_bias) a.s[i] = load_as_float(a.bias_grad, i, a.bias_dtype);
}

// ---------------------------------------------------------------------------
// Grid sizes.
// ---------------------------------------------------------------------------
inline unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kCaptureBlock - 1) / kCaptureBlock); }

}  // namespace

ChannelRowsShape channel_rows_shape(const ChannelArgs& a, int element_size) {
  const int vec = 16 / element_size;
  const int64_t vectors = (a.O + vec - 1) / vec;
  const bool on_grid = a.O % vec == 0 && a.sa % vec == 0 && (a.P == 1 || a.sp % vec == 0) && is_aligned16(a.t);
  auto fewest_lanes = [](int64_t n) {
    int lanes = 1;
    while (lanes < 32 && lanes < n) lanes *= 2;
    return lanes;
  };
  if (on_grid) {
    const int lanes = fewest_lanes(vectors);
    return {RowsRead::kVector, lanes, (vectors + lanes - 1) / lanes};
  }
  // (fp32 rows stay one element a lane: a warp's read is then 128 bytes already, and the
  // H200 read a 4096 x 50257 fp32 gradient at 3.9 TB/s so, 3.3 realigned)
  if (vectors >= 32 && element_size < 4) return {RowsRead::kShifted, 32, (a.O + 31 * vec - 1) / (31 * vec)};
  const int lanes = fewest_lanes(a.O);
  return {RowsRead::kScalar, lanes, (a.O + lanes - 1) / lanes};
}

int channel_rows_blocks_per_sm(RowsRead read, at::ScalarType dtype) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int>, int> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  const auto key = std::make_tuple(dev, static_cast<int>(read), static_cast<int>(dtype));
  std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  const cudaError_t err = dispatch_float_dtype(dtype, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    switch (read) {
      case RowsRead::kVector:
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, channel_rows_kernel<T, RowsRead::kVector>, kRowsBlock, 0);
      case RowsRead::kShifted:
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, channel_rows_kernel<T, RowsRead::kShifted>, kRowsBlock, 0);
      default:
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, channel_rows_kernel<T, RowsRead::kScalar>, kRowsBlock, 0);
    }
  });
  if (err != cudaSuccess || n < 1) {
    (void)cudaGetLastError();  // (clear it: the next launch's check must not see it)
    n = 1;
  }
  cache.emplace(key, n);
  return n;
}

int64_t rows_slots(RowsRead read, at::ScalarType dtype) {
  return static_cast<int64_t>(capture_sm_count()) * channel_rows_blocks_per_sm(read, dtype);
}

int capture_sm_count() {
  static std::mutex mu;
  static std::vector<int> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(cache.size()) <= dev) cache.resize(dev + 1, 0);
  if (cache[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
    cache[dev] = n;
  }
  return cache[dev];
}

WindowSumsShape window_sums_shape(const ConvInputArgs& a) {
  const int64_t HW = a.H * a.W;
  if (a.groups == 1 && a.kh <= 3 && a.kw <= 3 && a.C * HW <= std::numeric_limits<int32_t>::max()) {
    if (!a.map_hwc) {  // a warp per channel, along its positions: two passes of the warp per chunk at least
      return {WindowSumsKind::kChannelWarps, 32, (a.C + kChwChannels - 1) / kChwChannels, HW, 2 * 32};
    }
    int lanes = 1;
    while (lanes < 32 && lanes < a.C) lanes *= 2;
    return {WindowSumsKind::kChannelTiles, lanes, (a.C + lanes - 1) / lanes, HW, 4 * (kCaptureBlock / lanes)};
  }
  const int64_t K = (a.C / a.groups) * a.kh * a.kw;
  return {WindowSumsKind::kColumns, 0, K, static_cast<int64_t>(a.groups) * a.Ho * a.Wo, 2048};
}

namespace {

// Whether phase 1 reads the input 16 bytes a thread (V elements): rows of whole vectors,
// 16-byte aligned.  Its own launch and a shared one decide alike.
bool sumsq_reads_vectors(const ConvInputArgs& a, int64_t M, int64_t V) {
  return M % V == 0 && a.batch_stride % V == 0 && is_aligned16(a.x);
}

// Whether channel_middle_kernel reads `a.t` 16 bytes a thread (V elements).  Its own launch
// and a shared one decide alike.
bool middle_reads_vectors(const ChannelArgs& a, int64_t V) {
  return a.P % V == 0 && a.sa % V == 0 && a.so % V == 0 && is_aligned16(a.t);
}

// Phase 2 of the conv input statistics (after phase 1 on the same stream): every kernel
// tap's window sum of the nsplit partial maps.
cudaError_t launch_window_sums(const ConvInputArgs& a, int nsplit, WindowChunks chunks, const float* maps,
                               float* ws_cols, unsigned* counters, float* out, cudaStream_t stream) {
  const WindowSumsShape shape = window_sums_shape(a);
  const int n = chunks.count(), groups = chunks.map_groups;
  if (shape.kind != WindowSumsKind::kChannelTiles && groups != 1) return cudaErrorInvalidValue;  // (positions only)
  const dim3 grid(static_cast<unsigned>(shape.blocks_x), n);
  if (shape.kind == WindowSumsKind::kColumns) {
    window_sums_kernel<<<grid, kCaptureBlock, 0, stream>>>(maps, nsplit, a, n, ws_cols, counters, out);
  } else if (shape.kind == WindowSumsKind::kChannelWarps && a.kh == 1 && a.kw == 1) {
    window_sums_chw_kernel<1><<<grid, kCaptureBlock, 0, stream>>>(maps, nsplit, a, n, ws_cols, counters, out);
  } else if (shape.kind == WindowSumsKind::kChannelWarps) {
    window_sums_chw_kernel<3><<<grid, kCaptureBlock, 0, stream>>>(maps, nsplit, a, n, ws_cols, counters, out);
  } else if (a.kh == 1 && a.kw == 1) {
    window_sums_hwc_kernel<1><<<grid, kCaptureBlock, 0, stream>>>(maps, nsplit, a, shape.lanes, n, groups, ws_cols,
                                                                  counters, out);
  } else {
    window_sums_hwc_kernel<3><<<grid, kCaptureBlock, 0, stream>>>(maps, nsplit, a, shape.lanes, n, groups, ws_cols,
                                                                  counters, out);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_conv_input_stats(const ConvInputArgs& a, at::ScalarType dtype, int nsplit, WindowChunks chunks,
                                    float* maps, float* ws_cols, unsigned* counters, float* out, cudaStream_t stream) {
  const int64_t M = a.C * a.H * a.W;
  cudaError_t err = dispatch_float_dtype(dtype, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kV = 16 / sizeof(T);
    const T* x = static_cast<const T*>(a.x);
    const bool vec = sumsq_reads_vectors(a, M, kV);
    const dim3 grid(blocks_for(vec ? M / kV : M), nsplit);
    if (vec) {
      batch_sumsq_kernel<T, kV><<<grid, kCaptureBlock, 0, stream>>>(x, a.batch_stride, a.B, M, nsplit, maps);
    } else {
      batch_sumsq_kernel<T, 1><<<grid, kCaptureBlock, 0, stream>>>(x, a.batch_stride, a.B, M, nsplit, maps);
    }
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  return launch_window_sums(a, nsplit, chunks, maps, ws_cols, counters, out, stream);
}

namespace {

// (blocks of one launch are counted in int: the kernel's block indices are)
bool fits_launch(int64_t blocks) { return blocks <= std::numeric_limits<int>::max(); }

// One of the reads that a launch of the rows kernel shares: its channel tiles, its bytes,
// the splits planned for it alone (rows_splits: the most it may take), and where its
// splits go (share_one_wave sets them).
struct SharedRead {
  int64_t tiles, bytes;
  int max_splits;
  int* nsplit;
};

int64_t rows_bytes(const ChannelArgs& a, int element_size) { return a.A * a.P * a.O * element_size; }

// The splits of the reads that one launch shares (a layer's input and its output's
// gradient; a convolution's nine border or parity sums and its gradient), planned together.
// Each read planned alone fills the device (rows_splits), so a launch of two was two waves
// of blocks, of nine sums and a gradient up to five (the parity classes), with a ramp down
// and up between them: ResNet-50's shared reads of 32-64 MB took 5-8 us more than their
// bytes at the rate of its largest (H100).  Together they fill one wave: each read's
// blocks in proportion to its bytes, so that its blocks read as much as the others' and end
// with them; the slots that whole splits leave go a split at a time to the read whose blocks
// read the most.  Never more splits than a read's own plan, whose workspace and counter
// slots the op sized (so every buffer fits), and at least one.  Where the reads' tiles
// alone fill more than a wave, each keeps one split a tile.  A read's sums are as
// deterministic as before (the splits follow from the shapes), but not bit for bit those of
// the read on its own launch, whose splits differ.
void share_one_wave(SharedRead* reads, int n, int64_t slots) {
  double total = 0.0;
  for (int i = 0; i < n; ++i) total += static_cast<double>(reads[i].bytes);
  if (!(total > 0.0)) return;
  int64_t used = 0;
  for (int i = 0; i < n; ++i) {
    SharedRead& r = reads[i];
    const double blocks = static_cast<double>(slots) * static_cast<double>(r.bytes) / total;
    const int64_t splits = static_cast<int64_t>(blocks / static_cast<double>(r.tiles));
    *r.nsplit = static_cast<int>(std::clamp<int64_t>(splits, 1, r.max_splits));
    used += r.tiles * *r.nsplit;
  }
  for (;;) {
    int most = -1;  // the read whose blocks read the most that can take one more split
    double most_bytes = 0.0;
    for (int i = 0; i < n; ++i) {
      const SharedRead& r = reads[i];
      const double per_block = static_cast<double>(r.bytes) / static_cast<double>(r.tiles * *r.nsplit);
      if (used + r.tiles <= slots && per_block > most_bytes && *r.nsplit < r.max_splits) {
        most = i;
        most_bytes = per_block;
      }
    }
    if (most < 0) return;
    ++*reads[most].nsplit;
    used += reads[most].tiles;
  }
}

// A planned reduction as an item of the rows kernel, of the shape it reads.
RowsItem rows_item(const ChannelLaunch& l, const ChannelRowsShape& shape) {
  RowsItem it{};
  it.a = l.a;
  it.lanes = shape.lanes;
  it.nsplit = l.nsplit;
  it.tiles = static_cast<int>(shape.tiles);
  it.partials = l.ws;
  it.counters = l.counters;
  it.dst = l.out;
  it.deferred = l.defer != nullptr ? 1 : 0;
  return it;
}

// Where `it` (rows_item's, its splits final) is a deferred read of more than one split:
// what its finish needs, in *l.defer.
void note_deferred(const ChannelLaunch& l, const RowsItem& it, const ChannelRowsShape& shape, int element_size) {
  if (l.defer == nullptr) return;
  l.defer->set = it.nsplit > 1 && it.tiles > 0;
  if (!l.defer->set) return;
  const int vec = shape.read == RowsRead::kScalar ? 1 : 16 / element_size;
  FinishItem& f = l.defer->item;
  f.partials = it.partials;
  f.dst = it.dst;
  f.O = it.a.O;
  f.nsplit = it.nsplit;
  f.tiles = it.tiles;
  f.width = it.lanes * vec - (shape.read == RowsRead::kShifted ? vec : 0);
  f.vec = vec;
  f.apply_post = it.a.apply_post;
  f.post_mul = it.a.post_mul;
}

template <typename T>
cudaError_t launch_rows(const RowsPair& pair, RowsRead read, cudaStream_t stream) {
  const int64_t blocks = static_cast<int64_t>(pair.first_blocks) + static_cast<int64_t>(pair.second.tiles) * pair.second.nsplit;
  if (blocks == 0) return cudaSuccess;
  if (!fits_launch(blocks)) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks));
  if (read == RowsRead::kVector) {
    channel_rows_kernel<T, RowsRead::kVector><<<grid, kRowsBlock, 0, stream>>>(pair);
  } else if (read == RowsRead::kShifted) {
    channel_rows_kernel<T, RowsRead::kShifted><<<grid, kRowsBlock, 0, stream>>>(pair);
  } else {
    channel_rows_kernel<T, RowsRead::kScalar><<<grid, kRowsBlock, 0, stream>>>(pair);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_finish_sums(const FinishItem* items, int n, cudaStream_t stream) {
  const auto tiles = [](const FinishItem& f) -> int64_t { return f.tiles; };
  return launch_items<FinishList>(items, static_cast<size_t>(n), tiles, [&](const FinishList& list, int blocks) {
    finish_sums_kernel<<<static_cast<unsigned>(blocks), kRowsBlock, 0, stream>>>(list);
    return cudaGetLastError();
  });
}

cudaError_t launch_channel_stats(const ChannelLaunch& l, cudaStream_t stream) {
  const ChannelArgs& a = l.a;
  return dispatch_float_dtype(l.dtype, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int kV = 16 / sizeof(T);
    const T* t = static_cast<const T*>(a.t);
    if (l.rows_kernel) {
      const ChannelRowsShape shape = channel_rows_shape(a, static_cast<int>(sizeof(T)));
      if (!fits_launch(shape.tiles * l.nsplit)) return cudaErrorInvalidConfiguration;
      RowsPair pair{};
      pair.first = rows_item(l, shape);
      pair.first_blocks = static_cast<int>(shape.tiles * l.nsplit);
      note_deferred(l, pair.first, shape, static_cast<int>(sizeof(T)));
      return launch_rows<T>(pair, shape.read, stream);
    }
    const bool vec = middle_reads_vectors(a, kV);
    const dim3 grid(static_cast<unsigned>(a.O), l.nsplit);
    if (vec) {
      channel_middle_kernel<T, kV><<<grid, kCaptureBlock, 0, stream>>>(a, t, l.nsplit, l.ws, l.counters, l.out);
    } else {
      channel_middle_kernel<T, 1><<<grid, kCaptureBlock, 0, stream>>>(a, t, l.nsplit, l.ws, l.counters, l.out);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_channel_stats_pair(const ChannelLaunch& x, const ChannelLaunch& y, cudaStream_t stream) {
  if (x.rows_kernel && y.rows_kernel && x.dtype == y.dtype) {
    const int size = static_cast<int>(c10::elementSize(x.dtype));
    const ChannelRowsShape sx = channel_rows_shape(x.a, size), sy = channel_rows_shape(y.a, size);
    if (sx.read == sy.read && fits_launch(sx.tiles * x.nsplit + sy.tiles * y.nsplit)) {  // one kernel reads both
      RowsPair pair{};
      pair.first = rows_item(x, sx);
      pair.second = rows_item(y, sy);
      SharedRead reads[2] = {{sx.tiles, rows_bytes(x.a, size), x.nsplit, &pair.first.nsplit},
                             {sy.tiles, rows_bytes(y.a, size), y.nsplit, &pair.second.nsplit}};
      share_one_wave(reads, 2, rows_slots(sx.read, x.dtype));
      pair.first_blocks = static_cast<int>(sx.tiles * pair.first.nsplit);
      note_deferred(x, pair.first, sx, size);
      note_deferred(y, pair.second, sy, size);
      return dispatch_float_dtype(x.dtype, [&](auto* tag) -> cudaError_t {
        return launch_rows<std::remove_pointer_t<decltype(tag)>>(pair, sx.read, stream);
      });
    }
  }
  const cudaError_t err = launch_channel_stats(x, stream);
  if (err != cudaSuccess) return err;
  return launch_channel_stats(y, stream);
}

bool border_taps_fit(const ConvInputArgs& a, int element_size) {
  const int64_t V = 16 / element_size;
  if (!(a.map_hwc && a.groups == 1 && a.kh == 3 && a.kw == 3 && a.dh == 1 && a.dw == 1 && a.pt == 1 && a.pl == 1 &&
        a.B > 0 && a.C > 0 && a.H > 0 && a.W > 0 && a.C % V == 0 && is_aligned16(a.x)))
    return false;
  if (a.sh == 1 && a.sw == 1) return a.Ho == a.H && a.Wo == a.W && (a.B == 1 || a.batch_stride % V == 0);
  // (parity sums: the classes' rows merge the batch with the map's rows)
  return a.sh == 2 && a.sw == 2 && a.H % 2 == 0 && a.W % 2 == 0 && a.Ho == a.H / 2 && a.Wo == a.W / 2 &&
         (a.B == 1 || a.batch_stride == a.H * a.W * a.C);
}

int border_args(const ConvInputArgs& a, int element_size, ChannelArgs (&out)[kBorderSums]) {
  const char* x = static_cast<const char*>(a.x);
  const int64_t C = a.C, row = a.W * a.C, batch = a.B == 1 ? a.H * row : a.batch_stride;
  const int64_t down = (a.H - 1) * row, right = (a.W - 1) * C;  // (elements)
  struct Read {
    int64_t offset, A, sa, P, sp;
  };
  const int parity = a.sh == 2 ? 1 : 0;
  const int64_t B = a.B, H2 = a.H / 2, W2 = a.W / 2;
  const Read border[kBorderSums] = {
      {0, B, batch, a.H * a.W, C},     // every position
      {0, B, batch, a.W, C},           // the top row
      {down, B, batch, a.W, C},        // the bottom row
      {0, B, batch, a.H, row},         // the left column
      {right, B, batch, a.H, row},     // the right column
      {0, B, batch, 1, C},             // top-left
      {right, B, batch, 1, C},         // top-right
      {down, B, batch, 1, C},          // bottom-left
      {down + right, B, batch, 1, C},  // bottom-right
  };
  const Read classes[kBorderSums] = {
      {0, B * H2, 2 * row, W2, 2 * C},          // even rows x even columns
      {C, B * H2, 2 * row, W2, 2 * C},          // even x odd
      {row, B * H2, 2 * row, W2, 2 * C},        // odd x even
      {row + C, B * H2, 2 * row, W2, 2 * C},    // odd x odd
      {down, B, batch, W2, 2 * C},              // the last row's even columns
      {down + C, B, batch, W2, 2 * C},          // its odd columns
      {right, B * H2, 2 * row, 1, C},           // the last column's even rows
      {row + right, B * H2, 2 * row, 1, C},     // its odd rows
      {down + right, B, batch, 1, C},           // the last corner
  };
  for (int k = 0; k < kBorderSums; ++k) {
    const Read& r = parity ? classes[k] : border[k];
    ChannelArgs& c = out[k];
    c = ChannelArgs{};
    c.t = x + r.offset * element_size;
    c.A = r.A;
    c.sa = r.sa;
    c.P = r.P;
    c.sp = r.sp;
    c.O = C;
    c.so = 1;
    c.square = 1;
    c.apply_post = 0;
    c.post_mul = 1.0f;
  }
  return parity;
}

BorderLayout border_layout(const BorderLaunch& l, int64_t tiles) {
  BorderLayout out{};
  out.floats = kBorderSums * l.a[0].O;
  for (int k = 0; k < kBorderSums; ++k) {
    out.partials[k] = out.counters[k] = -1;
    if (l.nsplit[k] > 1) {
      out.partials[k] = out.floats;
      out.counters[k] = out.slots;
      out.floats += static_cast<int64_t>(l.nsplit[k]) * l.a[k].O;
      out.slots += tiles;
    }
  }
  out.tap_counters = out.slots;
  out.slots += tiles;
  return out;
}

namespace {

// The blocks of a border launch (with g's rows read where g is not null), or 0 where one
// kernel does not read them all (a border read off the 16-byte grid or of another tiling,
// g of another dtype or not the rows kernel's 16-byte read) or the grid is too large.  Its
// check and its launch decide alike.
int64_t border_blocks(const BorderLaunch& l, const ChannelLaunch* g) {
  const int size = static_cast<int>(c10::elementSize(l.dtype));
  const ChannelRowsShape first = channel_rows_shape(l.a[0], size);
  int64_t blocks = 0;
  for (int k = 0; k < kBorderSums; ++k) {
    const ChannelRowsShape s = channel_rows_shape(l.a[k], size);
    if (s.read != RowsRead::kVector || s.tiles != first.tiles || s.lanes != first.lanes || l.nsplit[k] < 1) return 0;
    blocks += s.tiles * l.nsplit[k];
  }
  if (g != nullptr) {
    if (g->dtype != l.dtype || !g->rows_kernel) return 0;
    const ChannelRowsShape sg = channel_rows_shape(g->a, size);
    if (sg.read != RowsRead::kVector) return 0;
    blocks += sg.tiles * g->nsplit;
  }
  return fits_launch(blocks) ? blocks : 0;
}

}  // namespace

bool border_reads_with(const BorderLaunch& l, const ChannelLaunch& g) { return border_blocks(l, &g) > 0; }

cudaError_t launch_border_taps(const BorderLaunch& planned, const ChannelLaunch* g_planned, cudaStream_t stream) {
  if (border_blocks(planned, g_planned) == 0) return cudaErrorInvalidValue;
  const int size = static_cast<int>(c10::elementSize(planned.dtype));
  const int64_t tiles = channel_rows_shape(planned.a[0], size).tiles;
  // the reads' splits planned together (share_one_wave); the workspace and the counter
  // slots, sized for the plan's splits, hold the fewer (border_layout's parts only shrink)
  BorderLaunch l = planned;
  ChannelLaunch g_shared{};
  const ChannelLaunch* g = nullptr;
  SharedRead reads[kBorderItems];
  int n = 0;
  for (int k = 0; k < kBorderSums; ++k) reads[n++] = {tiles, rows_bytes(l.a[k], size), l.nsplit[k], &l.nsplit[k]};
  if (g_planned != nullptr) {
    g_shared = *g_planned;
    g = &g_shared;
    reads[n++] = {channel_rows_shape(g->a, size).tiles, rows_bytes(g->a, size), g->nsplit, &g_shared.nsplit};
  }
  share_one_wave(reads, n, rows_slots(RowsRead::kVector, l.dtype));
  const int64_t blocks = border_blocks(l, g);
  BorderTaps job{};
  const BorderLayout layout = border_layout(l, tiles);
  int start = 0;
  for (int k = 0; k < kBorderSums; ++k) {
    const ChannelRowsShape s = channel_rows_shape(l.a[k], size);
    RowsItem& it = job.items[k];
    it.a = l.a[k];
    it.lanes = s.lanes;
    it.nsplit = l.nsplit[k];
    it.tiles = static_cast<int>(s.tiles);
    it.dst = l.ws + k * l.a[k].O;
    if (it.nsplit > 1) {
      it.partials = l.ws + layout.partials[k];
      it.counters = l.counters + layout.counters[k];
    }
    job.starts[k] = start;
    start += it.tiles * it.nsplit;
  }
  job.parity = l.parity;
  job.tile_counters = l.counters + layout.tap_counters;
  job.out = l.out;
  job.starts[kBorderSums] = start;
  if (g != nullptr) {
    const ChannelRowsShape sg = channel_rows_shape(g->a, size);
    job.items[kBorderSums] = rows_item(*g, sg);
    start += static_cast<int>(sg.tiles * g->nsplit);
  } else {
    job.items[kBorderSums].tiles = 1;  // (no blocks: never read)
  }
  job.starts[kBorderItems] = start;
  return dispatch_float_dtype(l.dtype, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    border_taps_kernel<T><<<static_cast<unsigned>(blocks), kRowsBlock, 0, stream>>>(job);
    return cudaGetLastError();
  });
}

namespace {

// Phase 1's blocks of `threads` threads along M, 16 bytes a thread.
int64_t sumsq_blocks_x(int64_t M, int element_size, int threads) {
  const int64_t vectors = M / (16 / element_size);
  return (vectors + threads - 1) / threads;
}

// Phase 1's part of a shared launch whose blocks have `threads` threads.
SumsqItem sumsq_item(const ConvInputArgs& a, int nsplit, float* maps, int element_size, int threads) {
  SumsqItem it{};
  it.x = a.x;
  it.batch_stride = a.batch_stride;
  it.B = a.B;
  it.M = a.C * a.H * a.W;
  it.nsplit = nsplit;
  it.blocks_x = static_cast<int>(sumsq_blocks_x(it.M, element_size, threads));
  it.maps = maps;
  return it;
}

// The blocks of the shared launch, or 0 where one kernel does not read both: phase 1 reads
// 16 bytes a thread (an input of the gradient's dtype, rows of whole vectors), and the
// gradient's read is the rows kernel's 16-byte read or channel_middle's vector read.
int64_t paired_blocks(const ConvInputArgs& a, at::ScalarType dtype, int nsplit, const ChannelLaunch& g) {
  if (g.dtype != dtype) return 0;
  const int size = static_cast<int>(c10::elementSize(dtype));
  const int64_t M = a.C * a.H * a.W, V = 16 / size;
  if (M == 0 || a.B == 0 || !sumsq_reads_vectors(a, M, V)) return 0;
  int64_t blocks = 0;
  if (g.rows_kernel) {
    const ChannelRowsShape sg = channel_rows_shape(g.a, size);
    if (sg.read != RowsRead::kVector) return 0;
    blocks = sumsq_blocks_x(M, size, kRowsBlock) * nsplit + sg.tiles * g.nsplit;
  } else {
    if (!middle_reads_vectors(g.a, V)) return 0;
    blocks = sumsq_blocks_x(M, size, kCaptureBlock) * nsplit + g.a.O * g.nsplit;
  }
  return fits_launch(blocks) ? blocks : 0;
}

}  // namespace

bool conv_pairs_with_gradient(const ConvInputArgs& a, at::ScalarType dtype, int nsplit, const ChannelLaunch& g) {
  return paired_blocks(a, dtype, nsplit, g) > 0;
}

cudaError_t launch_conv_input_stats_with_gradient(const ConvInputArgs& a, at::ScalarType dtype, int nsplit,
                                                  WindowChunks chunks, float* maps, float* ws_cols, unsigned* counters,
                                                  float* out, const ChannelLaunch& g, cudaStream_t stream) {
  const int64_t blocks = paired_blocks(a, dtype, nsplit, g);
  if (blocks == 0) return cudaErrorInvalidValue;
  const int size = static_cast<int>(c10::elementSize(dtype));
  const cudaError_t err = dispatch_float_dtype(dtype, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (g.rows_kernel) {
      SumsqAndRows job{};
      job.sumsq = sumsq_item(a, nsplit, maps, size, kRowsBlock);
      job.sumsq_blocks = job.sumsq.blocks_x * nsplit;
      job.rows = rows_item(g, channel_rows_shape(g.a, size));
      sumsq_and_rows_kernel<T><<<static_cast<unsigned>(blocks), kRowsBlock, 0, stream>>>(job);
    } else {
      SumsqAndMiddle job{};
      job.sumsq = sumsq_item(a, nsplit, maps, size, kCaptureBlock);
      job.sumsq_blocks = job.sumsq.blocks_x * nsplit;
      job.middle = g.a;
      job.nsplit = g.nsplit;
      job.partials = g.ws;
      job.counters = g.counters;
      job.dst = g.out;
      sumsq_and_middle_kernel<T><<<static_cast<unsigned>(blocks), kCaptureBlock, 0, stream>>>(job);
    }
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  return launch_window_sums(a, nsplit, chunks, maps, ws_cols, counters, out, stream);
}

int window_fold_side(const ConvInputArgs& a, int element_size) {
  const int64_t V = 16 / element_size, E = kRowsBlock * V, C = a.C, M = a.C * a.H * a.W;
  if (!a.map_hwc || a.groups != 1 || a.kh > 3 || a.kw > 3 || C < 1 || M > std::numeric_limits<int32_t>::max()) return 0;
  if (V < 4 || M == 0 || a.B == 0 || !sumsq_reads_vectors(a, M, V)) return 0;  // (16-byte reads, float4 map sums)
  // whole positions in each of phase 1's blocks, at most one a thread (C >= V), and its
  // threads laid over whole channels
  const bool whole = C <= kRowsBlock ? kRowsBlock % C == 0 && C >= V : C % kRowsBlock == 0 && E % C == 0;
  if (!whole) return 0;
  // and a block's partial window sums (C * taps) at most half its map values: on an H100
  // in a ResNet-50 capture step, folding its 64- and 128-channel 3 x 3 layers and its 1 x 1
  // strided ones (partial sums 0.06 to 0.28 times the map values) took 4-16 us a layer off
  // their two launches, while its 256- and 512-channel 3 x 3 layers (0.56 and 1.1 times:
  // the last blocks read them again) took as long, or up to 12 us longer
  // (docs/results/ab-window-fold-h100-b07805c.txt)
  if (C * a.kh * a.kw * 2 > E) return 0;
  return a.kh == 1 && a.kw == 1 ? 1 : 3;
}

int64_t window_fold_blocks_x(const ConvInputArgs& a, int element_size) {
  return sumsq_blocks_x(a.C * a.H * a.W, element_size, kRowsBlock);
}

int64_t window_fold_slots(const ConvInputArgs& a, int element_size, int nsplit) {
  const int64_t blocks_x = window_fold_blocks_x(a, element_size);
  const int64_t groups = (blocks_x + kFoldGroup - 1) / kFoldGroup;
  return (nsplit > 1 ? blocks_x : 0) + (blocks_x > 1 ? groups : 0) + (groups > 1 ? 1 : 0);
}

int64_t window_fold_cols(const ConvInputArgs& a, int element_size) {
  const int64_t blocks_x = window_fold_blocks_x(a, element_size);
  const int64_t groups = (blocks_x + kFoldGroup - 1) / kFoldGroup, K = (a.C / a.groups) * a.kh * a.kw;
  return blocks_x > 1 ? (blocks_x + (groups > 1 ? groups : 0)) * K : 0;
}

namespace {

// The blocks of a folded launch (with g's rows read where g is not null), or 0 where the
// input does not fold, one kernel does not read both (g of another dtype, or not the rows
// kernel's 16-byte read) or the grid is too large.  Its check and its launch decide alike.
int64_t folded_blocks(const ConvInputArgs& a, at::ScalarType dtype, int nsplit, const ChannelLaunch* g) {
  const int size = static_cast<int>(c10::elementSize(dtype));
  if (window_fold_side(a, size) == 0) return 0;
  int64_t blocks = window_fold_blocks_x(a, size) * nsplit;
  if (g != nullptr) {
    if (g->dtype != dtype || !g->rows_kernel) return 0;
    const ChannelRowsShape sg = channel_rows_shape(g->a, size);
    if (sg.read != RowsRead::kVector) return 0;
    blocks += sg.tiles * g->nsplit;
  }
  return fits_launch(blocks) ? blocks : 0;
}

}  // namespace

bool conv_folds_with_gradient(const ConvInputArgs& a, at::ScalarType dtype, int nsplit, const ChannelLaunch& g) {
  return folded_blocks(a, dtype, nsplit, &g) > 0;
}

cudaError_t launch_conv_input_stats_folded(const ConvInputArgs& a, at::ScalarType dtype, int nsplit, float* maps,
                                           float* cols, unsigned* counters, float* out, const ChannelLaunch* g,
                                           cudaStream_t stream) {
  const int64_t blocks = folded_blocks(a, dtype, nsplit, g);
  if (blocks == 0) return cudaErrorInvalidValue;
  const int size = static_cast<int>(c10::elementSize(dtype));
  const int side = window_fold_side(a, size);
  SumsqAndRows job{};
  job.sumsq = sumsq_item(a, nsplit, maps, size, kRowsBlock);
  job.sumsq_blocks = job.sumsq.blocks_x * nsplit;
  job.fold = {a, job.sumsq.blocks_x, cols, counters, out};
  if (g != nullptr) job.rows = rows_item(*g, channel_rows_shape(g->a, size));
  return dispatch_float_dtype(dtype, [&](auto* tag) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (side == 1) {
      sumsq_windows_and_rows_kernel<T, 1><<<static_cast<unsigned>(blocks), kRowsBlock, 0, stream>>>(job);
    } else {
      sumsq_windows_and_rows_kernel<T, 3><<<static_cast<unsigned>(blocks), kRowsBlock, 0, stream>>>(job);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_factor_update(const FactorItem* items, int n, float c_old, float c_new, int32_t* nan_flags,
                                 cudaStream_t stream) {
  int64_t longest = 1;  // entries of the longest H or S: the chunks along the grid's y
  for (int i = 0; i < n; ++i) {
    const FactorItem& it = items[i];
    const int64_t nH = it.kind == 1 ? 2 : it.nh + ((it.flags & kFactorAppend) ? 1 : 0);
    longest = std::max<int64_t>(longest, std::max<int64_t>(nH, it.ns));
  }
  const unsigned chunks = static_cast<unsigned>((longest + kFactorChunk - 1) / kFactorChunk);
  return launch_items<FactorList>(items, static_cast<size_t>(n), OneUnitEach{}, [&](const FactorList& list, int layers) {
    factor_update_kernel<<<dim3(layers, chunks), kCaptureBlock, 0, stream>>>(list, c_old, c_new, nan_flags);
    return cudaGetLastError();
  });
}

cudaError_t launch_norm_stats(const NormItem* items, int n, cudaStream_t stream) {
  auto units = [](const NormItem& a) { return norm_h_blocks(a) + static_cast<int64_t>(blocks_for(a.n_bias)); };
  return launch_items<NormList>(items, static_cast<size_t>(n), units, [&](const NormList& list, int blocks) {
    norm_stats_kernel<<<static_cast<unsigned>(blocks), kCaptureBlock, 0, stream>>>(list);
    return cudaGetLastError();
  });
}

}  // namespace lightning_cafin
