"""The ``torch.export`` path of ``spec_of`` finds what the ``torch.fx`` path finds, and a spec smaller than
it should be is never silent (book: page "Architectures").

* The same small networks (an MLP; a CNN with BatchNorm, a max pool, a depthwise convolution and a residual
  add; timm's ViT) traced with ``tracer="fx"`` and ``tracer="export"`` give the same spec up to the names of
  the labels: the same label sizes, and the same classes of ``(parameter, axis, power, start)`` acted on
  together by one permutation (one scale). Their first layers read the raw input: in the ATen graph they
  are ``aten.conv2d`` / ``aten.linear`` on the input placeholder and parameters read by ``get_attr``.
* Hugging Face's ResNet, ViT and ConvNeXt (tiny configs, random init, float64, eval mode), which only
  ``torch.export`` reads, get their full group: their stem's label acts on the residual stream (the stem
  convolution's rows and every tensor that reads or writes the stream), and a random group element
  (permutations and the scalings that hold) keeps the output to 1e-10 in float64 while moving the
  parameters by more than 1e-2; permuting the stem's rows alone changes the output (negative control).
* :class:`~symlib.symmetry.trace.SmallSpecWarning`: raised for a layer without a rule that reads the input
  (a transposed convolution) and for an empty spec of a network with hidden units (a rule that drops its
  labels, simulated); not raised for a lone ``Linear`` (whose outputs are the network's, so its spec is
  empty rightly), two heads concatenated into the output, a parameter-free network, nor any network above.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformer_nets
from torch import nn

from symlib.symmetry import check, ops
from symlib.symmetry.spec import SymmetryError
from symlib.symmetry.trace import SmallSpecWarning, rules, spec_of
from symlib.symmetry.trace.labels import UNLABELLED


class CNN(nn.Module):
    """Conv-BN-ReLU stem, max pool, a residual block (3x3 conv, depthwise conv, BN) added to the stem,
    global pool, two Linear layers."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8, 6)
        self.fc2 = nn.Linear(6, 4)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.bn0(self.stem(x))), 2)
        y = self.bn2(self.dw(torch.relu(self.bn1(self.conv1(x)))))
        x = torch.relu(x + y).mean((2, 3))
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def _randomize_stats(model: nn.Module, seed: int) -> nn.Module:
    """Running statistics away from (0, 1), so that a wrong action on them shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                shape = m.running_mean.shape
                m.running_mean.copy_(0.3 * torch.randn(shape, generator=g, dtype=torch.float64))
                m.running_var.copy_(0.5 + torch.rand(shape, generator=g, dtype=torch.float64))
    return model


def _small(name):
    if name == "timm-vit":
        model, shape, _ = transformer_nets.build(name)
        return model, shape
    torch.manual_seed(0)
    model, shape = (_mlp(), (5,)) if name == "mlp" else (CNN(), (3, 8, 8))
    return _randomize_stats(transformer_nets._randomize(model.double().eval(), 0), 1), shape


def _classes(spec, kind):
    """The label classes of a spec up to renaming: per permutation (``kind="perm"``) or scaling label, its
    size and the set of ``(parameter, axis, power, start, inner, groups)`` it acts on."""
    sizes = spec.perms if kind == "perm" else spec.scales
    acted: dict[str, set] = {}
    for a in spec.actions:
        label = a.perm if kind == "perm" else a.scale
        if label is not None:
            acted.setdefault(label, set()).add((a.param, a.axis, a.power, a.start, a.inner, a.groups))
    return sorted((sizes[k], tuple(sorted(v))) for k, v in acted.items())


def _theta(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _keeps_function(spec, theta, kind="both"):
    g = ops.random_element(spec, kind, generator=_gen(1))
    moved = ops.act(g, theta, spec)
    assert max(float((moved[k] - theta[k]).abs().max()) for k in theta if theta[k].is_floating_point()) > 1e-2
    return float(check.function_error(spec, theta, moved))


@pytest.mark.parametrize("name", ["mlp", "cnn", "timm-vit"])
def test_export_path_gives_the_fx_spec(name):
    model, shape = _small(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallSpecWarning)
        fx = spec_of(model, shape, scalings="partial", tracer="fx")
        ex = spec_of(model, shape, scalings="partial", tracer="export")
    assert ex.perms and sorted(ex.perms.values()) == sorted(fx.perms.values())
    assert sorted(ex.scales.values()) == sorted(fx.scales.values())
    assert _classes(ex, "perm") == _classes(fx, "perm")
    assert _classes(ex, "scale") == _classes(fx, "scale")
    assert sorted(g for g, _ in ex.blocks.values()) == sorted(g for g, _ in fx.blocks.values())
    assert set(ex.no_scaling) == set(fx.no_scaling) and ex.weights == fx.weights
    first = {"mlp": "0.weight", "cnn": "stem.weight", "timm-vit": "patch_embed.proj.weight"}[name]
    assert any(a.param == first and a.axis == 0 and a.perm is not None for a in ex.actions)
    assert _keeps_function(ex, _theta(model)) < 1e-10


def _hf(name):
    """A tiny Hugging Face model (random init, float64, eval mode), its input shape and its stem's label."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "resnet":
        model = tf.ResNetForImageClassification(tf.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
            num_labels=3))
        shape, stem = (3, 16, 16), "resnet.embedder.embedder.convolution"
    elif name == "vit":
        model = tf.ViTForImageClassification(tf.ViTConfig(
            image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=3))
        shape, stem = (3, 16, 16), "vit.embeddings.patch_embeddings.projection"
    else:
        model = tf.ConvNextForImageClassification(tf.ConvNextConfig(
            num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=32))
        shape, stem = (3, 32, 32), "convnext.embeddings.patch_embeddings"
    model = _randomize_stats(transformer_nets._randomize(model.double().eval(), 0), 1)
    return model, shape, stem


# what the stem's label must act on besides the stem: the stream through the first residual block
STREAM = {
    "resnet": ["resnet.encoder.stages.0.layers.0.layer.0.convolution.weight",
               "resnet.encoder.stages.0.layers.0.layer.1.normalization.weight",
               "resnet.encoder.stages.1.layers.0.shortcut.convolution.weight"],
    "vit": ["vit.embeddings.cls_token", "vit.embeddings.position_embeddings",
            "vit.layers.0.layernorm_before.weight", "vit.layers.1.mlp.fc2.weight", "vit.layernorm.weight",
            "classifier.weight"],
    "convnext": ["convnext.embeddings.layernorm.weight", "convnext.encoder.stages.0.layers.0.dwconv.weight",
                 "convnext.encoder.stages.0.layers.0.pwconv2.weight",
                 "convnext.encoder.stages.1.downsampling_layer.0.weight"],
}


@pytest.mark.parametrize("name", ["resnet", "vit", "convnext"])
def test_hugging_face_models_get_their_stream(name):
    model, shape, stem = _hf(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallSpecWarning)
        spec = spec_of(model, shape, scalings="partial")
    assert stem in spec.perms
    acted = {a.param for a in spec.actions if a.perm == stem}
    assert {f"{stem}.weight", *STREAM[name]} <= acted
    theta = _theta(model)
    assert _keeps_function(spec, theta) < 1e-10
    # negative control: the stem's output channels permuted alone (the stream left as it is)
    broken = dict(theta)
    w = theta[f"{stem}.weight"]
    broken[f"{stem}.weight"] = w[torch.roll(torch.arange(w.shape[0]), 1)]
    assert float(check.function_error(spec, theta, broken)) > 1e-6


def test_tracer_argument():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) if x.shape[-1] == 4 else x  # a Python branch on a shape: torch.fx fails

    with pytest.raises(SymmetryError, match="tracer='auto'"):
        spec_of(Branchy(), (4,), tracer="fx")
    assert spec_of(Branchy(), (4,)).perms == {}  # exported; a lone layer: no symmetry
    with pytest.raises(ValueError, match="tracer must be"):
        spec_of(Branchy(), (4,), tracer="jit")


# ---------------------------------------------------------------------------------------- warnings
class Upsampler(nn.Module):
    """A transposed convolution (no rule) on the input, then Conv-ReLU-Conv."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 8, 2, stride=2)
        self.conv1 = nn.Conv2d(8, 6, 3)
        self.conv2 = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(torch.relu(self.up(x)))))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_layer_without_rule_on_the_input_warns(tracer):
    layer = r"up \((ConvTranspose2d|conv_transpose2d)\)"
    with pytest.warns(SmallSpecWarning, match=r"spec_of\(Upsampler\): no rule for " + layer) as rec:
        spec = spec_of(Upsampler(), (3, 4, 4), tracer=tracer)
    assert "tracer='fx'" in str(rec[0].message)
    assert spec.perms == {"conv1": 6}  # what it does find still holds


def test_empty_spec_with_hidden_units_warns(monkeypatch):
    """A rule that drops its labels (the bug this file guards against) leaves the CNN's spec empty."""
    monkeypatch.setitem(rules.TABLE, nn.Conv2d, rules.Rule(lambda w, node, op: UNLABELLED))
    monkeypatch.setitem(rules.TABLE, nn.Linear, rules.Rule(lambda w, node, op: UNLABELLED))
    model, shape = _small("cnn")
    with pytest.warns(SmallSpecWarning, match=r"spec_of\(CNN\) found no symmetry .*'stem', 'conv1', 'dw'"):
        spec = spec_of(model, shape)
    assert spec.perms == {}


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 3), nn.Linear(5, 2)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], dim=-1)


EMPTY = {"linear": lambda: nn.Linear(5, 3), "linear-logsoftmax": lambda: nn.Sequential(nn.Linear(5, 3),
          nn.LogSoftmax(-1)), "two-heads": TwoHeads, "no-parameters": lambda: nn.Sequential(nn.ReLU())}


@pytest.mark.parametrize("make", EMPTY.values(), ids=EMPTY.keys())
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_empty_spec_without_hidden_units_is_silent(make, tracer):
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallSpecWarning)
        spec = spec_of(make(), (5,), tracer=tracer)
    assert spec.perms == {}
