"""Models the Lightning callback offers to AdaFisher optimizers it cannot see.

A learning-rate search replaces the trainer's callbacks while it runs, so an optimizer
created there is never handed to ``CAFINCallback``.  The callback offers its
LightningModule here at ``setup``; an AdaFisher still unbound at its first step binds
itself to an offered model that holds all of its parameters (through the optimizer's
public ``register_model_provider`` hook), and is unbound when the model is withdrawn
at ``teardown``.  The optimizer knows nothing of this module.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import nn
from torch.utils.hooks import RemovableHandle

from .binding import register_model_provider

#: offered models, with the optimizers that bound themselves to each
_OFFERED: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()
_provider: Optional[RemovableHandle] = None


def _provide(optimizer: Any) -> Optional[nn.Module]:
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model, binders in list(_OFFERED.items()):
        if mine <= {id(p) for p in model.parameters()}:
            binders.add(optimizer)
            return model
    return None


def offer_model(model: nn.Module) -> None:
    """Let any unbound AdaFisher whose parameters all belong to ``model`` bind to it at its first step."""
    global _provider
    _OFFERED.setdefault(model, weakref.WeakSet())
    if _provider is None:
        _provider = register_model_provider(_provide)


def withdraw_model(model: nn.Module) -> None:
    """Stop offering ``model`` and unbind the optimizers that bound themselves to it."""
    for opt in list(_OFFERED.pop(model, ())):
        if opt.bound_model is model:
            opt.unbind()
