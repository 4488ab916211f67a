"""``AdaFisher`` and ``AdaFisherW``: ``torch.optim.Optimizer`` subclasses.

The optimizer owns the parameters, the per-parameter state (momentum and step count),
the layer factors and the capture schedule; a backend (``reference``, ``foreach``,
``fused``) only applies the update.  Parameters are paired with the modules whose
weight or bias they are *by identity*, never by position, so embeddings, frozen or
tied layers, free parameters and extra param groups all get their own ``F``.
"""

from __future__ import annotations

import copy
import logging
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Protocol, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ._validation import check_hyperparameters, reject_unknown_kwargs
from .backends import BACKEND_NAMES, FactorView, StepBackend, StepBatch, StepHyper, make_backend
from .backends.foreach import ForeachBackend
from .backends.fused import unsupported_reason as fused_unsupported_reason
from .capture.distributed import all_reduce_pending
from .capture.factors import CaptureReport, update_factors
from .capture import streams as capture_streams
from .capture.hooks import LayerCapture, attach, detach
from .capture.layers import ParamSlot, check_layers, rule_for, unseen_parameters
from .skips import DeferredSkips

log = logging.getLogger("lightning_cafin")

_STATE_KEY = "cafin"
_STATE_FORMAT = 1
_KNOWN_ARGS = ["params", "lr", "beta", "gamma", "Lambda", "TCov", "weight_decay", "backend", "layers"]

Params = Union[nn.Module, Iterable[Tensor], Iterable[dict]]

#: Models an unbound AdaFisher may bind itself to at its first step, with the optimizers that did.
_OFFERED_MODELS: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def offer_model(model: nn.Module) -> None:
    """Let any unbound AdaFisher whose parameters all belong to ``model`` bind to it at its first step."""
    _OFFERED_MODELS.setdefault(model, weakref.WeakSet())


def withdraw_model(model: nn.Module) -> None:
    """Stop offering ``model`` and unbind the optimizers that bound themselves to it."""
    for opt in list(_OFFERED_MODELS.pop(model, ())):
        if opt._model is model:
            opt.unbind()


class StepObserver(Protocol):
    """Something that watches the update (a monitor); see ``add_step_observer``."""

    def before_update(self, optimizer: "_AdaFisherBase") -> None: ...

    def after_update(self, optimizer: "_AdaFisherBase") -> None: ...


class _AdaFisherBase(Optimizer):
    """Shared machinery of AdaFisher and AdaFisherW (they differ only in weight decay)."""

    _decoupled = False
    # A loss scaler hands us grad_scale / found_inf instead of unscaling the gradients,
    # so a skipped step can leave the factors and counters untouched.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Params,
        lr: Union[float, Tensor] = 1e-3,
        beta: float = 0.9,
        gamma: float = 0.8,
        Lambda: float = 1e-3,
        TCov: int = 100,
        weight_decay: float = 0.0,
        *,
        backend: str = "auto",
        layers: str = "all",
        **kwargs: Any,
    ) -> None:
        reject_unknown_kwargs(type(self).__name__, kwargs, _KNOWN_ARGS)
        check_hyperparameters(lr, beta, gamma, Lambda, TCov, weight_decay)
        self._layers = check_layers(layers)
        model = params if isinstance(params, nn.Module) else None
        if model is not None:
            params = list(model.parameters())
        self._init_bookkeeping()
        defaults = dict(lr=lr, beta=beta, gamma=gamma, Lambda=Lambda, TCov=TCov, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.set_backend(backend)
        if model is not None:
            self.bind(model)

    def _init_bookkeeping(self) -> None:
        self._captures: dict[str, LayerCapture] = {}
        self._slots: dict[int, tuple[LayerCapture, ParamSlot]] = {}
        self._param_names: dict[int, str] = {}
        self._model: Optional[nn.Module] = None
        #: bound modules on F = 1 for a reason (used functionally, hooks cannot see them): name -> reason
        self._unseen: dict[str, str] = {}
        self._saved_factors: dict[str, dict[str, Tensor]] = {}
        self._global_step = 0  # steps taken; provisional by the skip flags still in flight
        self._skips = DeferredSkips()
        self._force_capture = False
        self._factors_version = 0
        self._summary: Optional[str] = None
        self._warned: set[str] = set()
        self._unread_report: Optional[CaptureReport] = None
        self._health: dict[str, Any] = {
            "skipped_steps": 0,
            "capture_steps": 0,
            "modules_not_fired": [],
            "non_finite_statistics": 0,
            "params_f_one": 0,
        }
        self._backend: StepBackend = ForeachBackend()
        self._fallback = ForeachBackend()
        self._observers: list[StepObserver] = []
        self._plans: dict[int, tuple] = {}
        self._plan_epoch = 0
        #: process group whose ranks' statistics are summed on capture steps (None: the default group)
        self.statistics_group = None

    def __setstate__(self, state: dict) -> None:
        # torch calls this from load_state_dict (keep our binding) and on unpickling
        # (where only torch's own fields exist).
        if not hasattr(self, "_captures"):
            self._init_bookkeeping()
        super().__setstate__(state)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)  # may be a generator
        param_group = {**param_group, "params": params}
        for p in params:
            if isinstance(p, Tensor) and torch.is_complex(p):
                raise TypeError(
                    f"{type(self).__name__} does not support complex parameters (got one of dtype {p.dtype}); "
                    "optimise torch.view_as_real(param) instead"
                )
        for key in ("gamma", "TCov"):
            if key in param_group and param_group[key] != self.defaults[key]:
                raise ValueError(
                    f"{key}={param_group[key]!r} in a param group differs from the optimizer's {key}="
                    f"{self.defaults[key]!r}: the factor schedule is shared by all groups; set {key} on the optimizer"
                )
        merged = {**self.defaults, **param_group}
        check_hyperparameters(*(merged[k] for k in ("lr", "beta", "gamma", "Lambda", "TCov", "weight_decay")))
        if isinstance(merged["lr"], Tensor) and "lr" not in param_group:
            # each group owns its lr tensor: a scheduler fills them one by one, in place
            param_group["lr"] = merged["lr"].clone()
        super().add_param_group(param_group)
        self._replan()
        if self._model is not None:
            self._pair(self._model)

    # ----------------------------------------------------------------- backend
    @property
    def backend(self) -> str:
        """The name of the backend that runs the step (``auto`` already resolved)."""
        return self._backend.name

    def set_backend(self, name: str) -> None:
        """Switch the step implementation; state and factors carry over unchanged."""
        self._backend = make_backend(name)
        self._replan()

    # ----------------------------------------------------------------- binding
    def bind(self, model: nn.Module, *, warn_on_takeover: bool = True) -> "_AdaFisherBase":
        """Install the factor-capture hooks on ``model``'s supported layers.

        Idempotent: binding again (or binding another AdaFisher to the same model) never
        stacks hooks; each module keeps one hook, owned by the latest binder (with a
        warning when the previous owner is still alive, unless ``warn_on_takeover=False``).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"bind(model) needs a torch.nn.Module, got {type(model).__name__}")
        if self._model is not None and self._model is not model:
            self.unbind()
        self._model = model
        self._pair(model, warn_on_takeover)
        if not self._captures:
            warnings.warn(
                f"{type(self).__name__}: {type(model).__name__} has no supported layer (layers={self._layers!r}: "
                "see lightning_cafin.capture.layers) among the optimizer's parameters; every parameter uses F = 1",
                stacklevel=2,
            )
        return self

    def unbind(self) -> None:
        """Remove every hook this optimizer installed; its factors are kept for a later bind."""
        for cap in self._captures.values():
            if cap.S is not None:
                self._saved_factors[cap.name] = {"S": cap.S, "H": cap.H}
            detach(cap)
        self._captures, self._slots, self._model = {}, {}, None
        self._replan()

    @property
    def unseen_layers(self) -> dict[str, str]:
        """Supported layers left on F = 1 because their hooks cannot see them (their owner uses
        the weights functionally), with the reason: ``{module name: reason}`` (a copy)."""
        return dict(self._unseen)

    @property
    def is_bound(self) -> bool:
        return self._model is not None

    def _pair(self, model: nn.Module, warn_on_takeover: bool = True) -> None:
        in_optimizer = {id(p) for group in self.param_groups for p in group["params"]}
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        slots: dict[int, tuple[LayerCapture, ParamSlot]] = {}
        captures: dict[str, LayerCapture] = {}
        unseen = {**unseen_parameters(model), **getattr(self, "_unseen", {})}
        self._unseen = {}
        for name, module in model.named_modules():
            rule = rule_for(module, getattr(self, "_layers", "all"))
            if rule is None:
                continue
            if name in unseen:
                self._unseen[name] = unseen[name]
                continue
            mine = []
            for slot in rule.slots(module):
                p = getattr(module, slot.role, None)
                if isinstance(p, Tensor) and id(p) in in_optimizer and id(p) not in slots:
                    mine.append((p, slot))
            if not mine:
                continue
            cap = self._captures.get(name)
            if cap is None or cap.module is not module:
                cap = LayerCapture(name, module, rule, self._is_capture_step)
            captures[name] = cap
            for p, slot in mine:
                slots[id(p)] = (cap, slot)
        for name, cap in self._captures.items():
            if captures.get(name) is not cap:
                detach(cap)
        for cap in captures.values():
            if attach(cap) is not None and warn_on_takeover and "rebind" not in self._warned:
                self._warned.add("rebind")
                warnings.warn(
                    f"{type(self).__name__}: {cap.name!r} was bound to another live AdaFisher optimizer; its "
                    "hooks now feed this one (the other no longer updates those factors)",
                    stacklevel=3,
                )
        self._captures, self._slots = captures, slots
        self._replan()
        self._restore_saved_factors()
        self._summary = None

    # ------------------------------------------------------------------ status
    def _is_capture_step(self) -> bool:
        if self._force_capture:
            return True
        T = self.defaults["TCov"]
        self._count_skips(self._skips.poll())
        unsure = self._skips.in_flight  # each of these steps may yet turn out skipped
        if unsure and (self._global_step // T) * T >= self._global_step - unsure:
            # the unread flags decide it: wait for them (about once per TCov steps)
            self._count_skips(self._skips.settle())
        return self._global_step % T == 0

    def _count_skips(self, skipped: int) -> None:
        """Steps the kernel skipped on the device (found_inf), learnt after the fact."""
        if skipped:
            self._global_step -= skipped
            self._health["skipped_steps"] += skipped

    def _name(self, p: Tensor) -> str:
        if id(p) in self._param_names:
            return self._param_names[id(p)]
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{pi}]"
        return "<unknown parameter>"

    def summary(self) -> str:
        """One paragraph: how many parameters are preconditioned and how many use F = 1."""
        pre_t = pre_n = one_t = one_n = 0
        plain = []
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._slots:
                    pre_t, pre_n = pre_t + 1, pre_n + p.numel()
                else:
                    one_t, one_n = one_t + 1, one_n + p.numel()
                    plain.append(self._name(p))
        shown = ", ".join(plain[:6]) + (", ..." if len(plain) > 6 else "")
        text = (
            f"{type(self).__name__} [{self.backend}]: {pre_t} parameter tensors ({pre_n:,} elements) in "
            f"{len(self._captures)} layers are preconditioned; {one_t} tensors ({one_n:,} elements) use F = 1"
        )
        text += f" ({shown})" if plain else ""
        if self._unseen:
            text += "; on F = 1 because hooks cannot see them: " + "; ".join(
                f"{name} ({reason})" for name, reason in self._unseen.items())
        return text

    # -------------------------------------------------------------------- step
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One AdaFisher update; on capture steps the factors are re-estimated first.

        ``closure`` (optional) re-evaluates the model with gradients enabled and returns
        the loss, which is returned.  Under a loss scaler (``torch.amp.GradScaler``) the
        scaler's ``grad_scale`` / ``found_inf`` are honoured: a step with non-finite
        gradients changes nothing, factors, counters and pending statistics included.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale: Optional[Tensor] = getattr(self, "grad_scale", None)
        found_inf: Optional[Tensor] = getattr(self, "found_inf", None)
        with torch.no_grad():
            # found_inf is read on the host only where the host must know it: on capture
            # steps (the factors must not learn from a skipped step), for a parameter the
            # fused kernel does not take, or with an observer.  Otherwise the kernel
            # honours it on the device and the host learns it later (DeferredSkips).
            defer = found_inf is not None and found_inf.is_cuda and not self._observers
            if found_inf is not None and not defer and self._skip_if_found_inf(found_inf):
                return loss
            bound_now = self._first_step_notices()
            capture = self._is_capture_step() and not bound_now
            if defer and capture:
                if self._skip_if_found_inf(found_inf):
                    return loss
                defer = False
            if capture:
                self._capture(grad_scale)
            else:
                self._discard_pending()
            work = [(group, backend, batch) for group in self.param_groups for backend, batch in self._collect(group)]
            if defer and any(backend.name != "fused" for _, backend, _ in work):
                if self._skip_if_found_inf(found_inf):
                    return loss
                defer = False
            for observer in self._observers:
                observer.before_update(self)
            for group, backend, batch in work:
                backend.step(batch, self.hyper(group), grad_scale, found_inf if defer else None)
            if defer:
                self._skips.record(found_inf)
            self._global_step += 1
            self._force_capture = bound_now  # its hooks missed this step's forward: capture next step
            for observer in self._observers:
                observer.after_update(self)
        return loss

    def _skip_if_found_inf(self, found_inf: Tensor) -> bool:
        """Read ``found_inf`` (waits for the GPU); when set, drop this step's statistics."""
        if found_inf.item() == 0:
            return False
        self._discard_pending()
        self._health["skipped_steps"] += 1
        return True

    def _first_step_notices(self) -> bool:
        """The one-time summary and warnings; True when the optimizer bound itself just now."""
        if self._summary is not None:
            return False
        late = self._model is None and self._bind_offered_model()
        self._summary = self.summary()
        self._health["params_f_one"] = sum(
            1 for g in self.param_groups for p in g["params"] if id(p) not in self._slots
        )
        log.info(self._summary)
        if self._model is None and "unbound" not in self._warned:
            self._warned.add("unbound")
            warnings.warn(
                f"{type(self).__name__} is not bound to a model, so every parameter uses F = 1 (momentum SGD). "
                "Pass the model as the first argument, call optimizer.bind(model), or add "
                "lightning_cafin.CAFINCallback() to the Trainer's callbacks",
                stacklevel=3,
            )
        return late

    def _bind_offered_model(self) -> bool:
        """Bind to a model a CAFINCallback offered, if it holds all of this optimizer's parameters.

        Covers optimizers created where the callback cannot see them (a learning-rate
        search replaces the trainer's callbacks while it runs).
        """
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        for model, binders in list(_OFFERED_MODELS.items()):
            if mine <= {id(p) for p in model.parameters()}:
                self.bind(model, warn_on_takeover=False)
                binders.add(self)
                return True
        return False

    def _discard_pending(self) -> None:
        for cap in self._captures.values():
            if cap.pending.calls:
                cap.take_pending()

    def _capture(self, grad_scale: Optional[Tensor]) -> None:
        scale = None if grad_scale is None else float(grad_scale.item())
        capture_streams.join()  # the statistics were computed beside the backward pass
        all_reduce_pending(list(self._captures.values()), self.statistics_group)
        report = update_factors(list(self._captures.values()), self.defaults["gamma"], scale)
        capture_streams.release()
        self._factors_version += 1
        self._settle_capture_report()
        self._health["capture_steps"] += 1
        trainable = [n for n in report.not_fired if any(p.requires_grad for p in self._captures[n].module.parameters(recurse=False))]
        functional = [n for n in trainable if self._captures[n].S is None
                      and any(p.grad is not None for p in self._captures[n].module.parameters(recurse=False))]
        if functional:  # gradients but no hook call: the owner uses the weights functionally
            self._unbind_unseen(functional)
            trainable = [n for n in trainable if n not in functional]
        self._health["modules_not_fired"] = trainable
        # Which layers had NaN statistics is decided on the device by the capture kernels;
        # reading it now would make every capture step wait for the GPU, so it is read when
        # the health counters are, or at the next capture step.
        self._unread_report = report
        if report.settled:
            self._settle_capture_report()
        for name in trainable:
            self._warn_once(
                f"notfired:{name}",
                f"no training forward/backward reached {name!r} before a capture step; "
                "its factors were not updated (F = 1 until they are)" if self._captures[name].S is None else
                f"no training forward/backward reached {name!r} before a capture step; its factors were kept",
            )

    def _unbind_unseen(self, names: list[str]) -> None:
        """Move layers whose parameters get gradients although their hooks never fire to
        F = 1, with the reason, reported once by ``summary()`` instead of a warning per capture."""
        for name in names:
            cap = self._captures.pop(name)
            detach(cap)
            self._unseen[name] = ("its parameters get gradients but its forward hooks never fired: used "
                                  "functionally, e.g. F.linear(x, module.weight)")
            for key in [k for k, (c, _) in self._slots.items() if c is cap]:
                del self._slots[key]
        self._replan()
        self._summary = self.summary()
        self._health["params_f_one"] = sum(1 for g in self.param_groups for p in g["params"] if id(p) not in self._slots)
        log.info(self._summary)

    @property
    def health(self) -> dict[str, Any]:
        """Counters: skipped steps, capture steps, modules whose hooks never fired, non-finite
        statistics, parameters on F = 1.  Reading them settles the last capture step's
        device-side verdicts (at most one wait for the GPU).  Under a loss scaler,
        ``skipped_steps`` counts the steps whose found_inf flag has reached the host; a
        step or two still in flight on the GPU are counted when they arrive."""
        self._settle_capture_report()
        self._count_skips(self._skips.poll())
        return self._health

    def _settle_capture_report(self) -> None:
        report, self._unread_report = self._unread_report, None
        if report is None:
            return
        self._health["non_finite_statistics"] += len(report.non_finite)
        for name in report.non_finite:
            self._warn_once(f"nonfinite:{name}", f"non-finite statistics for {name!r}: its factors were kept unchanged")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{type(self).__name__}: {message}", stacklevel=4)

    def fisher_view(self, p: Tensor) -> Optional[FactorView]:
        """How ``p`` reads its F now (``None``: F = 1)."""
        entry = self._slots.get(id(p))
        if entry is None or entry[0].S is None:
            return None
        cap, slot = entry
        rows, cols, col_offset, ncols = slot.factor_layout(cap.S, cap.H)
        if rows.numel() * ncols != p.numel() or col_offset + ncols > cols.numel():
            self._warn_once(f"shape:{cap.name}", f"factors of {cap.name!r} do not fit {self._name(p)}; using F = 1")
            return None
        return FactorView(rows, cols, col_offset, ncols)

    def hyper(self, group: dict) -> StepHyper:
        """The update's hyper-parameters for one param group."""
        return StepHyper(group["lr"], group["beta"], group["Lambda"], group["weight_decay"], self._decoupled)

    def _collect(self, group: dict) -> list[tuple[StepBackend, StepBatch]]:
        """The group's parameters that have a gradient, with their state and factor views.

        Normally one batch for the optimizer's backend; parameters the fused kernel
        cannot take (CPU, float64, non-contiguous) go to a ``foreach`` batch instead,
        with one warning naming the first of them and why.  Everything but the
        gradients is planned once and reused until something it depends on changes
        (which parameters have gradients, the factors, the backend, the state).
        """
        params = group["params"]
        key = (self._plan_epoch, self._factors_version, id(self._backend), tuple(p.grad is not None for p in params))
        cached = self._plans.get(id(group))
        if cached is None or cached[0] != key:
            cached = (key, self._plan(group))
            self._plans[id(group)] = cached
        return [
            (backend, StepBatch(ps, [p.grad for p in ps], ms, ks, vs, self._factors_version, (id(group), i) + key))
            for i, (backend, ps, ms, ks, vs) in enumerate(cached[1])
        ]

    def _plan(self, group: dict) -> list[tuple]:
        routes = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients ({self._name(p)} has one); "
                    "use nn.Embedding(..., sparse=False) or a sparse optimizer for that parameter"
                )
            backend = self._backend
            if backend.name == "fused":
                why = fused_unsupported_reason(p, p.grad)
                if why is not None:
                    self._warn_once("fused-fallback", f"{self._name(p)} is stepped by 'foreach': {why}")
                    backend = self._fallback
            state = self.state[p]
            backend.init_state(p, state)
            route = routes.setdefault(id(backend), (backend, [], [], [], []))
            route[1].append(p)
            route[2].append(state["exp_avg"])
            route[3].append(state["step"])
            route[4].append(self.fisher_view(p))
        return list(routes.values())

    def _replan(self) -> None:
        """Forget the step plans (state, groups, binding or backend changed)."""
        self._plan_epoch += 1
        self._plans = {}

    # ---------------------------------------------------------- observation
    def add_step_observer(self, observer: "StepObserver") -> None:
        """Call ``observer.before_update(opt)`` / ``after_update(opt)`` around every applied update.

        They run inside :meth:`step` after the closure (forward and backward) and after a
        capture step's factor update, just around the parameter update itself, and not at
        all on steps a loss scaler skips: this is how monitors time and check the update alone.
        """
        if observer not in self._observers:
            self._observers.append(observer)

    def remove_step_observer(self, observer: "StepObserver") -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus the factors (keyed by module name) and the schedule."""
        self._count_skips(self._skips.settle())  # the saved step count must be exact
        sd = super().state_dict()
        factors = {name: {"S": c.S.clone(), "H": c.H.clone()} for name, c in self._captures.items() if c.S is not None}
        for name, saved in self._saved_factors.items():
            factors.setdefault(name, {"S": saved["S"].clone(), "H": saved["H"].clone()})
        sd[_STATE_KEY] = {
            "format": _STATE_FORMAT,
            "global_step": self._global_step,
            "force_capture": self._force_capture,
            "factors": factors,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's state and the factors; the caller's dict is left untouched."""
        state_dict = dict(state_dict)
        extra = state_dict.pop(_STATE_KEY, None)
        super().load_state_dict(copy.deepcopy(state_dict))
        self._replan()
        if extra is None:
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: the state dict holds no AdaFisher factors (saved by "
                "another optimizer or another version?); momentum and step counts are loaded and the factors "
                "will be re-estimated at the next step",
                stacklevel=2,
            )
            self._force_capture = True
            return
        if extra.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown AdaFisher state format {extra.get('format')!r} (expected {_STATE_FORMAT})")
        self._count_skips(self._skips.settle())  # flags of steps before the load count there, not here
        self._global_step = int(extra["global_step"])
        self._force_capture = bool(extra["force_capture"])
        self._saved_factors = {n: {"S": f["S"].clone(), "H": f["H"].clone()} for n, f in extra["factors"].items()}
        self._factors_version += 1
        self._restore_saved_factors()

    def _restore_saved_factors(self) -> None:
        if not self._saved_factors or not self._captures:
            return
        unknown = sorted(set(self._saved_factors) - set(self._captures))
        if unknown:
            self._warn_once(
                "unknown-factors", f"saved factors for {unknown} match no bound layer of this model; ignored"
            )
        for name, cap in self._captures.items():
            saved = self._saved_factors.get(name)
            if saved is None:
                continue
            S, H = saved["S"].to(cap.device), saved["H"].to(cap.device)
            if cap.S is not None and cap.S.shape == S.shape and cap.H.shape == H.shape:
                cap.S.copy_(S)
                cap.H.copy_(H)
            else:
                cap.S, cap.H = S.clone(), H.clone()
        self._saved_factors = {}
        self._factors_version += 1


class AdaFisher(_AdaFisherBase):
    """AdaFisher (Gomes et al., ICLR 2025) with L2 weight decay folded into the gradient.

    ``m <- beta*m + (1-beta)*(g + wd*p)``;  ``p <- p - lr/(1-beta^k) * m / F`` with
    ``F = S[i]*H[j] + Lambda`` from the layer's Kronecker factors (``F = 1`` for
    parameters of unsupported layers).

    Args:
        params: an ``nn.Module`` (the optimizer binds itself to it, as the authors'
            code does), or parameters / param-group dicts (then call :meth:`bind`, or use
            ``CAFINCallback`` under Lightning).
        lr: learning rate: a float, or a one-element float32 tensor on the parameters'
            device, which the fused step reads on the device, so that a scheduler's
            in-place update reaches a captured CUDA graph.
        beta: momentum coefficient.
        gamma: factor averaging coefficient (``0.1*gamma*old + 0.01*gamma*new``).
        Lambda: damping added to the Fisher diagonal.
        TCov: factors are re-estimated every ``TCov`` optimizer steps.
        weight_decay: L2 penalty coefficient.
        backend: ``"auto"`` (fused CUDA where it can run, else foreach), ``"foreach"``,
            ``"reference"`` (the slow oracle) or ``"fused"``.
    """

    _decoupled = False


class AdaFisherW(_AdaFisherBase):
    """AdaFisherW: AdaFisher with decoupled weight decay.

    ``m <- beta*m + (1-beta)*g``;  ``p <- p - lr*(m/(1-beta^k)/F + wd*p)``.
    Arguments as :class:`AdaFisher`.
    """

    _decoupled = True


__all__ = ["AdaFisher", "AdaFisherW", "BACKEND_NAMES"]
