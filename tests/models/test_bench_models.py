"""The benchmark's ResNet-50 and GPT: their real shapes, the LM's causality, and that
AdaFisher preconditions their layers."""

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher, AdaFisherW
from lightning_cafin.models.gpt import GPT, gpt2_small, lm_loss
from lightning_cafin.models.resnet50 import ResNet50


def n_params(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def test_resnet50_has_the_imagenet_shape():
    with torch.device("meta"):
        assert n_params(ResNet50()) == 25_557_032  # torchvision's resnet50
    net = ResNet50(num_classes=7, width=8)
    assert net(torch.randn(2, 3, 64, 64)).shape == (2, 7)


def test_gpt2_small_shape_and_logits():
    with torch.device("meta"):
        net = gpt2_small()
    # 124,439,808 for GPT-2 small with the head tied; ours adds an untied 768 x 50257 head
    assert n_params(net) == 124_439_808 + 768 * 50257
    assert len(net.blocks) == 12 and net.blocks[0].heads == 12 and net.head.in_features == 768
    small = GPT(vocab=50, dim=16, depth=2, heads=2, max_len=8)
    assert small(torch.randint(0, 50, (3, 8))).shape == (3, 8, 50)


def test_gpt_is_causal():
    net = GPT(vocab=50, dim=16, depth=2, heads=2, max_len=8).eval()
    a = torch.randint(0, 50, (1, 8))
    b = a.clone()
    b[0, 5:] = (b[0, 5:] + 1) % 50  # change the future only
    with torch.no_grad():
        la, lb = net(a), net(b)
    torch.testing.assert_close(la[:, :5], lb[:, :5])
    assert not torch.allclose(la[:, 5:], lb[:, 5:])


def test_gpt_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of heads"):
        GPT(dim=10, heads=4)
    with pytest.raises(ValueError, match="max_len"):
        GPT(vocab=10, dim=8, depth=1, heads=2, max_len=4)(torch.zeros(1, 5, dtype=torch.long))


def test_lm_loss_is_the_mean_token_cross_entropy():
    logits, targets = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    expected = torch.stack([torch.nn.functional.cross_entropy(logits[i, t:t + 1], targets[i, t:t + 1])
                            for i in range(2) for t in range(3)]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), expected)


@pytest.mark.parametrize("make, opt_cls", [(lambda: ResNet50(10, width=8), AdaFisher),
                                           (lambda: GPT(vocab=50, dim=16, depth=2, heads=2, max_len=8), AdaFisherW)])
def test_every_weight_layer_is_preconditioned(make, opt_cls):
    net = make()
    opt = opt_cls(net)
    layers = [m for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm))]
    assert len(opt.binding.captures) == len(layers)
