"""Watching the update from outside (monitors), without changing what it does.

An observer's ``before_update(opt, found_inf)`` and ``after_update(opt, found_inf)``
run around the parameter update inside ``step()``; ``found_inf`` is the loss scaler's
device tensor (or ``None``) and having observers never makes the optimizer read it on
the host.  ``after_update`` runs even when the update raises, so the two always pair.
An observer may also define ``before_capture(opt)`` / ``after_capture(opt)``, called
around a capture step's factor work.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Iterator, Optional, Protocol

from torch import Tensor
from torch.utils.hooks import RemovableHandle


class StepObserver(Protocol):
    """Something that watches the update (a monitor); see ``register_step_observer``."""

    def before_update(self, optimizer: Any, found_inf: Optional[Tensor]) -> None: ...

    def after_update(self, optimizer: Any, found_inf: Optional[Tensor]) -> None: ...


class Observers:
    """The observers of one optimizer, in registration order."""

    def __init__(self) -> None:
        self._by_id: "OrderedDict[int, StepObserver]" = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __contains__(self, observer: object) -> bool:
        return any(o is observer for o in self._by_id.values())

    def register(self, observer: StepObserver) -> RemovableHandle:
        for key, o in self._by_id.items():
            if o is observer:  # registering twice keeps one entry; both handles remove it
                handle = RemovableHandle(self._by_id)
                handle.id = key
                return handle
        for method in ("before_update", "after_update"):
            if not callable(getattr(observer, method, None)):
                raise TypeError(f"a step observer needs a {method}(optimizer, found_inf) method; "
                                f"{type(observer).__name__} has none")
        handle = RemovableHandle(self._by_id)
        self._by_id[handle.id] = observer
        return handle

    def remove(self, observer: object) -> None:
        for key, o in list(self._by_id.items()):
            if o is observer:
                del self._by_id[key]

    @contextlib.contextmanager
    def around_update(self, optimizer: Any, found_inf: Optional[Tensor]) -> Iterator[None]:
        """``before_update`` of each observer, the block, then ``after_update`` of each one whose
        ``before_update`` ran (in the same order), also when the block raises."""
        entered: list[StepObserver] = []
        try:
            for observer in list(self._by_id.values()):
                observer.before_update(optimizer, found_inf)
                entered.append(observer)
            yield
        finally:
            for observer in entered:
                observer.after_update(optimizer, found_inf)

    @contextlib.contextmanager
    def around_capture(self, optimizer: Any) -> Iterator[None]:
        """The optional ``before_capture`` / ``after_capture`` around a capture step's factor work."""
        entered: list[Any] = []
        try:
            for observer in list(self._by_id.values()):
                before = getattr(observer, "before_capture", None)
                if before is not None:
                    before(optimizer)
                entered.append(observer)
            yield
        finally:
            for observer in entered:
                after = getattr(observer, "after_capture", None)
                if after is not None:
                    after(optimizer)
