"""The ImageNet ResNet-50 (torchvision's layout: 7x7 stride-2 stem, max-pool, bottleneck
blocks with the stride on the 3x3 convolution), here so the benchmark does not need
torchvision.  ``width`` scales every stage (64 is the real network) so tests can run a tiny one.
"""

from __future__ import annotations

from torch import Tensor, nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != out:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        y += self.shortcut(x)
        return self.relu(y)


class ResNet50(nn.Module):
    """ResNet-50 for 224x224 images (any size the stem's /32 reduction leaves at least 1x1)."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3, width: int = 64,
                 blocks: tuple[int, int, int, int] = (3, 4, 6, 3)):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, in_planes = [], width
        for i, n in enumerate(blocks):
            planes = width * 2**i
            layers = [Bottleneck(in_planes, planes, 1 if i == 0 else 2)]
            in_planes = planes * Bottleneck.expansion
            layers += [Bottleneck(in_planes, planes) for _ in range(n - 1)]
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.pool(x).flatten(1))
