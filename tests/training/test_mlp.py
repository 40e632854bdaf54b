"""Stacked ReLU MLP classifiers (symlib.training.mlp): the hand-written gradient equals autograd through
the module, and training through the stacked path equals one module at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from symlib import models
from symlib import training as T
from symlib.training import loop
from symlib.training import mlp as tm


@pytest.mark.parametrize("widths", [(4, 10), (4, 5, 3), (3, 6, 4, 5)])
@pytest.mark.parametrize("masked", [False, True])
def test_gradient_equals_autograd_through_the_module(widths, masked):
    """Loss and every gradient of each stacked network equal those of MLPClassifier through autograd, with
    the dropout multiplier on the features before fc (float64, to rounding)."""
    g = torch.Generator().manual_seed(0)
    make = lambda: models.MLPClassifier(widths).double()  # noqa: E731
    params = T.init_params(make, [0, 1, 2])
    x = torch.randn(3, 7, widths[0], generator=g, dtype=torch.float64)
    y = torch.randint(0, widths[-1], (3, 7), generator=g)
    mask = (torch.rand(3, widths[-2], 7, generator=g) > 0.3).double() / 0.7 if masked else None
    loss, grads = tm.mlp_loss_grads(params, x, y, mask)
    assert list(grads) == list(params)
    for i in range(3):
        m = make()
        m.load_state_dict({k: v[i] for k, v in params.items()})
        h = m.hidden(x[i])
        if masked:
            h = h * mask[i].T
        ref = F.cross_entropy(m.fc(h), y[i])
        ref.backward()
        torch.testing.assert_close(loss[i], ref.detach(), rtol=1e-12, atol=1e-12)
        for k, p in m.named_parameters():
            torch.testing.assert_close(grads[k][i], p.grad, rtol=1e-10, atol=1e-12)
    # inputs shared by every model: the same numbers as the copies
    shared, _ = tm.mlp_loss_grads(params, x[0], y[0])
    copies, _ = tm.mlp_loss_grads(params, x[0].expand(3, -1, -1), y[0].expand(3, -1))
    torch.testing.assert_close(shared, copies)
    torch.testing.assert_close(tm.mlp_forward(params, x[0])[1], _module(make, params, 1)(x[0]).detach())


def _module(make, params, i):
    m = make()
    m.load_state_dict({k: v[i] for k, v in params.items()})
    return m


def test_shapes_and_names():
    assert tm.shapes((4, 8, 10)) == {"hidden.0.weight": (8, 4), "hidden.0.bias": (8,), "fc.weight": (10, 8),
                                     "fc.bias": (10,)}
    names = dict(models.MLPClassifier((4, 3, 2, 5)).named_parameters()).keys()
    assert names == tm.shapes((4, 3, 2, 5)).keys()
    with pytest.raises(ValueError, match="not the state dict of an MLPClassifier"):
        tm.layer_names(T.init_params(lambda: models.MLP([4, 3, 2]), [0]))


def test_stacked_training_equals_one_module_at_a_time():
    """SGD with momentum and weight decay on vector inputs: the stacked rule through the loop (every model
    its own batches) gives the networks that torch.optim.SGD gives one module at a time on the same
    batches (float64)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (40,), generator=g)
    rec = T.Recipe(epochs=3, batch_size=16, lr=0.1, momentum=0.9, weight_decay=1e-2, milestones=(2,))
    make = lambda: models.MLPClassifier((4, 6, 10)).double()  # noqa: E731
    seeds = [5, 6]
    init = T.init_params(make, seeds)
    rule = loop.StackedSGD(rec, "mlp-classifier")
    ours, _ = loop.run(rule, rule.init(dict(init)), seeds, x, y, rec)
    for i, s in enumerate(seeds):
        mod = loop.ModuleSGD(rec)
        m = loop.run(mod, mod.init(_module(make, init, i)), [s], x, y, rec)
        for k, p in m.named_parameters():
            torch.testing.assert_close(ours[k][i], p.detach(), rtol=1e-10, atol=1e-12)


def test_vector_batches_are_rows_and_crops_are_refused():
    x = torch.arange(30.0).reshape(10, 3)
    y = torch.arange(10)
    rec = T.Recipe(epochs=1, batch_size=4, lr=0.1)
    for b in T.minibatches([0, 1], x, y, rec):
        torch.testing.assert_close(b.x[..., 0] / 3, b.y.double().float())  # row i holds 3i, 3i+1, 3i+2
    with pytest.raises(ValueError, match="random crops and flips need images"):
        next(T.minibatches([0], x, y, T.Recipe(epochs=1, batch_size=4, lr=0.1, crop_padding=2)))
