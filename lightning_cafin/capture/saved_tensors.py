"""Whether autograd keeps a layer's input in memory until its backward: saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``) change that.

The capture hooks hold a layer's input to the backward, to read its statistics there,
because autograd holds it anyway for the weight's gradient.  Under a saved-tensor hook it
does not: non-reentrant activation checkpointing (``torch.utils.checkpoint(...,
use_reentrant=False)``, Lightning's and FSDP's checkpoint wrappers, Hugging Face's
``gradient_checkpointing_enable`` with ``use_reentrant=False``) drops it and recomputes it
in the backward, and ``save_on_cpu`` moves it off the device.  Holding it there would keep
every checkpointed layer's input alive through a capture step: the memory the user
checkpointed to save, on every ``TCov``-th step.  So under such a hook the input's
statistics are read in the forward (as for a frozen weight).

The recomputation that non-reentrant checkpointing runs in the backward calls the
layers' forward hooks again, on outputs whose gradients never arrive (the backward uses
the first forward's graph): a capture hook does nothing there.

Which hook is active is read with ``torch._C._autograd._top_saved_tensors_default_hooks``
(no public API says it); where that is missing, :func:`state` answers ``NONE`` and the
inputs are held as before.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

NONE, RECOMPUTING, ELSEWHERE = "none", "recomputing", "elsewhere"


def _reader() -> Optional[Callable[[bool], Any]]:
    # (pack_hook, unpack_hook) of the innermost active saved_tensors_hooks, or None
    return getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


_TOP = _reader()


def top_reader() -> Optional[Callable[[bool], Any]]:
    """torch's reader of the innermost active saved-tensor hooks (None where torch has none):
    the C++ forward hook asks it per call, as :func:`state` does."""
    return _TOP


def state() -> str:
    """``NONE``: no saved-tensor hook is active (autograd keeps what it saves);
    ``RECOMPUTING``: non-reentrant checkpointing is recomputing a forward in the backward;
    ``ELSEWHERE``: another hook (checkpointing's first forward, CPU offload, a user's)
    decides where saved tensors go."""
    if _TOP is None:
        return NONE
    top = _TOP(False)
    if top is None:
        return NONE
    pack = top[0]
    name = getattr(pack, "__qualname__", "")
    return RECOMPUTING if name.startswith("_recomputation_hook.") else ELSEWHERE
