"""lightning_cafin: the AdaFisher second-order optimizer, fused CUDA kernels, one Lightning callback."""

from .callback import CAFINCallback, DivergenceError
from .capture.layers import register_layer
from .capture.rules import LayerRule
from .optimizer import AdaFisher, AdaFisherW

__version__ = "0.1.0"

__all__ = ["AdaFisher", "AdaFisherW", "CAFINCallback", "DivergenceError", "LayerRule", "__version__", "register_layer"]
