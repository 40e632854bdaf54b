"""Small float64 instances of every architecture, shared by the symmetry tests.

``make(arch)`` returns ``Scenario(model, spec, theta, x)``: the model (eval
mode), its traced spec, its parameters and buffers as a dict of float64
tensors, and a batch of inputs. BatchNorm layers get random running statistics
and affine parameters, so that they are not the identity. Widths are reduced
(``width=2``) and images are 8x8 (20x20 for OptuNet, whose valid convolutions
need it) so each scenario runs in milliseconds.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from symlib import models
from symlib.symmetry.spec import Params, Spec
from symlib.symmetry.trace import spec_of


class GroupedNet(nn.Module):
    """conv 2->4, ReLU, conv 4->6 with 2 groups, ReLU, global average pool, linear 6->3.

    The grouped convolution has 2 input and 3 output channels per group, so
    its input label has non-trivial permutations inside groups, and the two
    groups can swap together with the output groups.
    """

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3)
        self.conv2 = nn.Conv2d(4, 6, 3, groups=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv2(torch.relu(self.conv1(x)))))
        return self.fc(torch.flatten(x, 1))


class GroupedHead(nn.Module):
    """conv 2->4, ReLU, grouped conv 4->4 (2 groups) as the output layer, global average pool.

    The grouped convolution's outputs are the network's outputs, so its groups
    cannot move: only permutations inside the groups of ``conv1`` remain.
    """

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 3, groups=2)

    def forward(self, x):
        return torch.flatten(torch.mean(self.conv2(torch.relu(self.conv1(x))), dim=(2, 3)), 1)


class ResidualMLP(nn.Module):
    """``fc0 -> relu -> (+ fc2(relu(fc1(.)))) -> relu -> fc3``: a residual block without BatchNorm."""

    def __init__(self, d_in=3, width=4, hidden=5, d_out=2):
        super().__init__()
        self.fc0 = nn.Linear(d_in, width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.fc3 = nn.Linear(width, d_out)

    def forward(self, x):
        h = torch.relu(self.fc0(x))
        h = torch.relu(h + self.fc2(torch.relu(self.fc1(h))))
        return self.fc3(h)


ARCHS = ("mlp", "optunet", "resnet20", "resnet18", "grouped", "grouped_head", "residual_mlp")
CANONICAL_ARCHS = ("mlp", "optunet", "resnet20", "resnet18", "grouped", "grouped_head")


@dataclasses.dataclass
class Scenario:
    model: nn.Module
    spec: Spec
    theta: Params
    x: torch.Tensor


def build(arch: str) -> tuple[nn.Module, tuple[int, ...]]:
    """The model (float32, default init) and the shape of one input sample."""
    if arch == "mlp":
        return models.MLP([3, 5, 4, 2]), (3,)
    if arch == "optunet":
        return models.OptuNet(), (1, 20, 20)
    if arch == "resnet20":
        return models.ResNet20(num_classes=3, width=2), (3, 8, 8)
    if arch == "resnet18":
        return models.ResNet18(num_classes=5, width=2), (3, 8, 8)
    if arch == "grouped":
        return GroupedNet(), (2, 8, 8)
    if arch == "grouped_head":
        return GroupedHead(), (2, 8, 8)
    if arch == "residual_mlp":
        return ResidualMLP(), (3,)
    raise ValueError(f"unknown scenario {arch!r}; choose from {ARCHS}")


def make(arch: str, seed: int = 0, n: int = 16, dtype=torch.float64) -> Scenario:
    """A randomly initialised float64 instance of ``arch`` with non-trivial BatchNorm statistics."""
    torch.manual_seed(seed)
    model, input_shape = build(arch)
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    models.randomize_batchnorm(model, g)
    spec = spec_of(model, input_shape)
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randn(n, *input_shape, generator=g, dtype=dtype)
    return Scenario(model, spec, theta, x)


def optunet_reference(theta: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None):
    """``(loss (M,), grads)`` of ``M`` stacked OptuNets by autograd through ``nn.Module`` layers: the
    reference of the hand-written and compiled training steps. ``mask`` (``(M, 10, B)``, optional)
    multiplies the pooled features before the last layer (dropout)."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
    ref = []
    for i in range(x.shape[0]):
        net = models.OptuNet().to(x.dtype)
        h = net.pool(net.relu1(torch.nn.functional.conv2d(x[i], leaves["conv1.weight"][i])))
        h = torch.nn.functional.conv2d(h, leaves["conv2.weight"][i], groups=2).relu().mean((-1, -2))
        if mask is not None:
            h = h * mask[i].T
        logits = h @ leaves["fc.weight"][i].T + leaves["fc.bias"][i]
        ref.append(torch.nn.functional.cross_entropy(logits, y[i]))
    loss = torch.stack(ref)
    grads = torch.autograd.grad(loss.sum(), list(leaves.values()))
    return loss.detach(), dict(zip(leaves, grads, strict=True))


# ----------------------------------------------------------------------------- bad output folders
def snapshot(root) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (empty if ``root`` is missing or a file's parent), to
    assert that a refused command lost or changed nothing on disk."""
    from pathlib import Path

    root = Path(root)
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def readonly_folder(tmp_path):
    """A folder that cannot be written to: a ``chmod 555`` folder, or, for root (whom permissions do not
    stop), ``/proc/sys``, which the kernel keeps read-only; ``None`` where neither exists."""
    import os
    from pathlib import Path

    if os.geteuid() != 0:
        ro = tmp_path / "readonly"
        ro.mkdir()
        ro.chmod(0o555)
        return ro
    proc = Path("/proc/sys")
    return proc if proc.is_dir() and not os.access(proc, os.W_OK) else None
