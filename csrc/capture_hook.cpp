// The forward hook repeating a layer's last tap (capture_hook.h).
#include "capture_hook.h"
#include "record_op.h"

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace lightning_cafin {
namespace {

// Attribute names, interned once (a lookup per call then hashes nothing).
struct Names {
  PyObject *training, *parameters, *weight, *epoch, *value, *side, *taps_out, *compiled_autograd_enabled, *forward;
  PyObject* compiled_autograd_module;
  Names()
      : training(PyUnicode_InternFromString("training")),
        parameters(PyUnicode_InternFromString("_parameters")),
        weight(PyUnicode_InternFromString("weight")),
        epoch(PyUnicode_InternFromString("epoch")),
        value(PyUnicode_InternFromString("value")),
        side(PyUnicode_InternFromString("side")),
        taps_out(PyUnicode_InternFromString("taps_out")),
        compiled_autograd_enabled(PyUnicode_InternFromString("compiled_autograd_enabled")),
        forward(PyUnicode_InternFromString("forward")),
        compiled_autograd_module(PyUnicode_InternFromString("torch._dynamo.compiled_autograd")) {}
};
const Names& names() {
  static const Names* n = new Names();  // (never freed: the interpreter may outlive static destructors)
  return *n;
}

// obj.name as a new reference, or null with no Python error left set.
py::object attr(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return py::reinterpret_steal<py::object>(v);
}

// obj.name is True (a missing attribute or an error: false).
bool is_true(PyObject* obj, PyObject* name) {
  const py::object v = attr(obj, name);
  if (!v) return false;
  const int t = PyObject_IsTrue(v.ptr());
  if (t < 0) PyErr_Clear();
  return t == 1;
}

// obj.name as an integer, or `otherwise` (not an int, missing).
long long int_attr(PyObject* obj, PyObject* name, long long otherwise) {
  const py::object v = attr(obj, name);
  if (!v || !PyLong_Check(v.ptr())) return otherwise;
  const long long out = PyLong_AsLongLong(v.ptr());
  if (out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return otherwise;
  }
  return out;
}

bool compiled_autograd_enabled() {
  const Names& n = names();
  PyObject* module = PyDict_GetItem(PyImport_GetModuleDict(), n.compiled_autograd_module);  // borrowed
  return module != nullptr && is_true(module, n.compiled_autograd_enabled);
}

// The capsule behind forward_then_hook: the hook's C++ object, its Python object as the
// context (a strong reference, dropped with the capsule).
const char* const kCapsule = "lightning_cafin.ForwardTapHook";

void drop_capsule(PyObject* capsule) {
  Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(capsule)));
}

}  // namespace

ForwardTapHook::ForwardTapHook(py::object fallback, py::handle module, py::object epoch_holder,
                               py::object saved_hooks_top)
    : epoch_holder_(std::move(epoch_holder)), saved_hooks_top_(std::move(saved_hooks_top)) {
  TORCH_CHECK(PyCallable_Check(fallback.ptr()), "ForwardTapHook: fallback must be callable");
  fallback_ref_ = py::reinterpret_steal<py::object>(PyWeakref_NewRef(fallback.ptr(), nullptr));
  if (!fallback_ref_) throw py::error_already_set();
  module_ref_ = py::reinterpret_steal<py::object>(PyWeakref_NewRef(module.ptr(), nullptr));
  if (!module_ref_) throw py::error_already_set();
}

py::object ForwardTapHook::fallback() const {
  return py::reinterpret_borrow<py::object>(PyWeakref_GetObject(fallback_ref_.ptr()));
}

void ForwardTapHook::repeat(py::handle capture, py::object gate, const at::Tensor& x, const at::Tensor& output,
                            py::object weight, std::shared_ptr<const TapPlan> plan, bool read_now) {
  TORCH_CHECK(plan != nullptr, "ForwardTapHook.repeat: plan must be a TapPlan, got None");
  TORCH_CHECK(THPVariable_Check(weight.ptr()), "ForwardTapHook.repeat: weight must be a tensor");
  auto capture_ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(capture.ptr(), nullptr));
  if (!capture_ref) throw py::error_already_set();
  auto weight_ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(weight.ptr(), nullptr));
  if (!weight_ref) throw py::error_already_set();
  repeat_ = Repeat{std::move(capture_ref), std::move(gate), std::move(weight_ref), x.sizes().vec(),
                   output.sizes().vec(), x.scalar_type(), output.scalar_type(), std::move(plan), read_now};
}

py::object ForwardTapHook::call(py::handle module, py::handle args, py::handle kwargs, py::handle output) {
  LIGHTNING_CAFIN_RECORD_OP("ForwardTapHook");
  PyObject* const a = args.ptr();
  PyObject* const x = PyTuple_Check(a) && PyTuple_GET_SIZE(a) >= 1 ? PyTuple_GET_ITEM(a, 0) : nullptr;
  if (repeat_ && tapped(*repeat_, module.ptr(), x, output.ptr())) return py::none();
  const py::object hook = fallback();
  if (hook.is_none()) return py::none();  // its owner is gone: nothing is bound to this module
  return hook(module, args, kwargs, output);
}

py::object ForwardTapHook::forward_then_hook(py::object self) {
  static PyMethodDef def = {"forward_then_hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
                                                     &ForwardTapHook::forward_then_hook_call)),
                            METH_FASTCALL | METH_KEYWORDS,
                            "f(module, *args, **kwargs): type(module).forward(module, *args, **kwargs), then the "
                            "module's ForwardTapHook; returns the forward's output."};
  auto* hook = self.cast<ForwardTapHook*>();
  auto capsule = py::reinterpret_steal<py::object>(PyCapsule_New(hook, kCapsule, drop_capsule));
  if (!capsule || PyCapsule_SetContext(capsule.ptr(), self.inc_ref().ptr()) != 0) throw py::error_already_set();
  auto function = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, capsule.ptr(), nullptr));
  if (!function) throw py::error_already_set();
  return function;
}

PyObject* ForwardTapHook::forward_then_hook_call(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs,
                                                 PyObject* kwnames) {
  HANDLE_TH_ERRORS
  auto* hook = static_cast<ForwardTapHook*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (hook == nullptr) return nullptr;
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "forward_then_hook: the module must be the first argument");
    return nullptr;
  }
  PyObject* const module = args[0];
  auto forward = py::reinterpret_steal<py::object>(
      PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(module)), names().forward));
  if (!forward) return nullptr;
  auto output = py::reinterpret_steal<py::object>(PyObject_Vectorcall(forward.ptr(), args, nargs, kwnames));
  if (!output) return nullptr;
  hook->after_forward(module, args + 1, nargs - 1, kwnames, output.ptr());
  return output.release().ptr();
  END_HANDLE_TH_ERRORS
}

void ForwardTapHook::after_forward(PyObject* module, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                                   PyObject* output) {
  LIGHTNING_CAFIN_RECORD_OP("ForwardTapHook");
  if (PyWeakref_GetObject(module_ref_.ptr()) != module) return;  // (not the module this hook is on)
  if (repeat_ && tapped(*repeat_, module, nargs >= 1 ? args[0] : nullptr, output)) return;
  const py::object hook = fallback();
  if (hook.is_none()) return;
  // the forward's arguments as nn.Module hands them to a forward hook with kwargs
  py::tuple positional(nargs);
  for (Py_ssize_t i = 0; i < nargs; ++i) positional[i] = py::reinterpret_borrow<py::object>(args[i]);
  py::dict keywords;
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t i = 0; i < nkw; ++i) {
    keywords[py::handle(PyTuple_GET_ITEM(kwnames, i))] = py::handle(args[nargs + i]);
  }
  hook(py::handle(module), positional, keywords, py::handle(output));  // (its result is not the output's)
}

bool ForwardTapHook::tapped(const Repeat& r, PyObject* module, PyObject* x_obj, PyObject* output) const {
  const Names& n = names();
  if (PyWeakref_GetObject(module_ref_.ptr()) != module) return false;
  // the owner's gate, open at the current settings epoch (step-level conditions)
  const long long epoch = int_attr(r.gate.ptr(), n.epoch, -1);
  if (epoch < 0 || epoch != int_attr(epoch_holder_.ptr(), n.value, -2)) return false;
  if (x_obj == nullptr || !THPVariable_Check(output)) return false;
  if (!THPVariable_Check(x_obj) || !at::GradMode::is_enabled() || !is_true(module, n.training)) return false;
  const at::Tensor& x = THPVariable_Unpack(x_obj);
  const at::Tensor& out = THPVariable_Unpack(output);
  if (!out.requires_grad() || x.scalar_type() != r.x_dtype || out.scalar_type() != r.out_dtype ||
      x.sizes() != at::IntArrayRef(r.x_sizes) || out.sizes() != at::IntArrayRef(r.out_sizes)) {
    return false;
  }
  const py::object params = attr(module, n.parameters);
  if (!params || !PyDict_Check(params.ptr())) return false;
  PyObject* weight = PyDict_GetItem(params.ptr(), n.weight);  // borrowed
  if (weight == nullptr || !THPVariable_Check(weight) || weight != PyWeakref_GetObject(r.weight_ref.ptr()) ||
      !THPVariable_Unpack(weight).requires_grad()) {
    return false;
  }
  // saved-tensor hooks decide where x goes: the Python path reads it.  What the Python
  // reader (torch._C._autograd._top_saved_tensors_default_hooks(False)) answers, asked of
  // ATen directly: a Python call per layer cost about a microsecond of the forward.
  if (!saved_hooks_top_.is_none() && at::SavedTensorDefaultHooks::get_hooks().has_value()) return false;
  if (compiled_autograd_enabled()) return false;
  PyObject* capture = PyWeakref_GetObject(r.capture_ref.ptr());  // borrowed
  if (capture == Py_None) return false;
  const py::object taps_out = attr(capture, n.taps_out);
  if (!taps_out || !PyLong_Check(taps_out.ptr())) return false;
  const bool side = is_true(r.gate.ptr(), n.side);
  if (r.read_now) {
    tap_read(r.plan, x, out, side);
  } else {
    tap(r.plan, x, out, side);
  }
  auto more = py::reinterpret_steal<py::object>(PyNumber_Add(taps_out.ptr(), py::int_(1).ptr()));
  if (!more || PyObject_SetAttr(capture, n.taps_out, more.ptr()) < 0) throw py::error_already_set();
  return true;
}

}  // namespace lightning_cafin
