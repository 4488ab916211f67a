// Host/device boundary of the factor-capture kernels: plain structs and launchers.
//
// The ops (argument checks, layout canonicalisation, workspace allocation) live in the
// g++-compiled capture_ops.cpp; capture_stats.cu holds only kernels and launchers, which
// throw nothing and return the launch's cudaError_t for the .cpp to check (an exception
// thrown from nvcc-compiled host code crashed the process on the GPU machine).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace lightning_cafin {

// Threads per block of every capture kernel.
constexpr int kCaptureBlock = 256;
// Threads per block of the channels-innermost kernel, and rows each thread keeps in
// flight.  Measured on the H200 over ResNet and GPT shapes (bf16, 13-206 MB): 512 x 4 at
// two blocks per SM read at 2.1-2.9 TB/s, against 1.6-2.1 for 256 x 8 (the same bytes in
// flight, half the warps to hide latency) and 1.9-2.4 for 256 x 4 at four blocks per SM
// (twice the splits for the last block to sum).  With the loads held as bytes until summed
// (54 registers, still two blocks an SM) 512 x 4 reads 100-820 MB shapes at 3.1-3.8 TB/s,
// and 512 x 8 (64 registers) was within 3% of it.
constexpr int kRowsBlock = 512;
constexpr int kRowsUnroll = 4;
// Rows (batch rows of the conv input map, channel rows of the channels-in-the-middle
// kernel) whose 16-byte loads each thread issues before summing any of them.
constexpr int kRowsInFlight = 4;
// Layers per launch of the factor-update kernel (its by-value list, multi_tensor_launch.cuh).
constexpr int kFactorMaxLayers = 56;

// ---------------------------------------------------------------------------
// Conv2d input statistics.
//
// Phase 1 sums x^2 over the batch into an fp32 map of the per-sample block: x is read
// as B rows of M = C*H*W elements, row b at x + b*batch_stride, each row dense in either
// (C, H, W) order (map_hwc = 0) or (H, W, C) order (map_hwc = 1, channels_last).  With
// nsplit > 1 the batch is cut into nsplit ranges whose partial maps go to a workspace
// and are summed in a fixed order.  Phase 2 sums, for every weight column
// (c, ki, kj) of one group, the map under that kernel tap over every group and output
// position (zeros padding: taps outside the input add nothing).
// ---------------------------------------------------------------------------
struct ConvInputArgs {
  const void* x;
  int64_t batch_stride;
  int64_t B, C, H, W;
  int map_hwc;
  int kh, kw, sh, sw, pt, pl, dh, dw, groups, Ho, Wo;
};

// Phase 2's grid along x.  With one group and kernels of at most 3 x 3, every map value
// is read once and added to each tap covering it: for maps in (H, W, C) order one block
// per tile of `lanes` channels side by side (kChannelTiles), for maps in (C, H, W) order
// one warp per channel along its positions (kChannelWarps, eight channels a block).
// Otherwise one block per weight column (kColumns), which reads the map once per tap.
// Chunks along y cut the output positions (per column) or the map's positions (per
// channel; for kChannelTiles then the split maps too, WindowChunks); the host sizes them
// from `work`, the positions a block row reads, at least `per_chunk` each.
enum class WindowSumsKind { kColumns, kChannelTiles, kChannelWarps };
struct WindowSumsShape {
  WindowSumsKind kind;
  int lanes;
  int64_t blocks_x;
  int64_t work;
  int64_t per_chunk;
};
WindowSumsShape window_sums_shape(const ConvInputArgs& a);

// Phase 2's chunks along y: `positions` ranges of the positions, each cut into
// `map_groups` ranges of the nsplit batch-split maps (only kChannelTiles cuts the maps; on
// an H100 cutting them too made kChannelWarps 1.5% slower in a ResNet-18's capture step,
// where it made kChannelTiles 10% faster).  Chunk y reads position range y / map_groups
// of map range y % map_groups (even cuts); the chunks' partial sums are added in y order,
// so each sum is the same for a given plan, whichever block finishes last.  Cutting the
// maps is what keeps a small map busy: a ResNet-18's bf16 256-channel 8 x 8 input at
// batch 256 leaves 33 split maps, which 16 blocks would read otherwise (135 KB each).
struct WindowChunks {
  int positions = 1;
  int map_groups = 1;
  int count() const { return positions * map_groups; }
};

// maps: nsplit * C*H*W floats (the batch-split partial maps, summed in split order by
// phase 2); ws_cols: chunks.count() * K floats and counters: K zeroed slots (K = C/groups
// * kh * kw, at least window_sums_shape's blocks_x), both unused when chunks.count() == 1;
// out: K floats.  Two launches.
cudaError_t launch_conv_input_stats(const ConvInputArgs& a, at::ScalarType dtype, int nsplit,
                                    WindowChunks chunks, float* maps, float* ws_cols, unsigned* counters,
                                    float* out, cudaStream_t stream);

// ---------------------------------------------------------------------------
// Per-channel statistics: out[o] = post_mul * sum_{a, p} f(t[a*sa + o*so + p*sp]),
// f = square or identity.  Requires so == 1 (channels innermost: the "rows" kernel) or
// sp == 1 with P > 1 (the "middle" kernel).  nsplit > 1: partial sums to ws
// (nsplit * O floats), summed in split order by the block that finishes last, which
// needs O zeroed counter slots.  One launch.
//
// Counter slots are zero at rest: each launch's last block resets the ones it used, so
// slots can be reused by any later launch on the same stream (never by two streams).
// ---------------------------------------------------------------------------
struct ChannelArgs {
  const void* t;
  int64_t A, O, P;
  int64_t sa, so, sp;
  int square;
  int apply_post;
  float post_mul;
};

// How the channels-innermost kernel reads a row (capture_stats.cu says more): 16-byte
// loads on the grid (kVector), 16-byte loads realigned across lanes for wide 2-byte rows
// off the grid (kShifted), or one element a lane for the other rows off it (kScalar).
enum class RowsRead { kVector, kShifted, kScalar };

// Its grid for a.t's rows: `lanes` threads per row (a power of two, at most 32) and
// `tiles` blocks along the channels.  The op plans its splits and the launcher launches
// from this one answer.
struct ChannelRowsShape {
  RowsRead read;
  int lanes;
  int64_t tiles;
};
ChannelRowsShape channel_rows_shape(const ChannelArgs& a, int element_size);
// How many of its blocks of kRowsBlock threads an SM of the current device holds at once
// (its registers decide: measured by the runtime, cached); 1 if that cannot be asked.
int channel_rows_blocks_per_sm(RowsRead read, at::ScalarType dtype);
// The blocks of the rows kernel the current device holds at once (one wave): its SMs times
// channel_rows_blocks_per_sm.  A read planned alone takes this many splits at most, and the
// reads that share a launch share this many.
int64_t rows_slots(RowsRead read, at::ScalarType dtype);

// One tensor's reduction in a launch of the rows kernel: its arguments, the lanes of its
// shape, its splits and channel tiles, its workspace (nsplit x O partials), counter slots
// (one per tile) and output.  An item of no tiles has no blocks.  A `deferred` item of
// more than one split writes its partials only: a later finish_sums launch sums them.
struct RowsItem {
  ChannelArgs a;
  int lanes;
  int nsplit;
  int tiles;
  int deferred;
  float* partials;
  unsigned* counters;
  float* dst;
};

// A deferred read's last step (RowsItem.deferred): its `tiles` tiles of `width` channels
// of O, each the sum of `nsplit` rows of partials in the order the rows kernel's last
// block sums them (the same floats), times post_mul where apply_post, into dst.  `vec` is
// the read's elements per lane (1, 4 or 8): the sums' grouping follows it.
struct FinishItem {
  const float* partials;
  float* dst;
  int64_t O;
  int nsplit, tiles, width, vec, apply_post;
  float post_mul;
};
// Every item's sums in launches of finish_sums_kernel, a block per tile, on `stream`.
cudaError_t launch_finish_sums(const FinishItem* items, int n, cudaStream_t stream);

// A launch of the rows kernel: blocks [0, first_blocks) are the first item's, the rest
// the second's (an empty second item for a launch of one tensor).
struct RowsPair {
  RowsItem first, second;
  int first_blocks;
};

// A 3 x 3 convolution with padding 1 (one group, no dilation) on an input whose channels
// are innermost (channels_last) takes its nine taps' window sums of x^2 from nine
// per-channel sums of squares, rows reads (ChannelArgs over the batch) in one launch of the
// rows kernel: one pass over the input with the rows kernel's bandwidth and a second of a
// border, where phase 1 wrote a per-position map that phase 2 read back per tap.
//
// At stride 1 (Ho = H, Wo = W: border sums) each tap's window covers every position but one
// border row and/or one border column, so its sum is the total less the left-out row's and
// column's sums plus their corner's (tap row 0 leaves out the bottom row, tap row 2 the top;
// tap column 0 the right column, 2 the left).  The nine sums: the total, the top and bottom
// rows, the left and right columns, the four corners, in that order.  The border read again
// is at 14 x 14 a quarter of the input, at 56 x 56 7%.
//
// At stride 2 on an even H and W (Ho = H / 2, Wo = W / 2: parity sums) tap row 1 covers the
// even rows, tap row 2 the odd rows, tap row 0 the odd rows but the last (its first row is
// padding); columns likewise.  So a tap's sum is its row and column parity class's, less the
// last row's and/or last column's part of it plus their corner.  The nine sums: the four
// classes (even rows x even columns, even x odd, odd x even, odd x odd), the last row's even
// and odd columns, the last column's even and odd rows, the last corner, in that order; the
// classes read rows of the batch and map rows merged, so the batch must be dense.
//
// The last of the nine to finish a channel tile writes the tile's 9 taps, (c, ki, kj) order,
// from the sums in a fixed expression; the output gradient's read may take the launch's last
// item.
constexpr int kBorderSums = 9;
constexpr int kBorderItems = kBorderSums + 1;

struct BorderTaps {
  RowsItem items[kBorderItems];     // the nine sums (dst: BorderLaunch.sums), then g's
  int starts[kBorderItems + 1];     // item k's blocks are [starts[k], starts[k + 1])
  int parity;                       // the nine are parity sums (else border sums)
  unsigned* tile_counters;          // a zeroed slot per channel tile: sums done there
  float* out;                       // 9 * C taps
};

// A border launch as the op planned it: the nine reads (border_args), their splits, its
// kind, and its buffers, laid out as border_layout says: `ws` the workspace (the nine sums,
// then the partials), `counters` zeroed and disjoint from any other read of the launch.
struct BorderLaunch {
  ChannelArgs a[kBorderSums];
  int nsplit[kBorderSums];
  int parity;
  at::ScalarType dtype;
  float* ws;
  unsigned* counters;
  float* out;
};

// Where a border launch's reads keep their partial sums and counters: each read split in
// more than one (nsplit > 1) has nsplit * C floats of partials, in item order after the nine
// sums' 9 * C, and a counter slot per channel tile, in item order; then one slot per tile for
// the taps.  The op sizes its buffers from it and the launch hands them out from it.
struct BorderLayout {
  int64_t partials[kBorderSums];  // floats after the workspace's start (-1 where not split)
  int64_t counters[kBorderSums];  // slots after the counters' start (-1 where not split)
  int64_t tap_counters;           // the taps' first slot
  int64_t floats, slots;          // the workspace's floats and the counter slots in all
};
BorderLayout border_layout(const BorderLaunch& l, int64_t tiles);

struct ChannelLaunch;

// Whether a convolution's input statistics are its border or parity sums' (the geometries
// above, an input read 16 bytes a thread: C a multiple of 16 / element_size, aligned rows).
bool border_taps_fit(const ConvInputArgs& a, int element_size);
// The nine reads of an input where border_taps_fit, and whether they are parity sums.
int border_args(const ConvInputArgs& a, int element_size, ChannelArgs (&out)[kBorderSums]);
// Whether the border launch can read g's rows in the same launch; the launch, with g's read
// where g is not null (only where border_reads_with), the reads' splits lowered to one wave
// together (share_one_wave).
bool border_reads_with(const BorderLaunch& l, const ChannelLaunch& g);
cudaError_t launch_border_taps(const BorderLaunch& l, const ChannelLaunch* g, cudaStream_t stream);

// Phase 1 of a convolution's input statistics (batch_sumsq_block) as the first part of a
// launch it shares with its output gradient's rows read: `blocks_x` blocks of kRowsBlock
// threads along the M = C*H*W positions (16 bytes a thread), for each of `nsplit` batch
// splits, into the nsplit partial maps.
struct SumsqItem {
  const void* x;
  int64_t batch_stride, B, M;
  int nsplit;
  int blocks_x;
  float* maps;
};

// Phase 2 folded into phase 1's launch (WindowFold): maps in (H, W, C) order of one group,
// kernels of at most 3 x 3, and C dividing kRowsBlock (and at least V) or a multiple of
// kRowsBlock dividing phase 1's block of kRowsBlock * V elements, so that each of phase 1's
// blocks holds whole positions of the map.  The last of a block's nsplit splits to finish
// sums their partial maps at its positions (split order), adds each value to the taps
// whose window covers it (in a fixed order within the block), and writes its partial
// window sums; the last block
// of each group of kFoldGroup blocks to finish sums theirs in block order, and the last
// group's sums the groups' in group order.  No second launch: a latency-bound phase 2 of
// its own took 10-19 us a convolution in a ResNet-50 capture step.  Folded only where a
// block's partial window sums are at most half its map values (window_fold_side): beyond,
// the last blocks' reads of them cost more than the launch saved.
constexpr int kFoldGroup = 8;
struct WindowFold {
  ConvInputArgs a;
  int posblocks;       // phase 1's blocks along M (its blocks_x)
  float* cols;         // window_fold_cols floats: the blocks' partial sums, then the groups'
  unsigned* counters;  // window_fold_slots zeroed slots: a block's splits, the groups, the last
  float* dst;          // K = C * kh * kw sums
};

// A launch of phase 1 and a rows read: blocks [0, sumsq_blocks) are phase 1's, the rest
// the rows item's (none for phase 1 alone); `fold` is read only by the folded launch.
struct SumsqAndRows {
  SumsqItem sumsq;
  int sumsq_blocks;
  RowsItem rows;
  WindowFold fold;
};

// A launch of phase 1 and a channel_middle read (blocks of kCaptureBlock threads): blocks
// [0, sumsq_blocks) are phase 1's, the rest the gradient's, channel by channel per split.
struct SumsqAndMiddle {
  SumsqItem sumsq;
  int sumsq_blocks;
  ChannelArgs middle;
  int nsplit;
  float* partials;
  unsigned* counters;
  float* dst;
};

// Where a launcher says what it deferred of a read (ChannelLaunch.defer): `set` where the
// read's rows-kernel blocks left their partials for `item` to sum (more than one split).
struct DeferredSums {
  FinishItem item{};
  bool set = false;
};

// One channel-statistics reduction as its op planned it: the kernel (rows or middle), its
// split, workspace (nsplit > 1) and counter slots, and where the sums go.
struct ChannelLaunch {
  ChannelArgs a;
  at::ScalarType dtype;
  bool rows_kernel;
  int nsplit;
  float* ws;
  unsigned* counters;
  float* out;
  // non-null: a rows-kernel read of more than one split leaves its partials in `ws` and
  // fills *defer (ws must then live until that finish runs); other reads ignore it
  DeferredSums* defer = nullptr;
};

cudaError_t launch_channel_stats(const ChannelLaunch& l, cudaStream_t stream);

// Two reductions (a layer's input and its output's gradient): one launch of the rows
// kernel where both are read by it in the same dtype and read mode, their splits planned
// together (fewer than each one's own, so that the launch is one wave: the sums are the
// same to fp32 rounding), else one launch each (then launch_channel_stats', bit for bit).
cudaError_t launch_channel_stats_pair(const ChannelLaunch& x, const ChannelLaunch& y, cudaStream_t stream);

// A convolution's input statistics (launch_conv_input_stats' arguments) and its output
// gradient's reduction `g` with phase 1 and the gradient's read in one launch, then phase
// 2: a launch fewer per layer than the two ops apart, the same sums.  Only where
// conv_pairs_with_gradient says one kernel reads both: phase 1's 16-byte read of an input
// of the gradient's dtype, and the rows kernel's 16-byte read of the gradient (channels
// innermost) or channel_middle's vector read (channels in the middle).
bool conv_pairs_with_gradient(const ConvInputArgs& a, at::ScalarType dtype, int nsplit, const ChannelLaunch& g);
cudaError_t launch_conv_input_stats_with_gradient(const ConvInputArgs& a, at::ScalarType dtype, int nsplit,
                                                  WindowChunks chunks, float* maps, float* ws_cols, unsigned* counters,
                                                  float* out, const ChannelLaunch& g, cudaStream_t stream);

// The largest kernel side (1 or 3) of a convolution whose phase 2 folds into phase 1's
// launch (WindowFold) for an input of `element_size` bytes, or 0 where it does not fold.
int window_fold_side(const ConvInputArgs& a, int element_size);
// Counter slots a folded launch takes: one per phase-1 block along M when the batch is
// split, one more when there are several such blocks.
int64_t window_fold_slots(const ConvInputArgs& a, int element_size, int nsplit);
// Phase 1's blocks along M in a folded launch, and the floats of its partial sums.
int64_t window_fold_blocks_x(const ConvInputArgs& a, int element_size);
int64_t window_fold_cols(const ConvInputArgs& a, int element_size);

// A convolution's input statistics in one launch (WindowFold), with its output gradient's
// rows read `g` in the same launch where g is not null.  maps: nsplit * C*H*W floats
// (nsplit > 1), cols: window_fold_cols floats, counters:
// window_fold_slots zeroed slots, disjoint from g's; out: K floats.  Only where
// window_fold_side is not 0, and for g where conv_folds_with_gradient.
bool conv_folds_with_gradient(const ConvInputArgs& a, at::ScalarType dtype, int nsplit, const ChannelLaunch& g);
cudaError_t launch_conv_input_stats_folded(const ConvInputArgs& a, at::ScalarType dtype, int nsplit, float* maps,
                                           float* cols, unsigned* counters, float* out, const ChannelLaunch* g,
                                           cudaStream_t stream);

// ---------------------------------------------------------------------------
// A norm's statistics from what its backward already has (capture_tap.h's NormTap), for
// any number of norms in one launch (deferred_norms.h gathers a backward's): per item,
// h[t] = float(mean_scale) * sum_{a, r} means[(a * T + t) * R + r] (a batch norm's
// per-channel means: A = R = 1; a layer norm's per-row means, dense, summed over every dim
// but dim 1), and s[i] = bias_grad[i] as float32.  Each item's dtypes are its own.
// ---------------------------------------------------------------------------
struct NormItem {
  const void* means;
  const void* bias_grad;
  float* h;
  float* s;
  int64_t A, T, R, n_bias;
  float mean_scale;
  at::ScalarType means_dtype, bias_dtype;  // float32, float16 or bfloat16
};

cudaError_t launch_norm_stats(const NormItem* items, int n, cudaStream_t stream);

// ---------------------------------------------------------------------------
// The capture step's factor update, every layer in one launch (one block per layer).
//
// kind 0 (Linear, Conv2d):  H_raw[j] = h[j] * inv_hn (j < nh), H_raw[nh] = extra when
//                           flags & kAppend;  S_raw = (s * inv_sscale) * inv_sn
// kind 1 (two columns):     H_raw = [sum_j h[j]^2 * inv_hn, extra];
//                           S_raw = (s * inv_sscale)^2 * inv_sn
// (the s * inv_sscale product only when flags & kScaleS).  A layer whose H_raw or S_raw
// holds a NaN gets nan_flags[index] = 1 and its stored factors are not touched; else
// nan_flags[index] = 0, +inf -> 1, -inf -> 0, v_hat = (v - min) / ((max - min) + 1e-6),
// stored <- stored * c_old + v_hat * c_new (stored read as all ones when flags & kInit).
// ---------------------------------------------------------------------------
constexpr int kFactorAppend = 1;
constexpr int kFactorInit = 2;
constexpr int kFactorScaleS = 4;

struct FactorItem {
  const float* h;
  const float* s;
  float* H;
  float* S;
  int32_t nh;
  int32_t ns;
  int32_t kind;
  int32_t flags;
  float inv_hn;
  float inv_sn;
  float inv_sscale;
  float extra;
};

cudaError_t launch_factor_update(const FactorItem* items, int n, float c_old, float c_new,
                                 int32_t* nan_flags, cudaStream_t stream);

// Multiprocessors of the current device (cached per device), for sizing grids.
int capture_sm_count();

}  // namespace lightning_cafin
