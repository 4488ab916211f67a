"""The models the paper and the benchmarks use."""

from .resnet import ResNet18, cifar_resnet18
from .transformer import TransformerClassifier

__all__ = ["ResNet18", "TransformerClassifier", "cifar_resnet18"]
