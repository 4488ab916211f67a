"""One optimizer's layers: which modules it captures, which parameter reads which factors.

Parameters are paired with the modules whose weight or bias they are *by identity*,
never by position, so embeddings, frozen or tied layers, free parameters and extra
param groups all get their own ``F``.  The binding owns the layer captures (hooks,
pending statistics, factors), saves the factors by module name when it is unbound
or checkpointed, and restores them on the next bind.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Optional

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .backends import FactorView
from .capture.factors import LaunchKeeper
from .capture.hooks import attach, can_disarm, detach, set_armed
from .capture.layer_capture import LayerCapture, factor_tensors_replaced
from .capture.layers import ParamSlot, check_layers, rule_for, unseen_parameters
from .capture.tap_gate import TapGate


@dataclass(frozen=True)
class LayerFactors:
    """One layer's two factor vectors.  ``S`` and ``H`` are the live tensors: read them,
    never write them (clone them to keep a copy)."""

    name: str
    layer_type: str  # the module's class name
    S: Tensor
    H: Tensor


#: Functions that may name a model for an unbound optimizer at its first step.
_MODEL_PROVIDERS: "OrderedDict[int, Callable[[Any], Optional[nn.Module]]]" = OrderedDict()


def register_model_provider(provider: Callable[[Any], Optional[nn.Module]]) -> RemovableHandle:
    """Let ``provider(optimizer)`` name a model for an AdaFisher still unbound at its first step.

    The optimizer binds itself to the first model a provider returns (the Lightning
    callback uses this for optimizers created where it cannot see them).  Remove the
    provider with the returned handle.
    """
    handle = RemovableHandle(_MODEL_PROVIDERS)
    _MODEL_PROVIDERS[handle.id] = provider
    return handle


def offered_model(optimizer: Any) -> Optional[nn.Module]:
    """The first model a registered provider names for ``optimizer``, if any."""
    for provider in list(_MODEL_PROVIDERS.values()):
        model = provider(optimizer)
        if model is not None:
            return model
    return None


FSDP1_REFUSED = (
    "AdaFisher does not support FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, Lightning's "
    "FSDPStrategy): it flattens a wrapped module's parameters into one buffer and shards that, so a "
    "parameter's shard can start and end inside a row, which its factors cannot follow. Use FSDP2 "
    "(torch.distributed.fsdp.fully_shard; in Lightning, ModelParallelStrategy with fully_shard applied "
    "in configure_model) or DDP"
)


def refuse_fsdp1(model: nn.Module) -> None:
    """Raise ``TypeError`` (:data:`FSDP1_REFUSED`) when ``model`` holds FSDP1-wrapped modules."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed support
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(FSDP1_REFUSED)


def _kept(S: Tensor, H: Tensor, layer_type: str) -> dict[str, Any]:
    return {"S": S, "H": H, "layer_type": layer_type}


class LayerBinding:
    """The captures of one optimizer on one model, and the factors kept between binds.

    ``is_capturing`` is what the hooks ask before computing statistics; ``warn_once``
    reports a problem once per optimizer.
    """

    def __init__(self, owner: str, is_capturing: Callable[[], bool], warn_once: Callable[..., None],
                 layers: str = "all") -> None:
        self.owner = owner
        #: which layer types get factors: ``"all"`` (every built-in and registered type) or ``"paper"``
        self.layers = check_layers(layers)
        #: bound modules left on F = 1 because hooks cannot see them: module name -> reason
        self._unseen: dict[str, str] = {}
        self._is_capturing = is_capturing
        self._warn_once = warn_once
        self._captures: dict[str, LayerCapture] = {}
        self._slots: dict[int, tuple[LayerCapture, ParamSlot]] = {}
        self._param_names: dict[int, str] = {}
        self._model: Optional[nn.Module] = None
        self._kept: dict[str, dict[str, Any]] = {}  # factors of layers not bound now, by module name
        #: changes whenever any factor tensor is created or rewritten
        self.version = 0
        self._slot_changes = 0  # pairings and layers moved to F = 1
        self._armed = True  # whether the hooks are in place (the next step may capture)
        #: the last capture step's factor update, kept to repeat (``factors.KeptLaunch``); dropped
        #: whenever the bound layers change
        self.launch_keeper = LaunchKeeper()
        #: open while the step-level conditions of a capture forward stand (``tap_gate.py``)
        self.tap_gate = TapGate()

    def arm(self, armed: bool) -> None:
        """Put the hooks in place for a step that may capture, or take them out (``hooks.py``;
        asked at every step, which also keeps the compile watcher registered).  Called at
        every change of the schedule, it also closes the capture forwards' gate."""
        self.tap_gate.close()
        armed = armed or not can_disarm()
        if armed != self._armed:
            self._armed = armed
            for cap in self._captures.values():
                set_armed(cap, armed)

    # ---------------------------------------------------------------- reading
    @property
    def model(self) -> Optional[nn.Module]:
        return self._model

    @property
    def captures(self) -> Mapping[str, LayerCapture]:
        """The bound layers by module name (a read-only view)."""
        return MappingProxyType(self._captures)

    @property
    def unseen(self) -> dict[str, str]:
        """Supported layers on F = 1 because their hooks cannot see them, with the reason (a copy)."""
        return dict(self._unseen)

    @property
    def views_stamp(self) -> tuple[int, int]:
        """Changes whenever a parameter's factor view may be another tensor (a factor replaced,
        a layer unbound); stays while the factors are only updated in place."""
        return (self._slot_changes, factor_tensors_replaced())

    def preconditioned(self, p: Tensor) -> bool:
        """Whether ``p`` belongs to a bound layer (it reads ``F`` once that layer has factors)."""
        return id(p) in self._slots

    def layer_of(self, p: Tensor) -> Optional[str]:
        entry = self._slots.get(id(p))
        return None if entry is None else entry[0].name

    def param_name(self, p: Tensor) -> Optional[str]:
        """``p``'s name in the bound model (None when unbound or not the model's)."""
        return self._param_names.get(id(p))

    def view(self, p: Tensor) -> Optional[FactorView]:
        """How ``p`` reads its F now (``None``: F = 1)."""
        entry = self._slots.get(id(p))
        if entry is None:
            return None
        cap, slot = entry
        if cap.S is None or cap.H is None:
            return None
        rows, cols, col_offset, ncols = slot.factor_layout(cap.S, cap.H)
        if rows.numel() * ncols != p.numel() or col_offset + ncols > cols.numel():
            self._warn_once(f"shape:{cap.name}", f"factors of {cap.name!r} do not fit {self.param_name(p)}; using F = 1")
            return None
        return FactorView(rows, cols, col_offset, ncols)

    def factors(self) -> dict[str, LayerFactors]:
        """Every layer's factors by module name: the bound layers' live tensors, then those
        kept for a later bind; layers without factors yet are absent."""
        out = {
            name: LayerFactors(name, type(cap.module).__name__, cap.S, cap.H)
            for name, cap in self._captures.items()
            if cap.S is not None and cap.H is not None
        }
        for name, kept in self._kept.items():
            out.setdefault(name, LayerFactors(name, kept["layer_type"], kept["S"], kept["H"]))
        return out

    def factor_bytes(self) -> int:
        return sum(f.S.numel() * f.S.element_size() + f.H.numel() * f.H.element_size() for f in self.factors().values())

    # ---------------------------------------------------------------- binding
    def bind(self, model: nn.Module, params: Iterable[Tensor], warn_on_takeover: bool = True) -> None:
        refuse_fsdp1(model)
        if self._model is not None and self._model is not model:
            self.unbind()
        self._model = model
        self.pair(params, warn_on_takeover)

    def unbind(self) -> None:
        """Remove every hook; the factors are kept by module name for a later bind."""
        for cap in self._captures.values():
            if cap.S is not None and cap.H is not None:
                self._kept[cap.name] = _kept(cap.S, cap.H, type(cap.module).__name__)
            detach(cap)
        self._captures, self._slots, self._model = {}, {}, None
        self.launch_keeper.launch = None

    def pair(self, params: Iterable[Tensor], warn_on_takeover: bool = True) -> None:
        """Pair ``params`` (the optimizer's) with the bound model's supported layers, by identity."""
        model = self._model
        if model is None:
            return
        in_optimizer = {id(p) for p in params}
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        slots: dict[int, tuple[LayerCapture, ParamSlot]] = {}
        captures: dict[str, LayerCapture] = {}
        unseen, self._unseen = {**unseen_parameters(model), **self._unseen}, {}
        for name, module in model.named_modules():
            rule = rule_for(module, self.layers)
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
                cap = LayerCapture(name, module, rule, self._is_capturing, gate=self.tap_gate)
            captures[name] = cap
            for p, slot in mine:
                slots[id(p)] = (cap, slot)
        for name, cap in self._captures.items():
            if captures.get(name) is not cap:
                detach(cap)
        for cap in captures.values():
            if attach(cap, self._armed) is not None and warn_on_takeover:
                self._warn_once(
                    "rebind",
                    f"{cap.name!r} was bound to another live AdaFisher optimizer; its hooks now feed this one "
                    "(the other no longer updates those factors)",
                    stacklevel=5,
                )
        self._captures, self._slots = captures, slots
        self._slot_changes += 1
        self.launch_keeper.launch = None
        self._restore_kept()

    def unbind_unseen(self, names: Iterable[str]) -> None:
        """Move layers whose parameters get gradients although their hooks never fire to
        F = 1, with the reason (reported once by ``summary()``, not warned at every capture)."""
        for name in names:
            cap = self._captures.pop(name)
            detach(cap)
            self._unseen[name] = ("its parameters get gradients but its forward hooks never fired: used "
                                  "functionally, e.g. F.linear(x, module.weight)")
            for key in [k for k, (c, _) in self._slots.items() if c is cap]:
                del self._slots[key]
        self._slot_changes += 1
        self.version += 1
        self.launch_keeper.launch = None

    def discard_pending(self) -> None:
        """Drop the statistics gathered since the last step (a skipped or non-capture step)."""
        for cap in self._captures.values():
            if cap.pending.calls:
                cap.take_pending()

    # ---------------------------------------------------------- save, restore
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Copies of every factor by module name (bound layers and kept ones)."""
        return {
            name: {"S": f.S.clone(), "H": f.H.clone(), "layer_type": f.layer_type} for name, f in self.factors().items()
        }

    def load_state_dict(self, factors: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace every factor by ``factors`` (module name -> ``{"S", "H"}``), copied;
        bound layers take theirs now, the others keep them for a later bind."""
        self._kept = {n: _kept(f["S"].clone(), f["H"].clone(), str(f.get("layer_type", ""))) for n, f in factors.items()}
        self.version += 1
        self._restore_kept()

    def _restore_kept(self) -> None:
        if not self._kept or not self._captures:
            return
        unknown = sorted(set(self._kept) - set(self._captures))
        if unknown:
            self._warn_once("unknown-factors", f"saved factors for {unknown} match no bound layer of this model; ignored")
        for name, cap in self._captures.items():
            kept = self._kept.get(name)
            if kept is None:
                continue
            device = cap.device
            S, H = kept["S"].to(device), kept["H"].to(device)
            if cap.S is not None and cap.H is not None and cap.S.shape == S.shape and cap.H.shape == H.shape:
                cap.S.copy_(S)
                cap.H.copy_(H)
            else:
                cap.S, cap.H = S.clone(), H.clone()
        self._kept = {}
        self.version += 1


def warn_if_nothing_bound(binding: LayerBinding, model: nn.Module) -> None:
    if not binding.captures:
        warnings.warn(
            f"{binding.owner}: {type(model).__name__} has no supported layer (layers={binding.layers!r}: see "
            "lightning_cafin.capture.layers) among the optimizer's parameters; every parameter uses F = 1",
            stacklevel=3,
        )


__all__ = ["FSDP1_REFUSED", "LayerBinding", "LayerFactors", "offered_model", "register_model_provider", "warn_if_nothing_bound"]
