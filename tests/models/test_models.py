"""The models: shapes, configurable inputs/classes, and that AdaFisher preconditions their layers."""

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher, AdaFisherW
from lightning_cafin.models import ImageTransformer, ResNet18, SmallCNN


@pytest.mark.parametrize("in_channels, classes, size", [(1, 10, 28), (3, 100, 32)])
def test_resnet18_inputs_and_classes_are_configurable(in_channels, classes, size):
    net = ResNet18(num_classes=classes, in_channels=in_channels)
    assert net(torch.randn(2, in_channels, size, size)).shape == (2, classes)
    assert sum(p.numel() for p in ResNet18().parameters()) == 11_173_962  # the paper's CIFAR ResNet-18


def test_small_cnn_and_its_bad_size():
    assert SmallCNN(num_classes=7, in_channels=3, image_size=32)(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(ValueError, match="divisible by 4"):
        SmallCNN(image_size=30)


def test_image_transformer_shapes_and_errors():
    net = ImageTransformer(num_classes=5, in_channels=3, image_size=32, patch_size=8, dim=64, depth=2, heads=4)
    assert net(torch.randn(3, 3, 32, 32)).shape == (3, 5)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        ImageTransformer(image_size=28, patch_size=5)
    with pytest.raises(ValueError, match="multiple of heads"):
        ImageTransformer(dim=130, heads=4)


@pytest.mark.parametrize("make, opt_cls", [(SmallCNN, AdaFisher), (ImageTransformer, AdaFisherW),
                                           (lambda: ResNet18(in_channels=1), AdaFisher)])
def test_every_weight_layer_is_preconditioned(make, opt_cls):
    net = make()
    opt = opt_cls(net)
    layers = [m for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm))]
    assert len(opt.binding.captures) == len(layers)
    free = {n for n, p in net.named_parameters() if not opt.binding.preconditioned(p)}
    assert free <= {"pos"}, f"parameters left on F = 1: {free}"
