"""ImageClassifier: metrics sized from the network, its Python default optimizer, input checks."""

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.models import SmallCNN
from lightning_cafin.tasks import ImageClassifier


def test_classes_come_from_the_last_linear_layer():
    task = ImageClassifier(SmallCNN(num_classes=7))
    assert task.val_accuracy.num_classes == 7
    assert ImageClassifier(SmallCNN(num_classes=7), num_classes=9).val_accuracy.num_classes == 9


def test_a_network_without_linear_layers_needs_num_classes():
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(ValueError, match="pass num_classes="):
        ImageClassifier(net)
    assert ImageClassifier(net, num_classes=3).test_accuracy.num_classes == 3


def test_label_smoothing_is_checked():
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
        ImageClassifier(SmallCNN(), label_smoothing=1.0)


def test_channels_last_gives_the_same_logits():
    torch.manual_seed(0)
    net = SmallCNN()
    plain = ImageClassifier(net).eval()
    x = torch.randn(4, 1, 28, 28)
    expected = plain(x)
    fast = ImageClassifier(net, channels_last=True).eval()
    assert fast.net.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(fast(x), expected, rtol=1e-5, atol=1e-5)


def test_python_default_optimizer_is_an_unbound_adafisher_over_all_parameters():
    task = ImageClassifier(SmallCNN())
    opt = task.configure_optimizers()
    assert type(opt) is AdaFisher and not opt.is_bound
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(task.parameters()))
