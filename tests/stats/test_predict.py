"""predict.probs against a plain loop over nn.Modules, in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from symlib import models
from symlib import training as T
from symlib.stats import predict


def _stack(nets: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([n.state_dict()[k] for n in nets]) for k in nets[0].state_dict()}


def _reference(nets: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """p[s, n] = softmax(net_s(x_n)), one eval-mode module at a time."""
    with torch.no_grad():
        return torch.stack([torch.softmax(n.eval()(x), -1) for n in nets])


@pytest.mark.parametrize("chunk,batch_size", [(64, 256), (2, 3)])
def test_optunet_fast_path_is_the_module_loop(chunk, batch_size):
    """The stacked OptuNet path computes softmax(OptuNet_s(x)) for every sample s, whatever the chunking."""
    nets = [T.init_model(models.OptuNet, s).double() for s in range(5)]
    x = torch.randn(7, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p = predict.probs(_stack(nets), x, "optunet", batch_size=batch_size, chunk=chunk, dtype=torch.float64)
    assert p.shape == (5, 7, 10) and p.dtype == torch.float64
    torch.testing.assert_close(p, _reference(nets, x), rtol=1e-12, atol=1e-12)
    p32 = predict.probs(_stack(nets), x.float(), "optunet")
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32.double(), p, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("vmap", [True, False])
def test_resnet_with_batchnorm_buffers(vmap):
    """A tiny ResNet-18 with random BatchNorm statistics: functional_call (+ vmap) equals the module, in eval
    mode (running statistics, not batch statistics)."""
    g = torch.Generator().manual_seed(1)
    nets = []
    for s in range(3):
        torch.manual_seed(s)
        nets.append(models.randomize_batchnorm(models.ResNet18(num_classes=4, width=2), g).double().eval())
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64, generator=g)
    stacked = _stack(nets)
    assert any(k.endswith("running_var") for k in stacked)

    def make():
        return models.ResNet18(num_classes=4, width=2)

    p = predict.probs(stacked, x, make, batch_size=2, chunk=2, dtype=torch.float64, vmap=vmap)
    torch.testing.assert_close(p, _reference(nets, x), rtol=1e-10, atol=1e-12)


def test_mlp_template_module_is_not_modified():
    nets = [models.MLP([4, 6, 3]).double() for _ in range(4)]
    template = models.MLP([4, 6, 3])
    before = {k: v.clone() for k, v in template.state_dict().items()}
    x = torch.randn(9, 4, dtype=torch.float64)
    p = predict.probs(_stack(nets), x, template, chunk=3, dtype=torch.float64)
    torch.testing.assert_close(p, _reference(nets, x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.sum(-1), torch.ones(4, 9, dtype=torch.float64))
    after = template.state_dict()
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in after.items())


def test_bad_inputs():
    theta = _stack([models.OptuNet() for _ in range(2)])
    x = torch.zeros(3, 1, 28, 28)
    with pytest.raises(ValueError, match="non-empty stacked state dict"):
        predict.probs({}, x)
    with pytest.raises(ValueError, match="first axis"):
        predict.probs({**theta, "fc.bias": theta["fc.bias"][:1]}, x)
    with pytest.raises(ValueError, match="non-empty batch"):
        predict.probs(theta, x[:0])
    with pytest.raises(ValueError, match="module factory"):
        predict.probs(_stack([models.MLP([4, 3])]), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="unknown arch"):
        predict.probs(theta, x, arch="resnet18")
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        predict.probs(theta, x, chunk=0)
    res = _stack([models.ResNet18(num_classes=4, width=2)])
    no_stats = {k: v for k, v in res.items() if "running" not in k}
    with pytest.raises(ValueError, match="missing keys"):
        predict.probs(no_stats, torch.zeros(2, 3, 8, 8), lambda: models.ResNet18(num_classes=4, width=2))
    with pytest.raises(ValueError, match="architecture has"):
        predict.probs(res, torch.zeros(2, 3, 8, 8), lambda: models.ResNet18(num_classes=5, width=2))


class _DataDependent(nn.Module):
    """A branch on a tensor's value: torch.vmap cannot batch it, so probs must fall back to the loop."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        z = self.fc(x)
        return z if bool(z.sum() > 0) else -z


def test_vmap_failure_falls_back_to_the_loop():
    nets = [_DataDependent().double() for _ in range(3)]
    x = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        predict.probs(_stack(nets), x, _DataDependent, dtype=torch.float64, vmap=True)
    p = predict.probs(_stack(nets), x, _DataDependent, dtype=torch.float64)
    torch.testing.assert_close(p, _reference(nets, x), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    nets = [T.init_model(models.OptuNet, s) for s in range(4)]
    x = torch.randn(6, 1, 28, 28)
    cpu = predict.probs(_stack(nets), x)
    torch.testing.assert_close(predict.probs(_stack(nets), x, device="cuda").cpu(), cpu, rtol=1e-4, atol=1e-5)
    mlp = [models.MLP([4, 5, 3]) for _ in range(2)]
    xm = torch.randn(3, 4)
    gpu = predict.probs(_stack(mlp), xm, lambda: models.MLP([4, 5, 3]), device="cuda")
    torch.testing.assert_close(gpu.cpu(), _reference(mlp, xm), rtol=1e-4, atol=1e-5)
