"""Reference models written with torch alone: ResNet-18/50 and a small CNN for CPU demos.

torchvision is not a dependency: the loop must run in a bare torch environment, and owning the
definitions lets `zero_init_residual` and the small model stay in one readable place. The
ResNets follow the standard layout (He et al. 2016, "v1.5": the stride sits on the 3x3 conv of a
Bottleneck), so their parameter counts and accuracy match the usual reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .config import MODEL_NAMES


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs with an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4, plus the shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """ImageNet-style ResNet: 7x7/2 stem, max-pool, four stages (64..512 wide), global pool."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int, int],
        num_classes: int,
        *,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages = []
        cin = 64
        for i, (width, depth) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            blocks = []
            for j in range(depth):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(cin, width, stride))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        _init_weights(self)
        if zero_init_residual:
            # Each residual branch starts as zero, so every block starts as the identity:
            # large-batch training is stabler early on (Goyal et al. 2017).
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class SmallNet(nn.Module):
    """A few conv-BN-ReLU layers and a linear head: learns small synthetic images on a CPU.

    Sized for 32-48 px inputs and two CPU cores: three resolution stages (width, 2x, 4x), each
    ending in a 2x max-pool, then a global average pool. BatchNorm makes it train fast at a
    high learning rate, which is what a demo of a few epochs needs.
    """

    def __init__(self, num_classes: int, width: int = 24) -> None:
        super().__init__()
        w1, w2, w3 = width, 2 * width, 4 * width

        def cbr(cin: int, cout: int) -> list[nn.Module]:
            return [_conv3x3(cin, cout), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(
            *cbr(3, w1),
            *cbr(w1, w1),
            nn.MaxPool2d(2),
            *cbr(w1, w2),
            *cbr(w2, w2),
            nn.MaxPool2d(2),
            *cbr(w2, w3),
            nn.MaxPool2d(2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w3, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def _init_weights(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def resnet18(num_classes: int = 1000, **kwargs: bool) -> ResNet:
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, **kwargs)


def resnet50(num_classes: int = 1000, **kwargs: bool) -> ResNet:
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, **kwargs)


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "small": lambda num_classes, zero_init_residual: SmallNet(num_classes),
    "resnet18": lambda num_classes, zero_init_residual: resnet18(
        num_classes, zero_init_residual=zero_init_residual
    ),
    "resnet50": lambda num_classes, zero_init_residual: resnet50(
        num_classes, zero_init_residual=zero_init_residual
    ),
}


def build_model(name: str, num_classes: int, *, zero_init_residual: bool = False) -> nn.Module:
    """The model called `name` (one of `MODEL_NAMES`) with a `num_classes`-way head."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return _BUILDERS[name](num_classes, zero_init_residual)
