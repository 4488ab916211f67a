"""lightning_cafin: the AdaFisher second-order optimizer, fused CUDA kernels, one Lightning callback."""

from .optimizer import AdaFisher, AdaFisherW

__version__ = "0.1.0"

__all__ = ["AdaFisher", "AdaFisherW", "__version__"]
