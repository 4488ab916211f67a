// Multi-tensor launches: the by-value metadata of one launch and the loop that fills it,
// kept apart from any kernel's math (as torch's MultiTensorApply.cuh does).
//
// A caller has a list of items (one small struct per tensor or layer: whatever its kernel
// needs to know about it).  Each item is cut into work units (its chunks), and every unit
// is one CUDA block.  A launch's metadata, LaunchList, is a struct passed by value as a
// kernel argument: the launch needs no device memory of its own (CUDA-graph capturable,
// nothing to allocate) and a new launch starts only when the struct is full of items.
//
// LaunchList<Item, kMaxItems, /*kRanged=*/true>: items of any number of units.  The list
// records where each slot's units begin (unit_start, increasing); a block finds its slot
// by binary search over them (unit_of_block).  A launch is cut only between items, so an
// item never spans launches, and a launch has as many blocks as its items have units.
// The block map this replaced (one (slot, chunk) entry per block, 5 bytes each) capped a
// launch at 1024 blocks and 32 tensors: a 163M-parameter GPT's step took 5 launches and
// each launch boundary cost ~30 us of drained waves (H200).
//
// LaunchList<Item, kMaxItems> (not ranged): every item is a single unit, the items of a
// launch are the caller's items [first, first + count) in order, and the launch lays its
// grid over them as it likes (one block per item, one thread per item, ...).
//
// Host code here never throws: launch_items() returns the first launch's error for the
// g++-compiled op to raise (an exception thrown from nvcc-compiled host code crashed the
// process on the GPU machine's toolchain).
#pragma once

#include <cuda_runtime_api.h>

#include <climits>
#include <cstddef>
#include <cstdint>

namespace lightning_cafin {

// Kernel-parameter budgets in bytes, with room under the limits: 4096 bytes on every
// device, 32764 since CUDA 12.1 on Volta and later ("large kernel parameters").  Each
// kernel checks its arguments against one of them with a static_assert.
constexpr size_t kParamBytesClassic = 4000;
constexpr size_t kParamBytesLarge = 32000;

// Where each slot's units begin, for a ranged list.
template <int kMaxItems, bool kRanged>
struct UnitStarts {
  int32_t start[kMaxItems];
  void record(int slot, int32_t unit) { start[slot] = unit; }
};

// Not ranged: one unit per item, nothing to record.
template <int kMaxItems>
struct UnitStarts<kMaxItems, false> {
  void record(int, int32_t) {}
};

template <typename Item, int kMaxItems, bool kRanged = false>
struct LaunchList {
  static constexpr int kItems = kMaxItems;
  static constexpr bool kIsRanged = kRanged;

  Item item[kMaxItems];
  int32_t count;  // slots filled in this launch
  int32_t first;  // the caller's index of item[0]
  UnitStarts<kMaxItems, kRanged> units;
};

// The block's place in a ranged launch: its item's slot, and which of that item's units
// it is.  Every thread of a block reads the same entries (a broadcast), log2(count) reads.
struct UnitOf {
  int slot;
  int32_t unit;
};

template <typename List>
__device__ __forceinline__ UnitOf unit_of_block(const List& list, int32_t block) {
  static_assert(List::kIsRanged, "unit_of_block needs a ranged LaunchList");
  int lo = 0, hi = list.count - 1;  // the last slot whose start <= block
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (list.units.start[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {lo, block - list.units.start[lo]};
}

// Hands launch(list, units) -> cudaError_t every launch's worth of items[0, n), in order.
// chunks_of(item) -> int64_t: the item's units (0 skips it; at most 1 for a list that is
// not ranged).  A launch ends when its slots are full or one more item would take it past
// the grid's INT_MAX blocks.  Returns the first error a launch returned (no later launch
// is made), cudaErrorInvalidValue for an item of more units than one grid holds, or
// cudaSuccess.
template <typename List, typename Item, typename ChunksOf, typename Launch>
cudaError_t launch_items(const Item* items, size_t n, ChunksOf&& chunks_of, Launch&& launch) {
  List list;
  list.count = 0;
  list.first = 0;
  int64_t units = 0;  // units recorded in this launch
  for (size_t k = 0; k < n; ++k) {
    const int64_t chunks = chunks_of(items[k]);
    if (chunks == 0) continue;
    if (chunks > INT_MAX || (!List::kIsRanged && chunks != 1)) return cudaErrorInvalidValue;
    if (list.count == List::kItems || units + chunks > INT_MAX) {
      const cudaError_t err = launch(static_cast<const List&>(list), static_cast<int>(units));
      if (err != cudaSuccess) return err;
      list.count = 0;
      units = 0;
    }
    if (list.count == 0) list.first = static_cast<int32_t>(k);
    list.item[list.count] = items[k];
    list.units.record(list.count, static_cast<int32_t>(units));
    ++list.count;
    units += chunks;
  }
  if (units == 0) return cudaSuccess;
  return launch(static_cast<const List&>(list), static_cast<int>(units));
}

// One unit per item: for lists that are not ranged.
struct OneUnitEach {
  template <typename Item>
  int64_t operator()(const Item&) const {
    return 1;
  }
};

}  // namespace lightning_cafin
