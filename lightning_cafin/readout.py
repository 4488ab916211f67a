"""What tools (monitors, the bench, scripts, tests) may read from an AdaFisher optimizer.

A read-only surface: nothing here waits for the GPU or changes the optimizer, except
that reading ``health`` settles the last capture step's device verdicts and
``capture_next_step`` is the one request a tool may make of the schedule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor

from .backends import FactorView
from .backends.sharding import local
from .binding import LayerFactors
from .health import summary_text

if TYPE_CHECKING:
    from .backends.dispatch import StepDispatcher
    from .binding import LayerBinding
    from .health import Health
    from .schedule import CaptureSchedule


class Readout:
    """Mixed into the optimizer, which provides the parts read here."""

    schedule: "CaptureSchedule"
    binding: "LayerBinding"
    _dispatch: "StepDispatcher"
    _health: "Health"
    param_groups: list[dict[str, Any]]
    state: Any

    @property
    def backend(self) -> str:
        """The name of the backend that runs the step (``auto`` already resolved)."""
        return self._dispatch.backend.name

    @property
    def capture_due(self) -> bool:
        """Whether the next ``step()`` captures, as far as the host knows now (never waits, changes nothing)."""
        return self.schedule.due

    def capture_next_step(self, on: bool = True) -> None:
        """Make the next step a capture step (``on=False`` takes that back)."""
        self.schedule.force_next(on)

    def factors(self) -> dict[str, LayerFactors]:
        """Each layer's live factor vectors by module name (read-only); layers without factors are absent."""
        return self.binding.factors()

    @property
    def factors_version(self) -> int:
        """Changes whenever any factor tensor is created or rewritten."""
        return self.binding.version

    def memory_usage(self) -> dict[str, int]:
        """Bytes held by this process: ``momentum`` (exp_avg; a sharded parameter's local shard),
        ``factors`` (every layer's, on every rank), ``cached_fisher`` (foreach's F), ``total``."""
        momentum = sum(local(s["exp_avg"]).numel() * s["exp_avg"].element_size() for s in self.state.values() if "exp_avg" in s)
        usage = {"momentum": momentum, "factors": self.binding.factor_bytes(), "cached_fisher": self._dispatch.cached_bytes()}
        return {**usage, "total": sum(usage.values())}

    @property
    def health(self) -> dict[str, Any]:
        """A copy of the counters: skipped steps, capture steps, modules whose hooks never fired,
        non-finite statistics, parameters on F = 1.  Reading them settles the last capture
        step's device verdicts (at most one wait for the GPU).  Under a loss scaler,
        ``skipped_steps`` counts the flags that have reached the host; a step or two still
        in flight on the GPU are counted when they arrive."""
        self.schedule.poll()
        return self._health.snapshot(self.schedule.skipped)

    def summary(self) -> str:
        """One paragraph: how many parameters are preconditioned and how many use F = 1."""
        text = summary_text(f"{type(self).__name__} [{self.backend}]", self.param_groups, len(self.binding.captures),
                            self.binding.preconditioned, self.param_name)
        unseen = self.binding.unseen
        if unseen:
            text += "; on F = 1 because hooks cannot see them: " + "; ".join(f"{n} ({why})" for n, why in unseen.items())
        return text

    @property
    def unseen_layers(self) -> dict[str, str]:
        """Supported layers left on F = 1 because their hooks cannot see them (their owner uses
        the weights functionally), with the reason: ``{module name: reason}`` (a copy)."""
        return self.binding.unseen

    def param_name(self, p: Tensor) -> str:
        """``p``'s name in the bound model, else its place in the param groups."""
        name = self.binding.param_name(p)
        if name is not None:
            return name
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{pi}]"
        return "<unknown parameter>"

    def fisher_view(self, p: Tensor) -> Optional[FactorView]:
        """How ``p`` reads its F now (``None``: F = 1)."""
        return self.binding.view(p)
