"""The one mini-batch loop of the posterior methods: SGD through it equals the stacked trainer, and a
diverging run stops with the step and the seed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from symlib import models
from symlib import training as T
from symlib.posteriors import sampling
from symlib.training import loop


def _problem(n=96):
    full = sampling.setup_for("mnist-optunet", "tiny")
    rec = dataclasses.replace(T.OPTUNET_MNIST.scaled(2), batch_size=32, momentum=0.9, nesterov=True)
    return full.x[:n].double(), full.y[:n], rec, full.fill[0]


def test_stacked_sgd_through_the_loop_equals_train_stacked():
    """Two implementations of the same SGD (a dict of tensors through loop.run, a flat buffer with fused
    crops in train_stacked) give the same networks in float64."""
    x, y, rec, fill = _problem()
    seeds = [3, 4, 5]
    init = {k: v.double() for k, v in T.init_params(models.OptuNet, seeds).items()}
    rule = loop.StackedSGD(rec)
    ours, _ = loop.run(rule, rule.init(init), seeds, x, y, rec, fill=fill)
    ref = T.train_stacked(init, seeds, x, y, rec, fill=fill, impl="matmul", workers=1)
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-10, atol=1e-12)


def test_a_diverging_run_names_step_and_seed():
    x, y, rec, fill = _problem(64)
    init = {k: v.double() for k, v in T.init_params(models.OptuNet, [7, 8]).items()}
    init["fc.bias"][:] = float("nan")
    rule = loop.StackedSGD(rec)
    with pytest.raises(FloatingPointError, match=r"test run: non-finite loss at step 0 .*seed\(s\) \[7, 8\]"):
        loop.run(rule, rule.init(init), [7, 8], x, y, rec, fill=fill, what="test run")


def test_on_step_sees_every_step():
    x, y, rec, fill = _problem(64)
    init = T.init_params(lambda: __import__("symlib").models.OptuNet(), [1])
    seen = []
    rule = loop.StackedSGD(rec, lr=lambda b: 0.0)  # a zero step: the weights never move
    out, _ = loop.run(rule, rule.init(init), [1], x.float(), y, rec, fill=fill,
                      on_step=lambda b, s, loss: seen.append((b.epoch, b.step)))
    assert seen == [(e, e * 2 + i) for e in range(2) for i in range(2)]
    assert all(torch.equal(out[k], init[k]) for k in init)
