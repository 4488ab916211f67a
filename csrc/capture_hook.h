// A captured layer's forward hook that repeats the layer's last C++ tap without entering
// Python (lightning_cafin/capture/forward_capture.py, "the forward's repeat").
//
// On a capture step every captured layer's forward calls its forward hook, and the usual
// forward repeats the last one: the same shapes and dtypes, the same weight, the same tap.
// The Python hook checks that and taps through a chain of Python calls, about 10 of the
// ~17 microseconds an armed, tapped forward adds on a CPU (more on a slow host, where a
// capture step is host-bound).  This hook object sits in the module's hook dict in its
// place: where the repeat's conditions hold it registers the tap itself; anything else
// calls the Python hook (`fallback`), which decides as before and may set the repeat again.
//
// The conditions, each the Python path's:
// - per call, here: the hook's own module (a deep copy shares the hook), a training forward
//   with grad on, args[0] and the output tensors, the output requiring grad, the recorded
//   shapes and dtypes, the recorded weight still the module's `weight` and trained, no
//   saved-tensor hook active (where `saved_hooks_top`, torch's reader of the innermost one,
//   is not None: ATen's answer to what that reader returns, asked without calling it),
//   compiled autograd not enabled, the capture still alive;
// - per step, by the owner's gate (tap_gate.py): open (`gate.epoch`) only at the settings
//   epoch of the general-path forward that opened it (`epoch_holder.value`), which every
//   change of a setting or of the schedule leaves behind: a capture step, taps on, the
//   kernels in use, no `no_capture()` block open; `gate.side` is the side-stream choice.
// The tap made is TapPlan.tap (or TapPlan.tap_read of x as given, for a layer computing on
// an autocast copy), and the capture's `taps_out` is counted up, as the Python path does.
//
// Where the module's forward is overridden (lightning_cafin/capture/hooks.py: armed, the
// module's `forward` set on the instance so that nn.Module takes its no-hook path), the
// override calls `forward_then_hook` instead of a Python function that calls this hook: the
// class's forward, then the hook, in one C call bound to this object.  A Python override
// frame, its slot lookup and a pybind11 call of the hook were about 1.5 of the ~3.1
// microseconds an armed, repeated tap added to a layer's forward on a CPU (40 Linear layers).
//
// Every Python object it refers to but the gate is held weakly (the fallback, the module,
// the capture, the weight): the garbage collector cannot see through this object, so a
// strong reference from it into a reference cycle (the Python hook's closure refers to the
// hook dict holding this object) would keep that cycle alive, and a dropped model's
// weights must not live on in a hook.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <optional>
#include <vector>

#include "capture_tap.h"

namespace lightning_cafin {

class ForwardTapHook {
 public:
  ForwardTapHook(pybind11::object fallback, pybind11::handle module, pybind11::object epoch_holder,
                 pybind11::object saved_hooks_top);

  // nn.Module's forward-hook call (with_kwargs): None where the repeat tapped, else the fallback's result
  pybind11::object call(pybind11::handle module, pybind11::handle args, pybind11::handle kwargs,
                        pybind11::handle output);
  // The override's function: f(module, *args, **kwargs) runs type(module).forward(module,
  // *args, **kwargs), then this hook as `call` would (module, args, kwargs, output) where
  // `module` is this hook's module (a shallow copy shares the override, bound to the
  // original), and returns the forward's output.  A builtin function bound to a capsule
  // that keeps `self` (this hook's Python object) alive.
  static pybind11::object forward_then_hook(pybind11::object self);
  // Repeat this tap from now on where the conditions above hold (x and output: the forward just tapped).
  void repeat(pybind11::handle capture, pybind11::object gate, const at::Tensor& x, const at::Tensor& output,
              pybind11::object weight, std::shared_ptr<const TapPlan> plan, bool read_now);
  void forget() { repeat_.reset(); }
  bool repeating() const { return repeat_.has_value(); }
  pybind11::object fallback() const;

 private:
  struct Repeat {
    pybind11::object capture_ref, gate, weight_ref;
    std::vector<int64_t> x_sizes, out_sizes;
    at::ScalarType x_dtype, out_dtype;
    std::shared_ptr<const TapPlan> plan;
    bool read_now;
  };
  // Whether the repeat's conditions hold for this forward (x: its first positional
  // argument, or null) and its tap was taken.
  bool tapped(const Repeat& r, PyObject* module, PyObject* x, PyObject* output) const;
  // forward_then_hook's hook part: the repeat where it holds, else the fallback, called
  // with the forward's arguments as nn.Module passes them to a forward hook.
  void after_forward(PyObject* module, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, PyObject* output);
  static PyObject* forward_then_hook_call(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs,
                                          PyObject* kwnames);

  pybind11::object fallback_ref_, module_ref_, epoch_holder_, saved_hooks_top_;
  std::optional<Repeat> repeat_;
};

}  // namespace lightning_cafin
