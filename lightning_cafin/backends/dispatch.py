"""Which backend steps which parameter, planned once and reused until something changes.

The optimizer names one backend; the dispatcher decides per tensor whether that backend
takes it or the fallback (``foreach``) does, and why, groups the tensors by backend,
device and dtype once, creates their state through the optimizer, and keeps the plan,
with what each backend derived from its batch (``StepBackend.prepare``), until the
parameters with gradients, the factors, the state or the backend change.  Per step only
the gradient lists are rebuilt.  This is the one plan cache of the step path.

A sharded parameter (an FSDP2 ``DTensor``) is planned as its local shard: its state's
local tensor, its gradient's local tensor each step, and the rows of its factor view
that the shard holds (``sharding.py``), so every backend steps it unchanged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .base import FactorView, StepBackend, StepBatch, StepHyper
from .sharding import local, local_view

StateFor = Callable[[Tensor, StepBackend], tuple[Tensor, Tensor]]
ViewFor = Callable[[Tensor], Optional[FactorView]]


@dataclass(frozen=True)
class Fallback:
    """A parameter the chosen backend does not take, and why."""

    param: Tensor
    reason: str


@dataclass
class PlannedBatch:
    """Tensors of one param group stepped by one backend, on one device, in one dtype.

    ``params`` are the tensors stepped (a sharded parameter's local shard); ``owners`` the
    optimizer's parameters, whose gradients the step reads."""

    backend: StepBackend
    device: torch.device
    dtype: torch.dtype
    owners: list[Tensor] = field(default_factory=list)
    params: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    steps: list[Tensor] = field(default_factory=list)
    views: list[Optional[FactorView]] = field(default_factory=list)
    prepared: Any = None
    #: some parameter is a shard (its gradient's local tensor is read each step)
    sharded: bool = False

    def batch(self, factors_version: int) -> StepBatch:
        """The batch with this step's gradients."""
        # every planned parameter has a gradient (the plan's key says so)
        grads: list[Tensor] = ([local(p.grad) for p in self.owners] if self.sharded  # type: ignore[arg-type]
                               else [p.grad for p in self.owners])  # type: ignore[misc]
        return StepBatch(self.params, grads, self.exp_avgs, self.steps, self.views, factors_version)


@dataclass
class GroupPlan:
    key: tuple
    batches: list[PlannedBatch]
    fallbacks: list[Fallback]

    @property
    def skips_on_device(self) -> bool:
        """Whether every batch honours ``found_inf`` on the device (the host need not read it)."""
        return all(b.backend.skips_on_device for b in self.batches)


@lru_cache(maxsize=None)
def takes_prepared(backend_type: type) -> bool:
    """Whether a backend class's ``step`` accepts ``prepared`` (a subclass written against
    the four-argument ``step`` is stepped without it, deriving what it needs each call)."""
    try:
        step: Callable[..., None] = backend_type.step  # type: ignore[attr-defined]
        return "prepared" in inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False


class DeviceScalars:
    """Float32 copies of the step's scalar tensors on each device that needs them.

    The buffers are made once per (role, device) and refilled without blocking each
    step, so a step on several devices allocates nothing after the first."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], Tensor] = {}

    def on(self, role: str, t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
        if t is None or (t.device == device and t.dtype == torch.float32):
            return t
        buf = self._buffers.get((role, device))
        if buf is None or buf.shape != t.shape:
            buf = self._buffers[(role, device)] = torch.empty(t.shape, dtype=torch.float32, device=device)
        buf.copy_(t, non_blocking=True)
        return buf


class StepDispatcher:
    """The step path of one optimizer: the chosen backend, its fallback and the plans."""

    def __init__(self, backend: StepBackend, fallback: StepBackend) -> None:
        self.backend = backend
        self.fallback = fallback
        self.scalars = DeviceScalars()
        self._plans: dict[int, GroupPlan] = {}
        self._epoch = 0

    def set_backend(self, backend: StepBackend) -> None:
        self.backend = backend
        self.invalidate()

    def invalidate(self) -> None:
        """Forget the plans (the state, the groups, the binding or the backend changed)."""
        self._epoch += 1
        self._plans = {}

    def route(self, p: Tensor, grad: Optional[Tensor] = None) -> tuple[StepBackend, Optional[str]]:
        """The backend that steps ``p`` (with ``grad``: ``p.grad`` when not given), and why
        it is not the chosen one (None when it is)."""
        why = self.backend.unsupported_reason(p, p.grad if grad is None else grad)
        return (self.backend, None) if why is None else (self.fallback, why)

    def plan(self, group_id: int, params: list[Tensor], factors_version: int, state_for: StateFor,
             view_for: ViewFor, views_stamp: Any = None) -> GroupPlan:
        """The group's plan for this step (cached while its key holds).

        ``views_stamp`` changes whenever a factor view may point at another tensor (the
        binding's ``views_stamp``); while it stays, a new ``factors_version`` (factors
        updated in place) keeps the plan, and the backends see the version in each
        step's batch.  ``None``: the plan is rebuilt whenever ``factors_version`` changes.
        """
        stamp = factors_version if views_stamp is None else views_stamp
        key = (self._epoch, stamp, tuple(p.grad is not None for p in params))
        cached = self._plans.get(group_id)
        if cached is not None and cached.key == key:
            return cached
        plan = self._build(key, params, factors_version, state_for, view_for, cached)
        self._plans[group_id] = plan
        return plan

    def _build(self, key: tuple, params: list[Tensor], factors_version: int, state_for: StateFor, view_for: ViewFor,
               previous: Optional[GroupPlan]) -> GroupPlan:
        batches: dict[tuple, PlannedBatch] = {}
        fallbacks: list[Fallback] = []
        for p in params:
            if p.grad is None:
                continue
            mine = local(p)
            backend, why = self.route(mine, local(p.grad))
            if why is not None:
                fallbacks.append(Fallback(p, why))
            exp_avg, step = state_for(p, backend)
            view = local_view(p, view_for(p))
            bkey = (id(backend), mine.device, mine.dtype)
            batch = batches.get(bkey)
            if batch is None:
                batch = batches[bkey] = PlannedBatch(backend, mine.device, mine.dtype)
            batch.owners.append(p)
            batch.sharded |= mine is not p
            batch.params.append(mine)
            batch.exp_avgs.append(local(exp_avg))
            batch.steps.append(step)
            batch.views.append(view)
        before = {} if previous is None else {(id(b.backend), b.device, b.dtype): b.prepared for b in previous.batches}
        for bkey, batch in batches.items():
            if takes_prepared(type(batch.backend)):
                batch.prepared = batch.backend.prepare(batch.batch(factors_version), before.get(bkey))
        return GroupPlan(key, list(batches.values()), fallbacks)

    def run(self, plan: GroupPlan, hyper: StepHyper, factors_version: int, grad_scale: Optional[Tensor],
            found_inf: Optional[Tensor]) -> None:
        """Step every batch of the plan; ``found_inf`` only reaches backends that honour it on the device."""
        for b in plan.batches:
            local, gs, fi = hyper, grad_scale, None
            if b.backend.skips_on_device:
                lr = self.scalars.on("lr", hyper.lr, b.device) if isinstance(hyper.lr, Tensor) else None
                if lr is not None:
                    local = replace(hyper, lr=lr)
                gs = self.scalars.on("grad_scale", grad_scale, b.device)
                fi = self.scalars.on("found_inf", found_inf, b.device)
            if b.prepared is None:
                b.backend.step(b.batch(factors_version), local, gs, fi)
            else:
                b.backend.step(b.batch(factors_version), local, gs, fi, prepared=b.prepared)

    def cached_bytes(self) -> int:
        """Bytes held by what the backends derived (foreach's materialised F)."""
        total = 0
        for plan in self._plans.values():
            for b in plan.batches:
                nbytes = getattr(b.prepared, "nbytes", None)
                total += int(nbytes()) if callable(nbytes) else 0
        return total
