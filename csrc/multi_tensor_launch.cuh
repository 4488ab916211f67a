// Chunked multi-tensor launches: the by-value metadata of one launch and the loop that
// fills it, kept apart from any kernel's math (as torch's MultiTensorApply.cuh does).
//
// A caller has a list of items (one small struct per tensor or layer: whatever its kernel
// needs to know about it).  Each item is cut into work units (its chunks), and every unit
// is one CUDA block.  A launch's metadata, LaunchList, is a struct passed by value as a
// kernel argument: the launch needs no device memory of its own (CUDA-graph capturable,
// nothing to allocate) and a new launch starts only when the struct is full, in items or
// in blocks.  An item whose chunks do not all fit continues in slot 0 of the next launch.
//
// LaunchList<Item, kMaxItems, kMaxBlocks>: a block finds its (slot, chunk) in the block
// map.  LaunchList<Item, kMaxItems> (no block map): every item is a single unit, the
// items of a launch are the caller's items [first, first + count) in order, and the launch
// lays its grid over them as it likes (one block per item, one thread per item, ...).
//
// Host code here never throws: launch_items() returns the first launch's error for the
// g++-compiled op to raise (an exception thrown from nvcc-compiled host code crashed the
// process on the GPU machine's toolchain).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace lightning_cafin {

// Kernel-parameter budgets in bytes, with room under the limits: 4096 bytes on every
// device, 32764 since CUDA 12.1 on Volta and later ("large kernel parameters").  Each
// kernel checks its arguments against one of them with a static_assert.
constexpr size_t kParamBytesClassic = 4000;
constexpr size_t kParamBytesLarge = 32000;

// Which (slot, chunk) each block of a launch works on.
template <int kMaxBlocks, int kMaxItems>
struct BlockMap {
  using Slot = std::conditional_t<(kMaxItems <= 256), uint8_t, uint16_t>;
  static_assert(kMaxItems <= 65536, "slot index is at most 16 bits");
  int32_t chunk[kMaxBlocks];
  Slot slot[kMaxBlocks];
  void record(int block, int s, int64_t c) {
    slot[block] = static_cast<Slot>(s);
    chunk[block] = static_cast<int32_t>(c);
  }
};

// No block map: one unit per item.
template <int kMaxItems>
struct BlockMap<0, kMaxItems> {
  void record(int, int, int64_t) {}
};

template <typename Item, int kMaxItems, int kMaxBlocks = 0>
struct LaunchList {
  static constexpr int kItems = kMaxItems;
  // units (blocks, when mapped) one launch holds
  static constexpr int kUnits = kMaxBlocks > 0 ? kMaxBlocks : kMaxItems;
  static constexpr bool kMapped = kMaxBlocks > 0;

  Item item[kMaxItems];
  int32_t count;  // slots filled in this launch
  int32_t first;  // the caller's index of item[0]
  BlockMap<kMaxBlocks, kMaxItems> blocks;
};

// Hands launch(list, units) -> cudaError_t every launch's worth of items[0, n), in order.
// chunks_of(item) -> int64_t: the item's units (0 skips it; at most 1 for an unmapped list).
// Returns the first error a launch returned (no later launch is made) or cudaSuccess.
template <typename List, typename Item, typename ChunksOf, typename Launch>
cudaError_t launch_items(const Item* items, size_t n, ChunksOf&& chunks_of, Launch&& launch) {
  List list;
  list.count = 0;
  list.first = 0;
  int slot = 0;   // slot the next item goes to
  int units = 0;  // units recorded in this launch
  for (size_t k = 0; k < n; ++k) {
    const int64_t chunks = chunks_of(items[k]);
    if (chunks == 0) continue;
    list.item[slot] = items[k];
    if (slot == 0) list.first = static_cast<int32_t>(k);
    for (int64_t c = 0; c < chunks; ++c) {
      list.blocks.record(units, slot, c);
      ++units;
      const bool last_chunk = c == chunks - 1;
      // an item counts towards the item limit once all its chunks are recorded
      const bool items_full = last_chunk && slot + 1 == List::kItems;
      if (units == List::kUnits || items_full) {
        list.count = slot + 1;
        const cudaError_t err = launch(static_cast<const List&>(list), units);
        if (err != cudaSuccess) return err;
        units = 0;
        if (last_chunk) {
          slot = -1;  // the next item starts at slot 0
        } else {
          list.item[0] = items[k];  // the rest of this item continues in slot 0
          list.first = static_cast<int32_t>(k);
          slot = 0;
        }
      }
    }
    ++slot;
  }
  if (units == 0) return cudaSuccess;
  list.count = slot;
  return launch(static_cast<const List&>(list), units);
}

// One unit per item: for unmapped lists.
struct OneUnitEach {
  template <typename Item>
  int64_t operator()(const Item&) const {
    return 1;
  }
};

}  // namespace lightning_cafin
