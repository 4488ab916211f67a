"""The models the paper, the configs and the benchmarks use."""

from .cnn import SmallCNN
from .resnet import ResNet18, cifar_resnet18
from .transformer import ImageTransformer, TransformerClassifier

__all__ = ["ImageTransformer", "ResNet18", "SmallCNN", "TransformerClassifier", "cifar_resnet18"]
