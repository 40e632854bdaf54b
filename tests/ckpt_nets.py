"""Small networks for the checkpoint tests (tests/ckpt): importable by name (``ckpt_nets:SmallNet``, with
``tests`` on the path) and by file (``tests/ckpt_nets.py:SmallNet``), as a user's own module would be."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INPUT_SHAPE = (1, 8, 8)


class SmallNet(nn.Module):
    """A convolution with BatchNorm, a strided convolution, global pooling and a linear head."""

    def __init__(self, width: int = 4, num_classes: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 6, 3, stride=2, padding=1)
        self.head = nn.Linear(6, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean((2, 3)))


class Tied(nn.Module):
    """A linear map and its transpose sharing one weight (tied weights, as language models tie
    embeddings)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 3, bias=False)
        self.dec = nn.Linear(3, 5, bias=False)
        self.dec.weight = self.enc.weight  # the same Parameter, shape (3, 5) for both

    def forward(self, x):
        return F.linear(torch.relu(self.enc(x)), self.enc.weight.t())


def trained(seed: int, width: int = 4) -> dict[str, torch.Tensor]:
    """The state dict of a SmallNet after a few SGD steps from ``seed`` (BatchNorm statistics move)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = SmallNet(width)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, *INPUT_SHAPE, generator=g), torch.randint(0, 3, (16,), generator=g)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


class DigitMLP(nn.Sequential):
    """A ReLU MLP on MNIST digits (1 x 28 x 28 -> 10 classes), for merging and barriers."""

    def __init__(self, width: int = 32):
        super().__init__(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


class DigitCNN(nn.Module):
    """A small CNN on MNIST digits: two strided convolutions (the first with BatchNorm), global average
    pooling and a linear head."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean((2, 3)))
