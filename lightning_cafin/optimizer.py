"""``AdaFisher`` and ``AdaFisherW``: ``torch.optim.Optimizer`` subclasses.

A step, as this module tells it: read the loss scaler's ``found_inf`` on the host only
where the host must know it; on a capture step (every ``TCov`` steps, ``schedule.py``)
turn the statistics the hooks gathered into new layer factors (``capture/``); then let
the dispatcher (``backends/dispatch.py``) step every parameter with the chosen backend
(``reference``, ``foreach``, ``fused``) or, for the tensors it cannot take, the fallback.
The layers, their hooks and factors belong to the binding (``binding.py``), and
``bind()`` / ``unbind()`` and the observer registration to ``attachment.py``; the
counters and warnings to ``health.py``; what tools read to ``readout.py``; the
observers a monitor registers to ``observers.py``.  The optimizer never imports Lightning.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from . import state_format
from ._validation import check_hyperparameters, checked_param_group, reject_unknown_kwargs
from .attachment import Attachment
from .backends import BACKEND_NAMES, StepBackend, StepHyper, make_backend
from .backends.dispatch import GroupPlan, StepDispatcher
from .backends.foreach import ForeachBackend
from .backends.state import ensure_state
from .binding import LayerBinding, LayerFactors, offered_model, register_model_provider
from .capture import streams as capture_streams
from .capture import taps as capture_taps
from .capture.distributed import StatisticsReduction
from .capture.factors import update_factors
from .capture.layers import check_layers
from .capture.stream_choice import StreamChooser
from .capture_options import CaptureOptions, StreamOption
from .health import Health
from .observers import Observers, StepObserver
from .profiling import profiled
from .readout import Readout
from .schedule import CaptureSchedule

log = logging.getLogger("lightning_cafin")

_KNOWN_ARGS = ["params", "lr", "beta", "gamma", "Lambda", "TCov", "weight_decay", "backend", "capture", "capture_stream", "layers"]

Params = Union[nn.Module, Iterable[Tensor], Iterable[dict]]


class _AdaFisherBase(Attachment, Readout, Optimizer):
    """Shared machinery of AdaFisher and AdaFisherW (they differ only in weight decay)."""

    _decoupled = False
    # A loss scaler hands us grad_scale / found_inf instead of unscaling the gradients,
    # so a skipped step can leave the factors and counters untouched.
    _step_supports_amp_scaling = True

    def __init__(self, params: Params, lr: Union[float, Tensor] = 1e-3, beta: float = 0.9, gamma: float = 0.8,
                 Lambda: float = 1e-3, TCov: int = 100, weight_decay: float = 0.0, *, backend: Union[str, StepBackend] = "auto",
                 capture: Optional[str] = None, capture_stream: StreamOption = None, layers: str = "all",
                 **kwargs: Any) -> None:
        reject_unknown_kwargs(type(self).__name__, kwargs, _KNOWN_ARGS)
        check_hyperparameters(lr, beta, gamma, Lambda, TCov, weight_decay)
        self.capture_options = CaptureOptions.checked(capture, capture_stream)
        self._layers = check_layers(layers)
        model = params if isinstance(params, nn.Module) else None
        if model is not None:
            params = list(model.parameters())
        self._init_parts(TCov)
        defaults = dict(lr=lr, beta=beta, gamma=gamma, Lambda=Lambda, TCov=TCov, weight_decay=weight_decay)
        super().__init__(params, defaults)  # type: ignore[arg-type]
        self.set_backend(backend)
        if model is not None:
            self.bind(model)

    def _init_parts(self, every: int) -> None:
        capture_taps.note_compiled_autograd_config()  # (and at every step: C++ taps cannot run under it)
        owner = type(self).__name__
        #: the profiler ranges of a capture step's factor update and of every step's parameter update
        self._range_names = (f"{owner}.update_factors", f"{owner}.update_parameters")
        self._health = Health(owner)
        self.schedule = CaptureSchedule(every)
        self.binding = LayerBinding(owner, self._capturing_now, self._health.warn_once, getattr(self, "_layers", "all"))
        # the hooks are in place only for steps that may capture (hooks.py, "disarmed")
        self.schedule.on_change = self.binding.arm
        self._dispatch = StepDispatcher(ForeachBackend(), ForeachBackend())
        self._observers = Observers()
        self._summary: Optional[str] = None  # written at the first step after (re)pairing
        if not hasattr(self, "capture_options"):
            self.capture_options = CaptureOptions()
        #: capture_stream="auto"'s choice, from this optimizer's timed capture steps
        self.stream_chooser = StreamChooser()
        #: process group whose ranks' statistics are summed on capture steps (None: the default group)
        self.statistics_group: Any = None
        #: the capture step's one all-reduce of every layer's statistics (``last``: what it sent)
        self.statistics_reduction = StatisticsReduction()

    @override
    def __setstate__(self, state: dict) -> None:
        # torch calls this from load_state_dict (keep our parts) and on unpickling (only torch's fields exist)
        super().__setstate__(state)
        if not hasattr(self, "binding"):
            self._init_parts(self.defaults["TCov"])

    @override
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(checked_param_group(type(self).__name__, param_group, self.defaults))
        if hasattr(self, "binding"):  # torch's __init__ adds the first groups before the binding exists
            self.binding.pair(self._all_params())
            self._paired()

    # ------------------------------------------------------------------ the step
    @override
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
        with torch.no_grad():
            self._step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        return loss

    def _step(self, grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        # found_inf is read on the host only where the host must know it: on capture steps
        # (the factors must not learn from a skipped step) and for a parameter whose backend
        # cannot honour it on the device.  Otherwise the kernel honours it and the host
        # learns it later (schedule.record_deferred).
        capture_taps.note_compiled_autograd_config()  # for the next forward's capture hooks
        defer = found_inf is not None and found_inf.is_cuda
        if found_inf is not None and not defer and self._skipped(found_inf):
            return
        bound_now = self._first_step_notices()
        capture = self._capturing_now() and not bound_now
        if found_inf is not None and defer and capture:
            if self._skipped(found_inf):
                return
            defer = False
        if capture:
            with profiled(self._range_names[0]):
                self._update_factors(grad_scale)
        else:
            self.binding.discard_pending()
        plans = [(group, self._plan(i, group)) for i, group in enumerate(self.param_groups)]
        if found_inf is not None and defer and not all(plan.skips_on_device for _, plan in plans):
            if self._skipped(found_inf):
                return
            defer = False
        with self._observers.around_update(self, found_inf), profiled(self._range_names[1]):
            for group, plan in plans:
                self._dispatch.run(plan, self.hyper(group), self.binding.version, grad_scale, found_inf if defer else None)
            if found_inf is not None and defer:
                self.schedule.record_deferred(found_inf)
            self.schedule.advance(capture_next=bound_now)  # its hooks missed this step's forward: capture next
        if self.capture_options.chooses_stream:
            if capture:
                self.stream_chooser.capture_step_done()
            else:  # (a step that was due but did not capture, its optimizer bound only now, is not timed)
                self.stream_chooser.abandon()
                self.stream_chooser.poll()

    def _skipped(self, found_inf: Tensor) -> bool:
        """Read ``found_inf`` (waits for the GPU); when set, drop this step's statistics."""
        if found_inf.item() == 0:
            return False
        self.stream_chooser.abandon()
        self.binding.discard_pending()
        self.schedule.skipped_now()
        return True

    def _capturing_now(self) -> bool:
        """Whether this step captures, with the skip flags that decide it settled (the hooks ask this)."""
        if self.schedule.settled_due():
            self.capture_options.apply(self._chosen_side())
            return True
        return False

    def _chosen_side(self) -> bool:
        """capture_stream="auto"'s stream for the capture step under way (False otherwise)."""
        if not self.capture_options.chooses_stream:
            return False
        first = next((p for group in self.param_groups for p in group["params"]), None)  # (asked per hook: O(1))
        return self.stream_chooser.side(first is not None and first.is_cuda)

    def _update_factors(self, grad_scale: Optional[Tensor]) -> None:
        scale = None if grad_scale is None else float(grad_scale.item())
        captures = list(self.binding.captures.values())
        with self._observers.around_capture(self):
            # (the stream the hooks were given: a trial is started only by a hooked forward)
            self.capture_options.apply(self.stream_chooser.current() if self.capture_options.chooses_stream else False)
            capture_streams.join()  # the statistics were computed beside the backward pass
            self.statistics_reduction.all_reduce(captures, self.statistics_group)
            report = update_factors(captures, self.defaults["gamma"], scale, self.binding.launch_keeper)
            capture_streams.release()
        fired = len(report.not_fired) < len(captures)  # some layer had statistics
        self.binding.version += 1
        by_name = self.binding.captures
        # a layer whose forwards were all inside no_capture() was not missed: no warning, not functional
        excluded = {cap.name for cap in captures if cap.excluded_forwards}
        for name in excluded:
            by_name[name].excluded_forwards = 0
        trainable = [n for n in report.not_fired if n not in excluded
                     and any(p.requires_grad for p in by_name[n].module.parameters(recurse=False))]
        # Gradients without a hook call mean the weights are used functionally, except at a first
        # step where no hook fired anywhere: torch.distributed.checkpoint initialises a fresh
        # optimizer's state with such a step (zero gradients, no forward), which says nothing.
        silent = not fired and self.schedule.steps_taken == 0
        functional = [n for n in trainable if not silent and by_name[n].S is None
                      and any(p.grad is not None for p in by_name[n].module.parameters(recurse=False))]
        if functional:  # gradients but no hook call: the owner uses the weights functionally
            self.binding.unbind_unseen(functional)
            trainable = [n for n in trainable if n not in functional]
            self._summary = self.summary()
            self._health.params_f_one = sum(1 for p in self._all_params() if not self.binding.preconditioned(p))
            log.info(self._summary)
        if silent:
            trainable = []
        self._health.record_capture(report, trainable, {n: by_name[n].S is not None for n in trainable})

    def _plan(self, index: int, group: dict) -> GroupPlan:
        plan = self._dispatch.plan(index, group["params"], self.binding.version, self._init_state, self.fisher_view,
                                   self.binding.views_stamp)
        for fallback in plan.fallbacks[:1]:
            self._health.warn_once("fused-fallback", f"{self.param_name(fallback.param)} is stepped by "
                                   f"{self._dispatch.fallback.name!r}: {fallback.reason}", stacklevel=5)
        return plan

    def _init_state(self, p: Tensor, backend: StepBackend) -> tuple[Tensor, Tensor]:
        """Create ``p``'s state on first use (torch's ``_init_group``) where ``backend`` needs it."""
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients ({self.param_name(p)} has "
                               "one); use nn.Embedding(..., sparse=False) or a sparse optimizer for that parameter")
        state = self.state[p]
        ensure_state(p, state, device_step=backend.device_step, momentum_dtype=getattr(backend, "momentum_dtype", None))
        return state["exp_avg"], state["step"]

    def _first_step_notices(self) -> bool:
        """The one-time summary and warnings; True when the optimizer bound itself just now."""
        if self._summary is not None:
            return False
        late = False
        if self.binding.model is None:
            model = offered_model(self)
            if model is not None:
                self.bind(model, warn_on_takeover=False)
                late = True
        self._summary = self.summary()
        self._health.params_f_one = sum(1 for g in self.param_groups for p in g["params"] if not self.binding.preconditioned(p))
        log.info(self._summary)
        if self.binding.model is None and self._health.first_time("unbound"):
            warnings.warn(
                f"{type(self).__name__} is not bound to a model, so every parameter uses F = 1 (momentum SGD). "
                "Pass the model as the first argument, call optimizer.bind(model), or add "
                "lightning_cafin.CAFINCallback() to the Trainer's callbacks",
                stacklevel=5,  # past step() and torch's step wrapper, to the caller
            )
        return late

    # ------------------------------------------------------------------ backend
    def set_backend(self, backend: Union[str, StepBackend]) -> None:
        """Switch the step implementation (a name, or a ``StepBackend``); state and factors carry over."""
        if not isinstance(backend, (str, StepBackend)):
            raise TypeError(f"backend must be one of {BACKEND_NAMES} or a StepBackend, got {type(backend).__name__}")
        self._dispatch.set_backend(make_backend(backend) if isinstance(backend, str) else backend)

    def hyper(self, group: dict) -> StepHyper:
        """The update's hyper-parameters for one param group."""
        return StepHyper(group["lr"], group["beta"], group["Lambda"], group["weight_decay"], self._decoupled)

    # ------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus the schedule and the factors (keyed by module name), in
        the first param group, where ``torch.distributed.checkpoint`` keeps them (``state_format.py``)."""
        schedule = self.schedule.state_dict()  # waits for the skip flags: the saved count is exact
        return state_format.with_record(super().state_dict(), schedule, self.binding.state_dict())

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's state and the factors; the caller's dict is left untouched."""
        torch_part, record = state_format.split_record(state_dict)
        super().load_state_dict(copy.deepcopy(torch_part))
        self._dispatch.invalidate()
        if record is None:
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: the state dict holds no AdaFisher factors (saved by "
                "another optimizer or another version?); momentum and step counts are loaded and the factors "
                "will be re-estimated at the next step",
                stacklevel=2,
            )
            self.schedule.force_next()
            return
        self.schedule.load_state_dict(record)
        self.binding.load_state_dict(state_format.factors_of(record))


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
            ``"reference"`` (the slow oracle) or ``"fused"``; or a ``StepBackend`` instance.
        capture: how the statistics are computed: ``"auto"``, ``"kernels"`` or ``"torch"``
            (``None``: the process default, ``$LIGHTNING_CAFIN_CAPTURE`` or ``auto``).
        capture_stream: statistics on a side CUDA stream (``True``), the current one
            (``False``), or whichever made this model's capture steps faster (``"auto"``: a few
            capture steps timed each way on the device, without a host sync); ``None`` (the
            default): the process setting (``capture.streams.set_enabled``, else
            ``$LIGHTNING_CAFIN_CAPTURE_STREAM`` as ``1``, ``0`` or ``auto``, else ``"auto"``).
        layers: which layer types get factors: ``"all"`` (every built-in type and those added
            with ``lightning_cafin.register_layer``) or ``"paper"`` (exactly the authors' four:
            Linear, Conv2d, BatchNorm2d, LayerNorm, bit-equal to their code).
    """

    _decoupled = False


class AdaFisherW(_AdaFisherBase):
    """AdaFisherW: AdaFisher with decoupled weight decay.

    ``m <- beta*m + (1-beta)*g``;  ``p <- p - lr*(m/(1-beta^k)/F + wd*p)``.
    Arguments as :class:`AdaFisher`.
    """

    _decoupled = True


__all__ = ["AdaFisher", "AdaFisherW", "BACKEND_NAMES", "LayerFactors", "StepObserver", "register_model_provider"]
