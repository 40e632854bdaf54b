"""Architectures used in the paper (book: chapters "A gentle example" and "Min-mass").

* :class:`MLP`: ``Linear -> act -> ... -> Linear`` as an ``nn.Sequential`` (the
  2-2-1 perceptron of the paper's Figure 1 is ``MLP([2, 2, 1])``).
* :class:`MLPClassifier`: ReLU hidden layers, a dropout slot and an output layer ``fc`` (the networks
  of chapter "Against the true posterior", whose stacked passes are :mod:`symlib.training.mlp`).
* :class:`OptuNet`: the 392-parameter MNIST network of the paper. Its exact
  layers were not published; this reconstruction matches the count exactly and
  has a grouped convolution as its second convolution (paper App. B):
  conv 1->2 (4x4, no bias), ReLU, max-pool 3, conv 2->10 (5x5, groups 2, no
  bias), ReLU, global average pool, linear 10->10: 32 + 250 + 110 = 392.
* :class:`ResNet20`: the CIFAR ResNet of He et al. (2016, §4.2), 3 stages of 3
  basic blocks with 16/32/64 channels (Rossi et al. 2023 use it). Where the
  shape changes, the shortcut is a 1x1 convolution + BatchNorm (He et al.'s
  option B) rather than zero padding (option A), so that every shortcut is a
  layer that the symmetry spec can act on.
* :class:`ResNet18`: the CIFAR-style ResNet-18 of the paper: a 3x3 stride-1
  stem, no max-pool, basic blocks [2, 2, 2, 2] with 64..512 channels, 1x1
  convolution + BatchNorm shortcuts, global average pool, linear head
  (``num_classes`` 100 for CIFAR-100, 200 for TinyImageNet).

Both ResNets take a ``width`` (the first stage's channels) so tests can build
tiny instances with the same structure.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MLP", "BasicBlock", "MLPClassifier", "OptuNet", "ResNet18", "ResNet20", "num_parameters",
           "randomize_batchnorm"]

_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "leaky_relu": nn.LeakyReLU, "gelu": nn.GELU}


class MLP(nn.Sequential):
    """Multilayer perceptron with layer widths ``widths`` (``widths[0]`` inputs, ``widths[-1]`` outputs)
    and one activation between layers.

    Args:
        widths: layer widths, input first, output last (at least two).
        activation: ``"relu"`` (default), ``"leaky_relu"``, ``"tanh"`` or ``"gelu"``.
        bias: whether Linear layers have biases.
    """

    def __init__(self, widths: Sequence[int], activation: str = "relu", bias: bool = True):
        if len(widths) < 2 or any(int(w) < 1 for w in widths):
            raise ValueError(f"widths must be at least two positive integers, got {list(widths)}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose from {sorted(_ACTIVATIONS)}")
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=False)):
            if i:
                layers.append(_ACTIVATIONS[activation]())
            layers.append(nn.Linear(int(a), int(b), bias=bias))
        super().__init__(*layers)
        self.widths = tuple(int(w) for w in widths)


class MLPClassifier(nn.Module):
    """A ReLU MLP classifier laid out like the paper's networks: hidden ``Linear`` + ReLU layers
    (``hidden``), dropout before the last layer (``dropout``, the slot of MC dropout) and the output layer
    ``fc``.

    Args:
        widths: inputs, hidden widths, classes (at least two entries; two: a linear classifier).
        dropout: probability of dropping each feature before ``fc`` (0: none; no parameters).
    """

    def __init__(self, widths: Sequence[int], dropout: float = 0.0):
        super().__init__()
        if len(widths) < 2 or any(int(w) < 1 for w in widths):
            raise ValueError(f"widths must be at least two positive integers, got {list(widths)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout}")
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-2], widths[1:-1], strict=False):
            layers += [nn.Linear(int(a), int(b)), nn.ReLU()]
        self.hidden = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(int(widths[-2]), int(widths[-1]))
        self.widths = tuple(int(w) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(self.hidden(x)))


class OptuNet(nn.Module):
    """The paper's 392-parameter MNIST network (reconstruction; see module docstring)."""

    def __init__(self, num_classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, kernel_size=4, bias=False)
        self.relu1 = nn.ReLU()
        self.pool = nn.MaxPool2d(3)
        self.conv2 = nn.Conv2d(2, 10, kernel_size=5, groups=2, bias=False)
        self.relu2 = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(10, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu1(self.conv1(x)))
        x = self.gap(self.relu2(self.conv2(x)))
        return self.fc(self.dropout(self.flatten(x)))


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``, 3x3 convolutions without biases.

    The shortcut is the identity, or a 1x1 convolution + BatchNorm when the
    stride or the width changes.
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class _CifarResNet(nn.Module):
    """3x3 stem conv + BN + ReLU, stages of :class:`BasicBlock`, global average pool, linear head."""

    def __init__(
        self,
        blocks: Sequence[int],
        widths: Sequence[int],
        num_classes: int,
        in_channels: int,
        dropout: float = 0.0,
    ):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout}")
        if num_classes < 1 or in_channels < 1 or any(w < 1 for w in widths):
            raise ValueError(
                f"num_classes, in_channels and widths must be positive, got {num_classes}, "
                f"{in_channels}, {list(widths)}"
            )
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        in_planes = widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths, strict=True)):
            layers = []
            for j in range(n):
                layers.append(BasicBlock(in_planes, w, stride=2 if (i > 0 and j == 0) else 1))
                in_planes = w
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.num_stages = len(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)  # last-layer dropout (MC dropout); no parameters
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(self.dropout(torch.flatten(self.pool(x), 1)))


class ResNet20(_CifarResNet):
    """CIFAR ResNet-20: 3 stages x 3 basic blocks, widths ``width * (1, 2, 4)`` (16/32/64 by default).

    Args:
        num_classes: outputs (10 for CIFAR-10).
        width: channels of the first stage (16 in He et al. 2016).
        in_channels: input channels (3 for RGB).
    """

    def __init__(self, num_classes: int = 10, width: int = 16, in_channels: int = 3):
        super().__init__([3, 3, 3], [width, 2 * width, 4 * width], num_classes, in_channels)


class ResNet18(_CifarResNet):
    """CIFAR-style ResNet-18: 3x3 stride-1 stem, no max-pool, blocks [2, 2, 2, 2], widths
    ``width * (1, 2, 4, 8)`` (64..512 by default).

    Args:
        num_classes: outputs (100 for CIFAR-100, 200 for TinyImageNet).
        width: channels of the first stage (64 in the paper).
        in_channels: input channels (3 for RGB).
        dropout: probability of dropping each pooled feature before the last layer (MC dropout uses 0.5,
            paper App. B.1); 0 (default): none. It has no parameters: the state dict is the same.
    """

    def __init__(self, num_classes: int = 100, width: int = 64, in_channels: int = 3, dropout: float = 0.0):
        super().__init__(
            [2, 2, 2, 2], [width, 2 * width, 4 * width, 8 * width], num_classes, in_channels, dropout
        )


@torch.no_grad()
def randomize_batchnorm(model: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """Give every BatchNorm random, non-trivial statistics and affine parameters, in place.

    A freshly built network has running means 0, variances 1 and gamma 1,
    which hides mistakes in how a symmetry treats BatchNorm; checks of the
    symmetries in eval mode should run on these instead. Running means and
    betas are standard normal, variances uniform on [0.5, 1.5), and gammas
    have a random sign and a magnitude uniform on [0.5, 1.5).

    Returns:
        ``model``, for chaining.
    """
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            c, kw = mod.num_features, {"generator": generator, "dtype": mod.running_mean.dtype}
            mod.running_mean.copy_(torch.randn(c, **kw))
            mod.running_var.copy_(torch.rand(c, **kw) + 0.5)
            sign = torch.randn(c, **kw).sign()
            mod.weight.copy_(sign * (0.5 + torch.rand(c, **kw)))
            mod.bias.copy_(torch.randn(c, **kw))
    return model


def num_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
