"""lightning_cafin: the AdaFisher second-order optimizer, fused CUDA kernels, one Lightning callback.

``import lightning_cafin`` loads only torch and the optimizer (``extension_info`` and the
loader on first access): a plain-PyTorch user of
:class:`AdaFisher` never pays for Lightning, torchmetrics or TensorBoard.  The Lightning
side (``CAFINCallback``, ``DivergenceError``, the ``cli``, ``data``, ``tasks``, ``models``
and ``monitor`` modules) is imported on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .capture.exclusion import no_capture
from .capture.layers import register_layer
from .capture.rules import LayerRule
from .optimizer import AdaFisher, AdaFisherW

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself), imported on first access.
_LAZY = {
    # (lazy too, so that `python -m lightning_cafin.kernels.loader` runs a module not yet imported)
    "extension_info": (".kernels.loader", "extension_info"),
    "CAFINCallback": (".callback", "CAFINCallback"),
    "DivergenceError": (".callback", "DivergenceError"),
    "callback": (".callback", None),
    "cli": (".cli", None),
    "data": (".data", None),
    "tasks": (".tasks", None),
    "models": (".models", None),
    "monitor": (".monitor", None),
}

__all__ = [
    "AdaFisher", "AdaFisherW", "CAFINCallback", "DivergenceError", "LayerRule", "extension_info", "no_capture",
    "register_layer",
    "__version__",
]

if TYPE_CHECKING:  # pragma: no cover
    from .callback import CAFINCallback, DivergenceError
    from .kernels.loader import extension_info


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module = importlib.import_module(module_name, __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
