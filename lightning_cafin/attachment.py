"""How an AdaFisher optimizer attaches to a model, and who may watch its updates.

Mixed into the optimizer beside ``Readout``: binding installs the capture hooks through
the optimizer's ``LayerBinding`` (``binding.py``) and pairs the layers' factors with the
param groups; every change of that pairing makes the step plan again and summarise again.
Step observers (``observers.py``) register here.  None of this is the update itself,
which ``optimizer.py`` tells.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypeVar

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .binding import warn_if_nothing_bound
from .observers import StepObserver

if TYPE_CHECKING:
    from .backends.dispatch import StepDispatcher
    from .binding import LayerBinding
    from .observers import Observers

_Self = TypeVar("_Self", bound="Attachment")


class Attachment:
    """Mixed into the optimizer, which provides the parts used here."""

    binding: "LayerBinding"
    _dispatch: "StepDispatcher"
    _observers: "Observers"
    _summary: Optional[str]
    param_groups: list[dict[str, Any]]

    # ------------------------------------------------------------------ binding
    def bind(self: _Self, model: nn.Module, *, warn_on_takeover: bool = True) -> _Self:
        """Install the factor-capture hooks on ``model``'s supported layers.

        Idempotent: binding again (or binding another AdaFisher to the same model) never
        stacks hooks; each module keeps one hook, owned by the latest binder (with a
        warning when the previous owner is still alive, unless ``warn_on_takeover=False``).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"bind(model) needs a torch.nn.Module, got {type(model).__name__}")
        self.binding.bind(model, self._all_params(), warn_on_takeover)
        self._paired()
        warn_if_nothing_bound(self.binding, model)
        return self

    def unbind(self) -> None:
        """Remove every hook this optimizer installed; its factors are kept for a later bind."""
        self.binding.unbind()
        self._dispatch.invalidate()

    @property
    def is_bound(self) -> bool:
        """Whether a model's layers feed the factors."""
        return self.binding.model is not None

    @property
    def bound_model(self) -> Optional[nn.Module]:
        """The model whose layers feed the factors (None when unbound)."""
        return self.binding.model

    def _paired(self) -> None:
        """The pairing changed: plan again, and summarise again at the next step."""
        self._dispatch.invalidate()
        self._summary = None

    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # ---------------------------------------------------------------- observers
    def register_step_observer(self, observer: StepObserver) -> RemovableHandle:
        """Call ``observer.before_update(opt, found_inf)`` / ``after_update(opt, found_inf)`` around
        every applied update (see ``observers.py``); remove it with the returned handle."""
        return self._observers.register(observer)

    add_step_observer = register_step_observer

    def remove_step_observer(self, observer: StepObserver) -> None:
        """Stop calling ``observer`` (registered with :meth:`register_step_observer`)."""
        self._observers.remove(observer)
