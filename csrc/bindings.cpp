// pybind11 bindings of the lightning_cafin CUDA extension.
#include <torch/extension.h>

#include "adafisher_step.h"
#include "capture_hook.h"
#include "capture_launch.h"
#include "capture_ops.h"
#include "capture_tap.h"
#include "deferred_norms.h"
#include "factor_launch.h"
#include "side_stream.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_cafin fused CUDA kernels (AdaFisher / AdaFisherW step, factor capture)";

  m.def("adafisher_step_", &lightning_cafin::adafisher_step_,
        R"doc(Fused AdaFisher / AdaFisherW step, in place, on the current CUDA stream.

All tensors on one CUDA device.  params and grads share one dtype (float32, float16
or bfloat16); exp_avgs are all in that dtype or all float32; every parameter is dense
(contiguous, or non-overlapping and dense: channels_last), its gradient and momentum
laid out alike, and the three are walked flat in memory order; steps[i] is a float32
one-element device tensor (incremented by 1).
S_list[i] / H_list[i] are parameter i's float32 contiguous 1-D factor vectors, or
None when it has no factors (F = 1); parameter i is then viewed as a
(len(S_list[i]), ncols[i]) matrix reading H_list[i][col_offsets[i]:col_offsets[i] +
ncols[i]] (col_offsets/ncols are ignored for unfactored entries), each row's columns
in memory order where inners[i] is 1; inners[i] = C > 1 says parameter i is stored channels
innermost (a channels_last conv weight of C input channels): memory column k * C + c of a row
reads H at column c * (ncols[i] / C) + k.
decoupled=False: AdaFisher (L2 decay); True: AdaFisherW (decoupled decay).
grad_scale: optional float32 device scalar, gradients are divided by it.
found_inf: optional float32 device scalar; nonzero means nothing changes at all.
lr_tensor: optional float32 device scalar read as the learning rate on the device (lr
is then ignored), so a scheduler's in-place update reaches a captured CUDA graph.
No allocation, no host synchronisation: CUDA-graph capturable.)doc",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("steps"),
        py::arg("S_list"), py::arg("H_list"), py::arg("col_offsets"), py::arg("ncols"),
        py::arg("inners"), py::arg("lr"), py::arg("beta"), py::arg("Lambda"), py::arg("weight_decay"),
        py::arg("decoupled"), py::arg("grad_scale") = py::none(),
        py::arg("found_inf") = py::none(), py::arg("lr_tensor") = py::none());

  m.def("conv_input_stats", &lightning_cafin::conv_input_stats,
        R"doc(Conv2d input statistics without patches, on the current CUDA stream (or, with
side=True, on the device's capture side stream: join before reading the result).

x: 4-D (B, C, H, W) CUDA tensor, float32 / float16 / bfloat16, any strides (dense
NCHW and channels_last are read in place, others copied once).  Returns float32
[C/groups * kh * kw]: for every weight column (c, ki, kj) the sum over the batch, the
groups and every output position of the squared zero-padded input under that tap.
padding = (top, left); the bottom/right padding is implied by out_hw = (Ho, Wo).)doc",
        py::arg("x"), py::arg("kernel"), py::arg("stride"), py::arg("padding"), py::arg("dilation"),
        py::arg("groups"), py::arg("out_hw"), py::arg("side") = false);
  m.def("channel_stats", &lightning_cafin::channel_stats,
        R"doc(Per-channel sum (square=False) or sum of squares (square=True) of t over every
dim but ``dim``, accumulated in float32, times float(1/divisor) when divisor > 0.
t: CUDA tensor, float32 / float16 / bfloat16, any strides.  Returns float32 [t.size(dim)].
side=True: on the device's capture side stream, as conv_input_stats.)doc",
        py::arg("t"), py::arg("dim"), py::arg("square"), py::arg("divisor") = 0.0, py::arg("side") = false);
  m.def("layer_stats", &lightning_cafin::layer_stats,
        R"doc(One layer's capture statistics in one call: (h, s), float32.

h from x: input_op (0, dim, square) is channel_stats(x, dim, square, input_div);
(1, kh, kw, sh, sw, pad_top, pad_left, dh, dw, groups, Ho, Wo) is conv_input_stats (a
3-D x is read as a 2-D map of height 1).  s is channel_stats(grad, grad_dim, grad_square,
grad_div).  side=True: both on the capture side stream, ordered after the current stream
once, x and grad marked as read there (join before reading the results).  CPU tensors
(any floating dtype) are computed with ATen ops instead (the taps' reference).)doc",
        py::arg("x"), py::arg("grad"), py::arg("input_op"), py::arg("input_div"), py::arg("grad_dim"),
        py::arg("grad_square"), py::arg("grad_div"), py::arg("side") = false);
  m.def("norm_stats", &lightning_cafin::norm_stats,
        R"doc(A norm's capture statistics from its saved means and bias gradient: (h, s), float32,
one allocation and (CUDA) one launch.  means: a batch norm's 1-D per-channel means, or a
layer norm's per-row means (3 or more dims), summed over every dim but dim 1; h = that sum
times float(mean_scale).  s = bias_grad (1-D) as a float32 copy.  CPU tensors are computed
with ATen ops (the reference).)doc",
        py::arg("means"), py::arg("bias_grad"), py::arg("mean_scale"));
  py::class_<lightning_cafin::TapSink, std::shared_ptr<lightning_cafin::TapSink>>(
      m, "TapSink", "One layer's statistics from the gradient taps fired since they were last taken.")
      .def(py::init<>())
      .def("take", &lightning_cafin::TapSink::take,
           "Every (h, hn, s, sn) added since the last take, oldest first; the sink is then empty.")
      .def("__len__", &lightning_cafin::TapSink::size);
  py::class_<lightning_cafin::TakenSums, std::shared_ptr<lightning_cafin::TakenSums>>(
      m, "TakenSums", "Every layer's sums of one capture step (take_single), held for FactorLaunch.run.")
      .def(py::init([](std::vector<at::Tensor> h, std::vector<at::Tensor> s) {
             TORCH_CHECK(h.size() == s.size(), "TakenSums: h and s must have one entry per layer each, got ",
                         h.size(), " and ", s.size());
             auto taken = std::make_shared<lightning_cafin::TakenSums>();
             taken->h = std::move(h);
             taken->s = std::move(s);
             return taken;
           }),
           "The sums of layers given directly (what take_single hands FactorLaunch.run).", py::arg("h"),
           py::arg("s"))
      .def_readonly("h", &lightning_cafin::TakenSums::h, "The layers' h, in the order of the sinks.")
      .def_readonly("s", &lightning_cafin::TakenSums::s, "The layers' s, in the order of the sinks.")
      .def("__len__", [](const lightning_cafin::TakenSums& t) { return t.h.size(); });
  m.def("take_single",
        py::overload_cast<const std::vector<std::shared_ptr<lightning_cafin::TapSink>>&, const std::vector<at::Tensor>&,
                          const std::vector<int64_t>&, const std::vector<double>&, const std::vector<int64_t>&,
                          const std::vector<double>&>(&lightning_cafin::take_single),
        R"doc(The usual capture step's sums in one call: a TakenSums with every sink's one result,
taken only where each sink holds exactly one whose h and s are float32, contiguous, 1-D, of
nh[i] and ns[i] elements on like[i]'s device and counted hn[i] and sn[i]; otherwise None,
and nothing is taken.)doc",
        py::arg("sinks"), py::arg("like"), py::arg("nh"), py::arg("hn"), py::arg("ns"), py::arg("sn"));
  m.def(
      "autocast_copy",
      [](const at::Tensor& x, const at::Tensor& output) -> std::optional<at::Tensor> {
        at::Tensor copy = lightning_cafin::autocast_copy(x, output);
        if (!copy.defined()) return std::nullopt;
        return copy;
      },
      R"doc(The copy of x that a Linear-like layer computed on under autocast (the output's dtype,
2-D: rows by x's last dim), as autograd saved it for the weight's gradient, where the graph
shows it is x cast; None elsewhere (saved-tensor hooks, a frozen weight, an x that is a leaf or
needs no gradient, other ops).  TapPlan.tap_read taps it in x's place.)doc",
      py::arg("x"), py::arg("output"));
  py::class_<lightning_cafin::SinkSet, std::shared_ptr<lightning_cafin::SinkSet>>(
      m, "SinkSet",
      R"doc(take_single's arguments (sinks, like, nh, hn, ns, sn), checked and converted once, for a
launch kept across capture steps: take() is take_single with them.)doc")
      .def(py::init<std::vector<std::shared_ptr<lightning_cafin::TapSink>>, const std::vector<at::Tensor>&,
                    std::vector<int64_t>, std::vector<double>, std::vector<int64_t>, std::vector<double>>(),
           py::arg("sinks"), py::arg("like"), py::arg("nh"), py::arg("hn"), py::arg("ns"), py::arg("sn"))
      .def(
          "take", [](const lightning_cafin::SinkSet& set) { return lightning_cafin::take_single(set); },
          "take_single with this set's arguments: a TakenSums, or None (nothing taken).")
      .def("__len__", [](const lightning_cafin::SinkSet& set) { return set.sinks.size(); });
  py::class_<lightning_cafin::HostFlags, std::shared_ptr<lightning_cafin::HostFlags>>(
      m, "HostFlags",
      R"doc(One FactorLaunch.run's NaN flags (1: that layer's statistics held a NaN and its factors
were left as they were), written by the kernel into pinned host memory.)doc")
      .def("values", &lightning_cafin::HostFlags::values,
           "The flags, one per layer; the first call waits for the launch (without the GIL).")
      .def("ready", &lightning_cafin::HostFlags::ready, "Whether values() would not wait.")
      .def("__len__", &lightning_cafin::HostFlags::size);
  py::class_<lightning_cafin::FactorLaunch, std::shared_ptr<lightning_cafin::FactorLaunch>>(
      m, "FactorLaunch",
      R"doc(factor_update_'s per-layer arguments after the sums (H, S, kinds, flags, h_div, s_div,
s_scale, extra), checked as factor_update_ checks them and made into launch items once, for a
launch kept across capture steps.)doc")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, const std::vector<int64_t>&,
                    const std::vector<int64_t>&, const std::vector<double>&, const std::vector<double>&,
                    const std::vector<double>&, const std::vector<double>&>(),
           py::arg("H"), py::arg("S"), py::arg("kinds"), py::arg("flags"), py::arg("h_div"), py::arg("s_div"),
           py::arg("s_scale"), py::arg("extra"))
      .def("run", &lightning_cafin::FactorLaunch::run,
           R"doc(factor_update_ of the sums take_single took, on the current stream of the factors'
device: a HostFlags.  Not while that stream is being captured into a CUDA graph.)doc",
           py::arg("taken"), py::arg("c_old"), py::arg("c_new"))
      .def("__len__", &lightning_cafin::FactorLaunch::size);
  py::class_<lightning_cafin::TapPlan, std::shared_ptr<lightning_cafin::TapPlan>>(
      m, "TapPlan",
      R"doc(One layer's gradient tap for one pair of shapes: its sink and layer_stats' arguments
(input_op, input_div, grad_dim, grad_square, grad_div) with the counts hn, sn added with the
sums.  Made once per layer and shapes; each tap is then one call of three arguments.)doc")
      .def(py::init<std::shared_ptr<lightning_cafin::TapSink>, std::vector<int64_t>, double, int64_t, bool, double,
                    double, double, double>(),
           py::arg("sink"), py::arg("input_op"), py::arg("input_div"), py::arg("grad_dim"), py::arg("grad_square"),
           py::arg("grad_div"), py::arg("hn"), py::arg("sn"), py::arg("mean_scale") = 0.0)
      .def_property_readonly(
          "norm_taps", [](const lightning_cafin::TapPlan& self) { return self.norm_taps.load(); },
          "Taps registered on a norm's backward node (mean_scale > 0): statistics from its saved means and "
          "its bias gradient, no pass over the activation or the gradient.")
      .def_property_readonly(
          "deferred_norm_taps", [](const lightning_cafin::TapPlan& self) { return self.deferred_norm_taps.load(); },
          "Norm taps whose statistics were left to the end of their backward, where one launch computes every "
          "such norm's (from the bias gradient this backward computed, whatever became of .grad).")
      .def_property_readonly(
          "cast_taps", [](const lightning_cafin::TapPlan& self) { return self.cast_taps.load(); },
          "tap_read calls that found the layer's autocast copy of x saved for its backward: the copy is read "
          "there with the gradient, nothing in the forward.")
      .def("tap",
           [](std::shared_ptr<lightning_cafin::TapPlan> self, const at::Tensor& x, const at::Tensor& output,
              bool side) { lightning_cafin::tap(self, x, output, side); },
           R"doc(Register on ``output`` (requiring grad) a C++ hook (a pre hook of its backward node,
as a tensor hook is; a tensor hook on a leaf) that, when the gradient of that value arrives,
calls layer_stats(x, grad, input_op, input_div, grad_dim, grad_square, grad_div, side), adds
(h, hn, s, sn) to the sink and lets go of x (held as given until then; detached where x is
output itself); a second backward through a retained graph adds nothing.  CPU tensors take
layer_stats' ATen reference.  A norm's plan (mean_scale > 0) on a training batch norm's
or a layer norm's output whose bias needs a gradient registers instead a post hook on its
backward node: h from its saved means * mean_scale, s = its bias gradient (summed from its
output gradient in a backward computing none).)doc",
           py::arg("x"), py::arg("output"), py::arg("side") = false)
      .def("tap_gradient",
           [](std::shared_ptr<lightning_cafin::TapPlan> self, const at::Tensor& output, const at::Tensor& h, double hn,
              bool side) { lightning_cafin::tap_gradient(self, output, h, hn, side); },
           R"doc(As tap where the input's statistics (h, hn) were read in the forward: the hook
computes s = channel_stats(grad, grad_dim, grad_square, grad_div, side) (the ATen reference
for a CPU gradient) and adds (h, hn, s, sn) to the sink, once per graph.)doc",
           py::arg("output"), py::arg("h"), py::arg("hn"), py::arg("side") = false)
      .def("tap_read",
           [](std::shared_ptr<lightning_cafin::TapPlan> self, const at::Tensor& x, const at::Tensor& output,
              bool side) { lightning_cafin::tap_read(self, x, output, side); },
           R"doc(As tap_gradient with (h, hn) read from x now: h = layer_stats' input sums of x
(input_op, input_div) computed in this call on the current stream (the ATen reference for a
CPU x), hn the plan's.  For an x that may change in place or be gone by the backward.  Where a
Linear-like layer computed on an autocast copy of x that autograd saved for its backward
(autocast_copy), that copy is tapped as plan.tap would tap x instead (read with the gradient in
the backward; counted by cast_taps).  A norm's plan whose norm saved its means (a layer norm
computing in float32 on a bf16 x under autocast) takes plan.tap's norm tap, reading nothing now
(counted by norm_taps), except under saved-tensor hooks.)doc",
           py::arg("x"), py::arg("output"), py::arg("side") = false);
  py::class_<lightning_cafin::ForwardTapHook, std::shared_ptr<lightning_cafin::ForwardTapHook>>(
      m, "ForwardTapHook",
      R"doc(A captured layer's forward hook (nn.Module's with_kwargs signature) that repeats the
layer's last tap in C++ where every condition the Python hook checks holds (capture_hook.h),
and otherwise calls ``fallback`` (the Python hook) with the same arguments.  ``module``: the
module it is registered on (held weakly); ``epoch_holder.value``: the settings epoch an open
gate must match; ``saved_hooks_top``: torch's reader of the innermost saved-tensor hooks, or
None where torch has none (then no check; else ATen is asked what the reader would return).)doc")
      .def(py::init<py::object, py::handle, py::object, py::object>(), py::arg("fallback"), py::arg("module"),
           py::arg("epoch_holder"), py::arg("saved_hooks_top"))
      .def("__call__", &lightning_cafin::ForwardTapHook::call, py::arg("module"), py::arg("args"),
           py::arg("kwargs"), py::arg("output"))
      .def(
          "repeat",
          [](lightning_cafin::ForwardTapHook& self, py::handle capture, py::object gate, const at::Tensor& x,
             const at::Tensor& output, py::object weight, std::shared_ptr<lightning_cafin::TapPlan> plan,
             bool read_now) { self.repeat(capture, std::move(gate), x, output, std::move(weight), plan, read_now); },
          R"doc(Repeat this forward's tap (plan.tap, or plan.tap_read when read_now) at the next
forwards like it: the same shapes and dtypes as x and output, the same trained weight,
while ``gate.epoch`` is the settings epoch (``gate.side``: the side stream); the tap counts
up ``capture.taps_out`` (the capture held weakly).)doc",
          py::arg("capture"), py::arg("gate"), py::arg("x"), py::arg("output"), py::arg("weight"), py::arg("plan"),
          py::arg("read_now"))
      .def("forget", &lightning_cafin::ForwardTapHook::forget, "Stop repeating: every call goes to the fallback.")
      .def_property_readonly("repeating", &lightning_cafin::ForwardTapHook::repeating)
      .def_property_readonly("fallback", &lightning_cafin::ForwardTapHook::fallback)
      .def_property_readonly(
          "forward_then_hook", [](py::object self) { return lightning_cafin::ForwardTapHook::forward_then_hook(self); },
          R"doc(A function f(module, *args, **kwargs) for the module's forward override (bound to
the module by a functools.partial): type(module).forward(module, *args, **kwargs), then this
hook with (module, args, kwargs, output) where module is the one it is registered on;
returns the forward's output.  One C call where a Python override would add a frame and a
call of this hook (a new function each time asked, holding this hook).)doc")
      .def_property_readonly("_lightning_cafin_capture", [](const lightning_cafin::ForwardTapHook&) { return true; })
      // a deep copy of a model copies its hook dicts: the hook is shared, as a Python function would be
      .def("__copy__", [](py::object self) { return self; })
      .def("__deepcopy__", [](py::object self, py::handle) { return self; }, py::arg("memo"));
  m.def("capture_side_enter", &lightning_cafin::side_enter,
        R"doc(Make the capture side stream of reads[0]'s device current on this thread, after it
waits for the current stream's work, with every tensor of reads marked as read there.
Returns False (nothing changed) for CPU tensors or while a CUDA graph is being captured;
each True must be followed by capture_side_exit().)doc",
        py::arg("reads"));
  m.def("capture_side_exit", &lightning_cafin::side_exit, "Restore the stream capture_side_enter replaced.");
  m.def("capture_side_high_priority", &lightning_cafin::set_side_high_priority,
        R"doc(Whether the capture side stream used from now on is one of torch's high-priority
streams (True) or a default-priority one (False, the default); returns the setting before.)doc",
        py::arg("high"));
  m.def("capture_defer_norms", &lightning_cafin::set_defer_norms,
        R"doc(Whether a norm tap may leave its statistics to the end of its backward, where one launch
computes every such norm's (True, the default), or always launches in its hook (False); returns
the setting before.  The same floats either way.)doc",
        py::arg("on"));
  m.def("capture_join", &lightning_cafin::capture_join,
        "The current stream of every device with side-stream statistics waits for them.");
  m.def("capture_release", &lightning_cafin::capture_release,
        "After the statistics were consumed: the side streams wait for the current streams.");
  m.def("factor_update_", &lightning_cafin::factor_update_,
        R"doc(The capture step's factor update for every layer in one launch (per 56 layers).

Per layer i: float32 contiguous 1-D h[i], s[i] (the combined partial sums) and the stored
factors H[i], S[i] (updated in place).  kinds[i] 0 (Linear / Conv2d: H_raw = h / h_div,
plus a last entry `extra` when flags & 1) or 1 (two columns: H_raw = [sum h^2 / h_div,
extra], S_raw squares the sums); S_raw = s / s_scale (when flags & 4) / s_div.  NaN in
H_raw or S_raw: the layer's factors are left alone and its entry of the returned int32
[L] tensor is 1.  Else inf -> 1, -inf -> 0, min-max normalise (eps 1e-6) and
stored <- stored * c_old + v_hat * c_new (stored read as ones when flags & 2).)doc",
        py::arg("h"), py::arg("s"), py::arg("H"), py::arg("S"), py::arg("kinds"), py::arg("flags"),
        py::arg("h_div"), py::arg("s_div"), py::arg("s_scale"), py::arg("extra"), py::arg("c_old"),
        py::arg("c_new"));

  m.attr("CHUNK_SIZE") = lightning_cafin::kStepChunkSize;
  m.attr("BLOCK_SIZE") = lightning_cafin::kStepBlockSize;
  m.attr("MAX_TENSORS_PER_LAUNCH") = lightning_cafin::kStepMaxTensors;
  m.attr("MAX_STEPS_PER_INCREMENT_LAUNCH") = lightning_cafin::kIncMaxTensors;
  m.attr("FACTOR_MAX_LAYERS_PER_LAUNCH") = lightning_cafin::kFactorMaxLayers;
}
