"""Forwards the factors must not learn from: :func:`no_capture`.

On a capture step every forward of a bound layer with grad enabled adds its statistics,
and the gradient they pair with is the first one that reaches the layer's output.  That
is wrong for a forward whose gradient is not the loss's: a gradient penalty
(``torch.autograd.grad(critic(x_hat), x_hat, create_graph=True)``, WGAN-GP, R1), whose
first backward runs with ``grad_outputs`` of ones before the loss's; a teacher, EMA or
auxiliary forward run with grad through the same modules.  Inside ``with no_capture():``
forwards add nothing (on this thread); the layer's other forwards of the step still
count, and a step whose forwards were all inside keeps the factors it had.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from .tap_gate import settings_changed

_local = threading.local()
_lock = threading.Lock()


class _Open:
    """``no_capture()`` blocks open on any thread: while none is, every captured layer's
    forward hook knows without reading the thread-local depth."""

    blocks = 0


def any_open() -> bool:
    """Whether a ``no_capture()`` block is open on any thread."""
    return _Open.blocks > 0


def excluded() -> bool:
    """Whether forwards on this thread are inside :func:`no_capture` now."""
    return _Open.blocks > 0 and getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def no_capture() -> Iterator[None]:
    """Forwards in this block (on this thread) add no factor statistics; blocks nest."""
    with _lock:
        _Open.blocks += 1
        settings_changed()  # (the forwards' C++ repeat stops until the general path reopens it)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _lock:
            _Open.blocks -= 1
            settings_changed()
