"""lightning_cafin: the AdaFisher second-order optimizer, fused CUDA kernels, one Lightning callback."""

from .callback import CAFINCallback, DivergenceError
from .optimizer import AdaFisher, AdaFisherW

__version__ = "0.1.0"

__all__ = ["AdaFisher", "AdaFisherW", "CAFINCallback", "DivergenceError", "__version__"]
