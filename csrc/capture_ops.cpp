// The factor-capture ops: argument checks (checks.h), layout canonicalisation, workspace
// and grid sizing; the kernels are in capture_stats.cu, whose launchers return errors
// that these ops raise.  Compiled by the host compiler so that a failed check raises a
// Python RuntimeError.
#include "capture_launch.h"
#include "capture_ops.h"
#include "checks.h"
#include "deferred_sums.h"
#include "factor_launch.h"
#include "record_op.h"
#include "side_stream.h"
#include "stream_buffers.h"

#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

namespace lightning_cafin {
namespace {

const char* kConv = "conv_input_stats: ";
const char* kChan = "channel_stats: ";
const char* kFac = "factor_update_: ";
const char* kLayer = "layer_stats: ";
const char* kInput = "input_stats: ";
const char* kNorm = "norm_stats: ";

// A statistics op's input: a CUDA tensor the kernels read.
void check_input(const at::Tensor& t, const char* op, const char* name) {
  check_cuda(t, op, name);
  check_kernel_float(t, op, name);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return std::max(lo, std::min(v, hi)); }

// Splits n in [1, most] of a reduction over `tiles` blocks each, for a device that runs
// `slots` blocks at once: the fewest whose last wave is (nearly) full.  A launch takes
// ceil(tiles * n / slots) waves of a block's work / n, so a last wave of a few blocks
// costs as much as a full one: 9 tiles at 264 slots took 30 splits (270 blocks, two
// waves, the H200 read an 8192 x 2304 bf16 gradient at 1.5 TB/s) where 29 is one wave.
int64_t wave_fitted_splits(int64_t tiles, int64_t slots, int64_t most) {
  most = std::max<int64_t>(1, most);
  const double bound = static_cast<double>(tiles) / static_cast<double>(slots);  // the cost with no idle slot
  // Below slots / (1.02 tiles) splits fill one wave at most, at a cost of 1 / n above the
  // threshold and above any larger n's in that wave: the search starts there (one tile
  // would otherwise take ~260 steps of host time per call).
  const int64_t first = std::min<int64_t>(
      most, std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(slots) / (1.02 * static_cast<double>(tiles))) - 1));
  int64_t best = first;
  double best_cost = std::numeric_limits<double>::infinity();
  for (int64_t n = first; n <= most; ++n) {
    const double cost = static_cast<double>(ceil_div(tiles * n, slots)) / static_cast<double>(n);
    if (cost <= 1.02 * bound) return n;
    if (cost < best_cost) {
      best = n;
      best_cost = cost;
    }
  }
  return best;
}

// (size, stride) of dims [begin, end) but `skip` merged into one, or {-1, -1} when they
// cannot be.
std::pair<int64_t, int64_t> merge_dims(const at::Tensor& t, int64_t begin, int64_t end, int64_t skip = -1) {
  int64_t size = 1, stride = 0;
  bool any = false;
  for (int64_t d = end - 1; d >= begin; --d) {  // innermost first
    const int64_t n = t.size(d);
    if (n == 1 || d == skip) continue;
    if (!any) {
      size = n;
      stride = t.stride(d);
      any = true;
    } else {
      if (t.stride(d) != stride * size) return {-1, -1};
      size *= n;
    }
  }
  return {size, stride};
}

// The rows kernel reads a tensor whose channels (dim `dim`) are innermost as rows of the
// other dims in two runs, A rows of stride sa of P rows of stride sp (ChannelArgs): which
// dims form each run does not matter to a sum over all of them.  Where the dims before and
// after the channel dim do not each merge (a strided view such as x[:, :, ::2, ::2] of a
// channels_last x: (B, Ho) merge where H == 2 * Ho, (Ho, Wo) never do), the first cut of
// the other dims in order into two runs that merge, as {A, sa, P, sp}; {-1, ...} if none.
std::array<int64_t, 4> rows_runs(const at::Tensor& t, int64_t dim) {
  const int64_t nd = t.dim();
  for (int64_t cut = 1; cut < nd; ++cut) {
    const auto outer = merge_dims(t, 0, cut, dim), inner = merge_dims(t, cut, nd, dim);
    if (outer.first >= 0 && inner.first >= 0) return {outer.first, outer.second, inner.first, inner.second};
  }
  return {-1, -1, -1, -1};
}

// The rows kernel's splits of a read of `a` (shape: channel_rows_shape's): as many blocks
// as the SMs hold at once (two of kRowsBlock threads with kRowsUnroll 16-byte loads each
// keep 64 KiB in flight an SM: what the memory needs, capture_launch.h has the
// measurements), in whole waves (wave_fitted_splits), and no fewer than kRowsGroupsPerSplit
// groups of kRowsUnroll passes a block.  Most reads share a launch with another (a layer's
// input and its output gradient, a convolution's border sums and its gradient): each is
// planned here for the whole device (its workspace and counter slots sized so), and the
// launch then lowers their splits to one wave together (capture_stats.cu, share_one_wave).
constexpr int64_t kRowsGroupsPerSplit = 4;
int64_t rows_splits(const ChannelArgs& a, const ChannelRowsShape& shape, at::ScalarType dtype) {
  const int64_t rows_per_split = kRowsGroupsPerSplit * kRowsUnroll * (kRowsBlock / shape.lanes);
  return wave_fitted_splits(shape.tiles, rows_slots(shape.read, dtype),
                            std::min<int64_t>(1024, ceil_div(a.A * a.P, rows_per_split)));
}

// Counter slots for two reductions of one launch, whose last blocks' counters are live
// together: where both take slots (neither pointer null), disjoint ones from the current
// stream's pool, `first` its first n_first and `second` the next n_second.  False where the
// pool cannot give them (a stream being captured, its pool too small to grow), leaving both
// as they were: then one launch each, one after the other, which may share slots.
bool disjoint_slots(const at::Tensor& like, unsigned*& first, int64_t n_first, unsigned*& second, int64_t n_second) {
  if (first == nullptr || second == nullptr) return true;
  unsigned* const slots = counter_slots(like, n_first + n_second);
  if (slots == nullptr) return false;
  first = slots;
  second = slots + n_first;
  return true;
}

// The ops' results and workspaces are made without a dispatched op, and mostly without an
// allocator call (stream_buffers.h): each one is host time in a capture step's backward,
// which a host-bound step pays in full (the profile of a ResNet-18 capture step put three
// allocations and four views a layer among the host's largest additions).

// A planned statistics op: its checked kernel arguments and grid, the floats of output
// (`n_out`) and workspace (`n_ws`) it needs, launched once its buffers are given, so
// that layer_stats can give two ops one allocation.  `zeros`: nothing to reduce (an
// empty dim), the output is only zero-filled.
struct ConvPlan {
  at::Tensor x;  // the input as read (a copy where its layout is neither NCHW nor NHWC)
  ConvInputArgs a{};
  int64_t n_out = 0, n_maps = 0, n_cols = 0;
  int nsplit = 1;
  WindowChunks chunks{};
  bool fold = false;       // phase 2 folded into phase 1's launch (capture_launch.h, WindowFold)
  bool border = false;     // from its border or parity sums instead (capture_launch.h, BorderTaps): `reads`
  BorderLaunch reads{};    // (its buffers given at the launch)
  int64_t n_border = 0;    // the border launch's workspace floats
  int64_t n_slots = 0;     // the counter slots its launches take
  unsigned* counters = nullptr;
  bool zeros = false;
  int64_t n_ws() const { return border ? n_border : n_maps + n_cols; }
};

// A border plan's launch on its workspace `ws` (border_layout's), counting in `counters`,
// with g's read where g is not null.
cudaError_t launch_border(const ConvPlan& p, float* out, float* ws, unsigned* counters, const ChannelLaunch* g,
                          cudaStream_t stream) {
  BorderLaunch l = p.reads;
  l.ws = ws;
  l.counters = counters;
  l.out = out;
  return launch_border_taps(l, g, stream);
}

struct ChannelPlan {
  at::Tensor t;
  ChannelArgs a{};
  int64_t n_out = 0, n_ws = 0;
  bool rows = false, zeros = false;
  int nsplit = 1;
  unsigned* counters = nullptr;
};

// The caller checked the input (check_input, before guarding its device), and made the
// stream current before planning: the counter slots are taken from the current stream's pool.
ConvPlan plan_conv(const at::Tensor& x_in, const std::vector<int64_t>& kernel, const std::vector<int64_t>& stride,
                   const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation, int64_t groups,
                   const std::vector<int64_t>& out_hw) {
  TORCH_CHECK(x_in.dim() == 4, kConv, "x must be 4-D (B, C, H, W), got ", num(static_cast<int64_t>(x_in.dim())),
              " dims");
  TORCH_CHECK(kernel.size() == 2 && stride.size() == 2 && padding.size() == 2 && dilation.size() == 2 &&
                  out_hw.size() == 2,
              kConv, "kernel, stride, padding, dilation and out_hw must each have 2 entries");
  const int64_t B = x_in.size(0), C = x_in.size(1), H = x_in.size(2), W = x_in.size(3);
  TORCH_CHECK(groups >= 1 && C % groups == 0, kConv, "groups (", num(groups), ") must divide the channels (", num(C), ")");
  const int64_t lim = std::numeric_limits<int32_t>::max() / 4;
  for (int64_t v : {kernel[0], kernel[1], stride[0], stride[1], dilation[0], dilation[1]})
    TORCH_CHECK(v >= 1 && v <= lim, kConv, "kernel, stride and dilation must be positive, got ", num(v));
  for (int64_t v : {padding[0], padding[1], out_hw[0], out_hw[1]})
    TORCH_CHECK(v >= 0 && v <= lim, kConv, "padding and out_hw must be non-negative, got ", num(v));
  TORCH_CHECK(H <= lim && W <= lim && groups <= lim, kConv, "input too large");
  const int64_t K = (C / groups) * kernel[0] * kernel[1];
  TORCH_CHECK(K >= 1 && K <= lim, kConv, "C/groups * kh * kw = ", num(K), " is out of range");

  ConvPlan p;
  p.n_out = K;
  if (B == 0 || C == 0 || H == 0 || W == 0 || out_hw[0] == 0 || out_hw[1] == 0) {
    p.zeros = true;
    return p;
  }

  // The per-sample block must be dense in (C, H, W) or (H, W, C) order.
  auto dense_chw = [](const at::Tensor& t) {
    return (t.size(3) == 1 || t.stride(3) == 1) && (t.size(2) == 1 || t.stride(2) == t.size(3)) &&
           (t.size(1) == 1 || t.stride(1) == t.size(2) * t.size(3));
  };
  auto dense_hwc = [](const at::Tensor& t) {
    return (t.size(1) == 1 || t.stride(1) == 1) && (t.size(3) == 1 || t.stride(3) == t.size(1)) &&
           (t.size(2) == 1 || t.stride(2) == t.size(3) * t.size(1));
  };
  p.x = x_in;
  int map_hwc = 0;
  if (dense_chw(p.x)) {
    map_hwc = 0;
  } else if (dense_hwc(p.x)) {
    map_hwc = 1;
  } else {
    p.x = p.x.contiguous();
  }
  const int64_t M = C * H * W;

  ConvInputArgs& a = p.a;
  a.x = p.x.data_ptr();
  a.batch_stride = B == 1 ? M : p.x.stride(0);
  a.B = B;
  a.C = C;
  a.H = H;
  a.W = W;
  a.map_hwc = map_hwc;
  a.kh = static_cast<int>(kernel[0]);
  a.kw = static_cast<int>(kernel[1]);
  a.sh = static_cast<int>(stride[0]);
  a.sw = static_cast<int>(stride[1]);
  a.pt = static_cast<int>(padding[0]);
  a.pl = static_cast<int>(padding[1]);
  a.dh = static_cast<int>(dilation[0]);
  a.dw = static_cast<int>(dilation[1]);
  a.groups = static_cast<int>(groups);
  a.Ho = static_cast<int>(out_hw[0]);
  a.Wo = static_cast<int>(out_hw[1]);
  TORCH_CHECK(static_cast<int64_t>(a.groups) * a.Ho * a.Wo <= std::numeric_limits<int32_t>::max(), kConv,
              "groups * Ho * Wo is too large");

  // A 3 x 3 convolution with padding 1 at stride 1, or at stride 2 on an even map, on a
  // channels_last input: its border or parity sums, nine reads of the rows kernel in one
  // launch, each split as the rows kernel splits a read of its size (rows_splits); where the
  // stream's pool cannot give their counter slots (a stream being captured), the map and its
  // window sums below.
  if (border_taps_fit(a, static_cast<int>(p.x.element_size()))) {
    BorderLaunch& l = p.reads;
    l.parity = border_args(a, static_cast<int>(p.x.element_size()), l.a);
    l.dtype = p.x.scalar_type();
    const ChannelRowsShape shape = channel_rows_shape(l.a[0], static_cast<int>(p.x.element_size()));
    for (int k = 0; k < kBorderSums; ++k) l.nsplit[k] = static_cast<int>(rows_splits(l.a[k], shape, l.dtype));
    const BorderLayout layout = border_layout(l, shape.tiles);
    if ((p.counters = counter_slots(p.x, layout.slots)) != nullptr) {
      p.border = true;
      p.n_slots = layout.slots;
      p.n_border = layout.floats;
      return p;
    }
  }

  // Grids of about two blocks per multiprocessor: the batch is split only where the
  // grid would otherwise be small (each split adds a partial map that phase 2 reads
  // once per tap, or once); phase 2's chunks are summed by their last block, in the same
  // launch, at most 64 of them: first ranges of positions, each at least
  // window_sums_shape's per_chunk; then, for maps in (H, W, C) order where the grid is
  // still small, ranges of at least kMapsPerGroup of the split maps (WindowChunks).
  constexpr int64_t kMaxChunks = 64, kMapsPerGroup = 4;
  const int64_t target = 2 * static_cast<int64_t>(capture_sm_count());
  const int64_t vec = 16 / static_cast<int64_t>(p.x.element_size());
  const int64_t blocks_x = ceil_div(ceil_div(M, vec), kCaptureBlock);
  // Phase 2 folded into phase 1's launch where it can be: the batch split as for two
  // launches, but into at most kFoldMostSplits maps, which the last split of each of
  // phase 1's blocks sums at the end of the launch (a shared launch's gradient read keeps
  // the device busy beside the fewer blocks).
  constexpr int64_t kFoldMostSplits = 16;
  const int element_size = static_cast<int>(p.x.element_size());
  if (window_fold_side(a, element_size) != 0) {
    const int nsplit = static_cast<int>(clamp64(ceil_div(target, blocks_x), 1, std::min<int64_t>(B, kFoldMostSplits)));
    const int64_t slots = window_fold_slots(a, element_size, nsplit);
    if (slots == 0 || (p.counters = counter_slots(p.x, slots)) != nullptr) {
      p.fold = true;
      p.nsplit = nsplit;
      p.n_slots = slots;
      p.n_maps = nsplit > 1 ? nsplit * M : 0;
      p.n_cols = window_fold_cols(a, element_size);
      return p;
    }
  }
  p.nsplit = static_cast<int>(clamp64(ceil_div(target, blocks_x), 1, std::min<int64_t>(B, 64)));
  const WindowSumsShape phase2 = window_sums_shape(a);
  const int64_t positions = clamp64(ceil_div(target, phase2.blocks_x), 1,
                                    std::min<int64_t>(kMaxChunks, ceil_div(phase2.work, phase2.per_chunk)));
  const int64_t map_groups =
      phase2.kind != WindowSumsKind::kChannelTiles
          ? 1
          : clamp64(ceil_div(target, phase2.blocks_x * positions), 1,
                    std::max<int64_t>(1, std::min(p.nsplit / kMapsPerGroup, kMaxChunks / positions)));
  p.chunks = {static_cast<int>(positions), static_cast<int>(map_groups)};
  if (p.chunks.count() > 1 && (p.counters = counter_slots(p.x, K)) == nullptr) p.chunks = {};
  p.n_slots = p.counters != nullptr ? K : 0;
  // the workspace: the batch-split partial maps (the map itself when nsplit == 1), then
  // the chunks' partials
  p.n_maps = p.nsplit * M;
  p.n_cols = p.chunks.count() > 1 ? p.chunks.count() * K : 0;
  return p;
}

// A folded plan's launch (with the gradient's read where g is not null) on its workspace
// `ws`: the split maps, then the blocks' partial window sums.
cudaError_t launch_folded(const ConvPlan& p, float* out, float* ws, unsigned* counters, const ChannelLaunch* g,
                          cudaStream_t stream) {
  return launch_conv_input_stats_folded(p.a, p.x.scalar_type(), p.nsplit, p.n_maps ? ws : nullptr,
                                        p.n_cols ? ws + p.n_maps : nullptr, counters, out, g, stream);
}

void launch(const ConvPlan& p, float* out, float* ws, cudaStream_t stream) {
  if (p.border) {
    check_launch(launch_border(p, out, ws, p.counters, nullptr, stream), kConv);
    return;
  }
  if (p.fold) {
    check_launch(launch_folded(p, out, ws, p.counters, nullptr, stream), kConv);
    return;
  }
  check_launch(launch_conv_input_stats(p.a, p.x.scalar_type(), p.nsplit, p.chunks, ws,
                                       p.n_cols ? ws + p.n_maps : nullptr, p.counters, out, stream),
               kConv);
}

// As plan_conv: the caller checked the input and made the stream current.
ChannelPlan plan_channel(const at::Tensor& t_in, int64_t dim, bool square, double divisor) {
  const int64_t nd = t_in.dim();
  TORCH_CHECK(nd >= 1, kChan, "t must have at least one dimension");
  TORCH_CHECK(dim >= -nd && dim < nd, kChan, "dim ", num(dim), " is out of range for a tensor of ", num(nd), " dims");
  if (dim < 0) dim += nd;
  const int64_t O = t_in.size(dim);
  ChannelPlan p;
  p.n_out = O;
  if (O == 0 || t_in.numel() == 0) {
    p.zeros = true;
    return p;
  }

  p.t = t_in;
  ChannelArgs& a = p.a;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const auto before = merge_dims(p.t, 0, dim);
    const auto after = merge_dims(p.t, dim + 1, nd);
    const int64_t so = O == 1 ? 0 : p.t.stride(dim);
    bool ok = before.first >= 0 && after.first >= 0;
    if (ok) {
      a.A = before.first;
      a.sa = before.second;
      a.P = after.first;
      a.sp = after.second;
      a.O = O;
      a.so = so;
      if (a.P > 1 && a.sp == 1) {
        p.rows = false;
      } else if (a.so == 1 || O == 1) {
        p.rows = true;
      } else {
        ok = false;
      }
    }
    if (!ok && (so == 1 || O == 1)) {  // channels innermost: rows, in whichever two runs merge
      const auto runs = rows_runs(p.t, dim);
      if (runs[0] >= 0) {
        a.A = runs[0];
        a.sa = runs[1];
        a.P = runs[2];
        a.sp = runs[3];
        a.O = O;
        a.so = so;
        p.rows = ok = true;
      }
    }
    if (ok) break;
    TORCH_CHECK(attempt == 0, kChan, "internal error: a contiguous tensor did not canonicalise");
    p.t = p.t.contiguous();
  }
  a.t = p.t.data_ptr();
  a.square = square ? 1 : 0;
  a.apply_post = divisor > 0 ? 1 : 0;
  a.post_mul = divisor > 0 ? 1.0f / static_cast<float>(divisor) : 1.0f;

  // The rows kernel's splits (rows_splits); the middle kernel keeps fewer loads in flight
  // and sums only one partial per split.
  const int64_t sms = static_cast<int64_t>(capture_sm_count());
  int64_t nsplit;
  if (p.rows) {
    nsplit = rows_splits(a, channel_rows_shape(a, static_cast<int>(p.t.element_size())), p.t.scalar_type());
  } else {
    nsplit = clamp64(ceil_div(8 * sms, O), 1, std::max<int64_t>(1, std::min(a.A, a.A * a.P / 4096)));
  }
  nsplit = std::min<int64_t>(nsplit, 1024);
  if (nsplit > 1 && (p.counters = counter_slots(p.t, O)) == nullptr) nsplit = 1;
  p.nsplit = static_cast<int>(nsplit);
  p.n_ws = nsplit > 1 ? nsplit * O : 0;
  return p;
}

// The plan as the launchers take it, writing to `out` (its workspace `ws`, when it has one).
ChannelLaunch channel_launch(const ChannelPlan& p, float* out, float* ws) {
  return {p.a, p.t.scalar_type(), p.rows, p.nsplit, p.n_ws ? ws : nullptr, p.counters, out};
}

void launch(const ChannelPlan& p, float* out, float* ws, cudaStream_t stream) {
  check_launch(launch_channel_stats(channel_launch(p, out, ws), stream), kChan);
}

// One op on its own: the output, and the workspace (the stream's scratch).
template <typename Plan>
at::Tensor run_alone(const Plan& p, int64_t n_ws, const at::Tensor& like) {
  const OpStream on = OpStream::current(like);
  at::Tensor out = result_floats(p.n_out, like, on);
  if (p.zeros) return out.zero_();
  at::Tensor ws = n_ws > 0 ? scratch_floats(n_ws, like, on) : at::Tensor();
  launch(p, out.data_ptr<float>(), n_ws > 0 ? ws.data_ptr<float>() : nullptr, on.stream);
  return out;
}

// A convolution's input_op {1, kh, kw, sh, sw, pt, pl, dh, dw, groups, Ho, Wo}: a 3-D x is read as height 1.
ConvPlan plan_conv_op(const at::Tensor& x, const std::vector<int64_t>& o) {
  return plan_conv(x.dim() == 3 ? x.unsqueeze(2) : x, {o[1], o[2]}, {o[3], o[4]}, {o[5], o[6]}, {o[7], o[8]}, o[9],
                   {o[10], o[11]});
}

// A 1 x 1 convolution of one group without padding reads only the input positions under
// its one tap: every sh-th row and sw-th column (a quarter of the input at stride 2, as in
// ResNet's strided shortcuts).  Where those positions of an input with its channels
// innermost (channels_last) read as the rows kernel's two runs (rows_runs; the batch and
// the tap rows merge where H == Ho * sh), the strided view whose per-channel sums of
// squares are the statistics: one pass over those positions instead of phase 1's map of
// the whole input and its window sums.  Undefined otherwise (then plan_conv_op's path).
// `o` is a convolution's input_op (is_conv_op).
at::Tensor pointwise_taps(const at::Tensor& x_in, const std::vector<int64_t>& o) {
  const at::Tensor x = x_in.dim() == 3 ? x_in.unsqueeze(2) : x_in;
  const int64_t sh = o[3], sw = o[4], Ho = o[10], Wo = o[11];
  if (x.dim() != 4 || o[1] != 1 || o[2] != 1 || o[5] != 0 || o[6] != 0 || o[9] != 1 || x.numel() == 0) return {};
  if (sh < 1 || sw < 1 || o[7] < 1 || o[8] < 1 || Ho < 1 || Wo < 1) return {};  // (plan_conv's checks raise)
  if (Ho > x.size(2) || Wo > x.size(3) || sh > x.size(2) || sw > x.size(3)) return {};  // (no overflow below)
  if ((Ho - 1) * sh >= x.size(2) || (Wo - 1) * sw >= x.size(3)) return {};
  if (x.size(1) > 1 && x.stride(1) != 1) return {};
  at::Tensor v = x.slice(2, 0, (Ho - 1) * sh + 1, sh).slice(3, 0, (Wo - 1) * sw + 1, sw);
  return rows_runs(v, 1)[0] >= 0 ? v : at::Tensor();
}

// An input_op's plan: a convolution's map and window sums (or border or parity sums: plan_conv),
// or a per-channel read (a channel op's on x, or a convolution's on its pointwise taps, raw
// sums as plan_conv's).  As plan_conv: the caller checked x and made the stream current.
struct InputPlan {
  bool conv = false;  // `conv` holds the plan, else `channel`
  ConvPlan conv_plan;
  ChannelPlan channel;
  int64_t n_out() const { return conv ? conv_plan.n_out : channel.n_out; }
  int64_t n_ws() const { return conv ? conv_plan.n_ws() : channel.n_ws; }
  bool zeros() const { return conv ? conv_plan.zeros : channel.zeros; }
};

InputPlan plan_input(const at::Tensor& x, const std::vector<int64_t>& input_op, double input_div, bool conv) {
  InputPlan p;
  const at::Tensor taps = conv ? pointwise_taps(x, input_op) : at::Tensor();
  p.conv = conv && !taps.defined();
  if (p.conv) {
    p.conv_plan = plan_conv_op(x, input_op);
  } else if (taps.defined()) {
    p.channel = plan_channel(taps, 1, true, 0.0);
  } else {
    p.channel = plan_channel(x, input_op[1], input_op[2] != 0, input_div);
  }
  return p;
}

at::Tensor run_alone(const InputPlan& p, const at::Tensor& like) {
  return p.conv ? run_alone(p.conv_plan, p.n_ws(), like) : run_alone(p.channel, p.n_ws(), like);
}

}  // namespace

bool is_conv_op(const std::vector<int64_t>& input_op, const char* op) {
  const bool conv = !input_op.empty() && input_op[0] == 1;
  TORCH_CHECK((input_op.size() == 3 && input_op[0] == 0) || (conv && input_op.size() == 12), op,
              "input_op must be {0, dim, square} or {1, kh, kw, sh, sw, pt, pl, dh, dw, groups, Ho, Wo}");
  return conv;
}

at::Tensor conv_input_stats(const at::Tensor& x_in, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                            std::vector<int64_t> padding, std::vector<int64_t> dilation, int64_t groups,
                            std::vector<int64_t> out_hw, bool side) {
  LIGHTNING_CAFIN_RECORD_OP("conv_input_stats");
  check_input(x_in, kConv, "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const SideScope scope(x_in, side);  // from here on, the current stream is the side stream
  scope.reads(x_in);
  if (x_in.dim() == 4 && kernel.size() == 2 && stride.size() == 2 && padding.size() == 2 && dilation.size() == 2 &&
      out_hw.size() == 2) {
    return run_alone(plan_input(x_in,
                                {1, kernel[0], kernel[1], stride[0], stride[1], padding[0], padding[1], dilation[0],
                                 dilation[1], groups, out_hw[0], out_hw[1]},
                                0.0, true),
                     x_in);
  }
  const ConvPlan p = plan_conv(x_in, kernel, stride, padding, dilation, groups, out_hw);  // (its checks raise)
  return run_alone(p, p.n_ws(), x_in);
}

at::Tensor channel_stats(const at::Tensor& t_in, int64_t dim, bool square, double divisor, bool side) {
  LIGHTNING_CAFIN_RECORD_OP("channel_stats");
  check_input(t_in, kChan, "t");
  const c10::cuda::CUDAGuard guard(t_in.device());
  const SideScope scope(t_in, side);  // see conv_input_stats
  scope.reads(t_in);
  const ChannelPlan p = plan_channel(t_in, dim, square, divisor);
  return run_alone(p, p.n_ws, t_in);
}

at::Tensor input_stats(const at::Tensor& x, const std::vector<int64_t>& input_op, double input_div) {
  LIGHTNING_CAFIN_RECORD_OP("input_stats");
  const c10::NoGradGuard no_grad;  // (x may require grad: TapPlan.tap_read reads it as given)
  if (x.defined() && x.device().is_cpu()) return input_stats_reference(x, input_op, input_div);
  check_input(x, kInput, "x");
  const bool conv = is_conv_op(input_op, kInput);
  const c10::cuda::CUDAGuard guard(x.device());
  return run_alone(plan_input(x, input_op, input_div, conv), x);
}

namespace {

// layer_stats, and where `defer` (the taps' call) its rows-kernel pair's sums over splits
// left to finish_deferred_sums() (deferred_sums.h).
std::tuple<at::Tensor, at::Tensor> layer_stats_impl(const at::Tensor& x, const at::Tensor& grad,
                                                    const std::vector<int64_t>& input_op, double input_div,
                                                    int64_t grad_dim, bool grad_square, double grad_div, bool side,
                                                    bool defer) {
  if (x.defined() && x.device().is_cpu() && grad.defined() && grad.device().is_cpu())
    return layer_stats_reference(x, grad, input_op, input_div, grad_dim, grad_square, grad_div);
  check_input(x, kLayer, "x");
  check_input(grad, kLayer, "grad");
  TORCH_CHECK(x.device() == grad.device(), kLayer, "x and grad must be on one device");
  const bool conv_op = is_conv_op(input_op, kLayer);
  const c10::NoGradGuard no_grad;  // a backward building a graph (create_graph) records nothing here
  const c10::cuda::CUDAGuard guard(x.device());
  // one ordering for both ops, one slice of the stream's results block for both results
  // (they live until the step reads them) and its scratch for both workspaces: inside the
  // scope the side stream is current, so everything is planned and runs there
  const SideScope scope(x, side);
  scope.reads(x);
  scope.reads(grad);
  InputPlan ip = plan_input(x, input_op, input_div, conv_op);
  const bool conv = ip.conv;
  ConvPlan& pc = ip.conv_plan;
  ChannelPlan& px = ip.channel;
  const ChannelPlan pg = plan_channel(grad, grad_dim, grad_square, grad_div);
  // Both plans take counter slots from the stream's one pool, which planning the second
  // may have grown into a new tensor (it held too few slots): the first takes its slots
  // again, from the pool as it now is (big enough for both, so nothing grows).
  if (conv && pc.counters != nullptr) pc.counters = counter_slots(pc.x, pc.n_slots);
  if (!conv && px.counters != nullptr) px.counters = counter_slots(px.t, px.n_out);
  const int64_t nh = ip.n_out(), wh = ip.n_ws();
  const bool h_zeros = ip.zeros();
  const int64_t off_s = aligned(nh), n_ws = aligned(wh) + pg.n_ws;
  const OpStream on = OpStream::current(x);
  const cudaStream_t stream = on.stream;
  const bool pair = !conv && !h_zeros && !pg.zeros;
  // a deferred pair's partials live until their finish: a slice of the results block, not
  // the scratch that the stream's next op reuses
  const bool defer_pair = defer && pair && n_ws > 0 && !on.capturing;
  at::Tensor out = result_floats(off_s + pg.n_out, x, on);  // [h | s]
  at::Tensor ws = n_ws > 0 ? (defer_pair ? result_floats(n_ws, x, on) : scratch_floats(n_ws, x, on))
                           : at::Tensor();  // [h's workspace | s's]
  float* o = out.data_ptr<float>();
  float* w = n_ws > 0 ? ws.data_ptr<float>() : nullptr;
  at::Tensor h = part_of(out, 0, nh), s = part_of(out, off_s, pg.n_out);
  float* const s_ws = w ? w + aligned(wh) : nullptr;
  if (pair) {  // a linear layer's two reductions: one launch where one kernel reads both
    // In one launch both items' last-block counters are live together, so they take
    // disjoint slots: the input's the first n_out (a tile per channel at most), the
    // gradient's the next (two launches one after the other could share them).
    // Where no such slots can be had (a stream being captured, its pool too small to grow),
    // one launch each, below, as for any other layer.
    ChannelLaunch lx = channel_launch(px, o, w), lg = channel_launch(pg, o + off_s, s_ws);
    DeferredSums dx, dg;
    if (defer_pair) {
      lx.defer = &dx;
      lg.defer = &dg;
    }
    if (disjoint_slots(px.t, lx.counters, px.n_out, lg.counters, pg.n_out)) {
      check_launch(launch_channel_stats_pair(lx, lg, stream), kLayer);
      if (dx.set || dg.set) defer_sums(x, stream, {&dx, &dg}, {ws, out});
      return {h, s};
    }
  }
  // A convolution: its input's phase 1 and its gradient's read in one launch where one
  // kernel reads both (then phase 2), a launch fewer.  The gradient's counter slots are used
  // before phase 2's, one launch after the other, so they may be the same.
  // With phase 2 folded in (pc.fold), the input's statistics and the gradient's read are
  // one launch where one kernel reads both: their counters are then live together, so
  // they take disjoint slots (as a linear layer's pair above; else one launch each, below).
  // The border sums and the gradient's read in one launch likewise (disjoint slots).
  if (conv && pc.border && !h_zeros && !pg.zeros) {
    ChannelLaunch lg = channel_launch(pg, o + off_s, s_ws);
    unsigned* border_slots = pc.counters;
    if (border_reads_with(pc.reads, lg) && disjoint_slots(pc.x, border_slots, pc.n_slots, lg.counters, pg.n_out)) {
      check_launch(launch_border(pc, o, w, border_slots, &lg, stream), kLayer);
      return {h, s};
    }
  }
  if (conv && pc.fold && !h_zeros && !pg.zeros) {
    ChannelLaunch lg = channel_launch(pg, o + off_s, s_ws);
    unsigned* fold_slots = pc.counters;
    if (conv_folds_with_gradient(pc.a, pc.x.scalar_type(), pc.nsplit, lg) &&
        disjoint_slots(pc.x, fold_slots, pc.n_slots, lg.counters, pg.n_out)) {
      check_launch(launch_folded(pc, o, w, fold_slots, &lg, stream), kLayer);
      return {h, s};
    }
  }
  if (conv && !pc.fold && !pc.border && !h_zeros && !pg.zeros) {
    const ChannelLaunch lg = channel_launch(pg, o + off_s, s_ws);
    if (conv_pairs_with_gradient(pc.a, pc.x.scalar_type(), pc.nsplit, lg)) {
      check_launch(launch_conv_input_stats_with_gradient(pc.a, pc.x.scalar_type(), pc.nsplit, pc.chunks, w,
                                                         pc.n_cols ? w + pc.n_maps : nullptr, pc.counters, o, lg,
                                                         stream),
                   kLayer);
      return {h, s};
    }
  }
  if (h_zeros) {
    h.zero_();
  } else if (conv) {
    launch(pc, o, w, stream);
  } else {
    launch(px, o, w, stream);
  }
  if (pg.zeros) {
    s.zero_();
  } else {
    launch(pg, o + off_s, s_ws, stream);
  }
  return {h, s};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> layer_stats(const at::Tensor& x, const at::Tensor& grad,
                                               const std::vector<int64_t>& input_op, double input_div,
                                               int64_t grad_dim, bool grad_square, double grad_div, bool side) {
  LIGHTNING_CAFIN_RECORD_OP("layer_stats");
  return layer_stats_impl(x, grad, input_op, input_div, grad_dim, grad_square, grad_div, side, /*defer=*/false);
}

std::tuple<at::Tensor, at::Tensor> layer_stats_for_tap(const at::Tensor& x, const at::Tensor& grad,
                                                       const std::vector<int64_t>& input_op, double input_div,
                                                       int64_t grad_dim, bool grad_square, double grad_div,
                                                       bool side) {
  LIGHTNING_CAFIN_RECORD_OP("layer_stats");
  return layer_stats_impl(x, grad, input_op, input_div, grad_dim, grad_square, grad_div, side, /*defer=*/true);
}

at::Tensor factor_update_(const std::vector<at::Tensor>& h, const std::vector<at::Tensor>& s,
                          const std::vector<at::Tensor>& H, const std::vector<at::Tensor>& S,
                          const std::vector<int64_t>& kinds, const std::vector<int64_t>& flags,
                          const std::vector<double>& h_div, const std::vector<double>& s_div,
                          const std::vector<double>& s_scale, const std::vector<double>& extra, double c_old,
                          double c_new) {
  LIGHTNING_CAFIN_RECORD_OP("factor_update_");
  const int64_t L = factor_layer_count(kFac, {h.size(), s.size(), H.size(), S.size(), kinds.size(), flags.size(),
                                             h_div.size(), s_div.size(), s_scale.size(), extra.size()});
  check_cuda(h[0], kFac, "h[0]");
  const c10::Device device = h[0].device();
  std::vector<FactorItem> items(L);
  for (int64_t i = 0; i < L; ++i) {
    check_factor_vector(h[i], kFac, Entry{"h", i}, device, "h[0]");
    check_factor_vector(s[i], kFac, Entry{"s", i}, device, "h[0]");
    check_factor_vector(H[i], kFac, Entry{"H", i}, device, "h[0]");
    check_factor_vector(S[i], kFac, Entry{"S", i}, device, "h[0]");
    FactorItem& it = items[i];
    it = factor_item(kFac, i, H[i], S[i], kinds[i], flags[i], h_div[i], s_div[i], s_scale[i], extra[i]);
    const bool append = (flags[i] & kFactorAppend) != 0;
    const int64_t want_H = kinds[i] == 1 ? 2 : h[i].numel() + (append ? 1 : 0);
    TORCH_CHECK(H[i].numel() == want_H, kFac, "H[", num(i), "] has ", num(H[i].numel()), " elements, expected ", num(want_H));
    TORCH_CHECK(S[i].numel() == s[i].numel(), kFac, "S[", num(i), "] has ", num(S[i].numel()), " elements but s[", num(i),
                "] has ", num(s[i].numel()));
    it.h = h[i].data_ptr<float>();
    it.s = s[i].data_ptr<float>();
    it.nh = static_cast<int32_t>(h[i].numel());
  }
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor nan_flags = at::empty({L}, h[0].options().dtype(at::kInt));
  check_launch(launch_factor_update(items.data(), static_cast<int>(L), static_cast<float>(c_old),
                                    static_cast<float>(c_new), nan_flags.data_ptr<int32_t>(), current_stream(h[0])),
               kFac);
  return nan_flags;
}

namespace {

// norm_stats' checks of one norm's inputs on a device the kernels read (see capture_ops.h).
void check_norm_inputs(const at::Tensor& means, const at::Tensor& bias_grad) {
  check_input(means, kNorm, "means");
  check_input(bias_grad, kNorm, "bias_grad");
  TORCH_CHECK(means.device() == bias_grad.device(), kNorm, "means and bias_grad must be on one device");
  TORCH_CHECK(means.dim() == 1 || means.dim() >= 3, kNorm,
              "means must be 1-D (a batch norm's) or have 3 or more dims (a layer norm's per row), got ",
              num(static_cast<int64_t>(means.dim())), " dims");
  TORCH_CHECK(bias_grad.dim() == 1, kNorm, "bias_grad must be 1-D, got ", num(static_cast<int64_t>(bias_grad.dim())),
              " dims");
}

}  // namespace

bool norm_stats_on_kernels(const at::Tensor& means, const at::Tensor& bias_grad) {
  return means.is_cuda() && bias_grad.is_cuda() && means.device() == bias_grad.device() &&
         is_kernel_float(means.scalar_type()) && is_kernel_float(bias_grad.scalar_type());
}

std::vector<std::pair<at::Tensor, at::Tensor>> norm_stats_batch(const std::vector<NormInput>& norms) {
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  if (norms.empty()) return out;
  for (const NormInput& n : norms) {
    check_norm_inputs(n.means, n.bias_grad);
    TORCH_CHECK(n.means.device() == norms[0].means.device(), kNorm, "every norm of one launch must be on one device");
  }
  const c10::NoGradGuard no_grad;
  const c10::cuda::CUDAGuard guard(norms[0].means.device());
  std::vector<at::Tensor> means, bias_grads;  // (contiguous: held until the launch is made)
  std::vector<NormItem> items(norms.size());
  std::vector<int64_t> offsets(norms.size());
  int64_t total = 0;
  for (size_t k = 0; k < norms.size(); ++k) {
    means.push_back(norms[k].means.contiguous());
    bias_grads.push_back(norms[k].bias_grad.contiguous());
    const at::Tensor& m = means.back();
    NormItem& a = items[k];
    a.means = m.data_ptr();
    a.bias_grad = bias_grads.back().data_ptr();
    const bool per_channel = m.dim() == 1;
    a.A = per_channel ? 1 : m.size(0);
    a.T = per_channel ? m.size(0) : m.size(1);
    a.R = (a.A == 0 || a.T == 0) ? 0 : m.numel() / (a.A * a.T);
    a.n_bias = bias_grads.back().numel();
    a.mean_scale = static_cast<float>(norms[k].mean_scale);
    a.means_dtype = m.scalar_type();
    a.bias_dtype = bias_grads.back().scalar_type();
    offsets[k] = total;
    total += aligned(a.T) + aligned(a.n_bias);
  }
  const at::Tensor buffer = result_floats(total, means[0]);  // [h | s] per norm, in turn
  float* o = buffer.data_ptr<float>();
  out.reserve(norms.size());
  for (size_t k = 0; k < norms.size(); ++k) {
    NormItem& a = items[k];
    const int64_t off_s = offsets[k] + aligned(a.T);
    a.h = o + offsets[k];
    a.s = o + off_s;
    out.emplace_back(part_of(buffer, offsets[k], a.T), part_of(buffer, off_s, a.n_bias));
  }
  check_launch(launch_norm_stats(items.data(), static_cast<int>(items.size()), current_stream(means[0])), kNorm);
  return out;
}

std::tuple<at::Tensor, at::Tensor> norm_stats(const at::Tensor& means_in, const at::Tensor& bias_grad_in,
                                              double mean_scale) {
  LIGHTNING_CAFIN_RECORD_OP("norm_stats");
  if (means_in.defined() && bias_grad_in.defined() &&
      (means_in.device().is_cpu() || !is_kernel_float(means_in.scalar_type()) ||
       !is_kernel_float(bias_grad_in.scalar_type())))
    return norm_stats_reference(means_in, bias_grad_in, mean_scale);
  auto hs = norm_stats_batch({NormInput{means_in, bias_grad_in, mean_scale}});
  return {std::move(hs[0].first), std::move(hs[0].second)};
}

}  // namespace lightning_cafin
