"""Symmetry-aware convergence diagnostics: where the answer is known by construction.

Chains that each sample (perfectly, i.i.d.) one randomly permuted and rescaled copy of one distribution
sample the same distribution of functions: their canonical forms and every invariant functional agree
(R-hat ~ 1), while their raw weights cannot (R-hat >> 1)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from symlib import models
from symlib.stats import convergence as CV
from symlib.symmetry import ops
from symlib.symmetry.spec import mlp_spec

WIDTHS = [3, 4, 5, 2]


def _outputs(params, x):
    """Stacked MLP outputs ``{name: (M, ...)}`` on ``x (N, d)`` -> ``(M, N, out)``."""
    h = x.expand(next(iter(params.values())).shape[0], *x.shape)
    n = len(params) // 2
    for i in range(n):
        h = torch.baddbmm(params[f"{2 * i}.bias"].unsqueeze(1), h, params[f"{2 * i}.weight"].transpose(1, 2))
        if i < n - 1:
            h = torch.relu(h)
    return h


def _permuted_chains(c=4, s=400, seed=0):
    """``c`` chains of ``s`` i.i.d. draws around one network, chain ``i`` acted on by its own random
    permutation and scaling (fixed along the chain)."""
    gen = torch.Generator().manual_seed(seed)
    net = models.MLP(WIDTHS).double()
    spec = mlp_spec(net)
    star = {k: v.detach()[None] for k, v in net.named_parameters()}
    draws = {k: v + 0.03 * torch.randn(c * s, *v.shape[1:], generator=gen, dtype=torch.float64)
             for k, v in star.items()}
    g = ops.random_element(spec, batch=(c,), generator=gen)
    per_draw = ops.Element({k: p.repeat_interleave(s, 0) for k, p in g.perms.items()},
                           {k: v.repeat_interleave(s, 0) for k, v in g.scales.items()})
    moved = ops.act(per_draw, draws, spec)
    return {k: v.reshape(c, s, *v.shape[1:]) for k, v in moved.items()}, spec, g


def test_permuted_copies_diverge_raw_and_converge_canonical_and_invariant():
    draws, spec, g = _permuted_chains()
    assert len({tuple(p.tolist()) for p in g.perms["h0"]}) > 1, "the chains sit in different permuted copies"
    x = torch.randn(6, WIDTHS[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = _outputs({k: v.flatten(0, 1) for k, v in draws.items()}, x).reshape(4, 400, -1)
    rep = CV.diagnose(draws, spec, {"f(x)": out})
    raw, canon, inv = rep["raw"], rep["canonical"], rep["invariant"]
    # raw: the weights of different copies never meet
    assert np.median(raw.rhat) > 1.5
    # canonical and invariant: one distribution in every chain; with 4 x 400 i.i.d. draws R-hat is
    # 1 + O(1 / (C S)) and the bulk ESS near C S = 1,600 (3 standard errors of each: < 1.01, > 1,000)
    assert canon.rhat.max() < 1.01 and inv.rhat.max() < 1.01
    assert canon.ess_bulk.min() > 1000 and inv.ess_bulk.min() > 1000 and inv.ess_tail.min() > 1000
    # every chain is fine on its own, on every scale (i.i.d. within; the smallest of ~200 noisy estimates
    # from 400 draws each: well below 400 at times, never near the 50 of a stuck chain)
    for d in (raw, canon, inv):
        assert d.rhat_per_chain.max() < 1.05 and d.ess_bulk_per_chain.min() > 100
    assert rep.converged(scales=("canonical", "invariant"), ess=1000)
    assert not rep.converged(scales=("raw",))
    assert rep.converged(scales=("raw",), per_chain=True, rhat=1.05, ess=100)
    frame = rep.frame()
    assert list(frame.index) == list(CV.SCALES) and frame.loc["raw", "quantities"] == sum(
        v[0, 0].numel() for v in draws.values())
    assert frame["quantities"].dtype.kind == "i" and frame["rhat_max"].dtype.kind == "f"  # prints 9, not 9.0
    json.dumps(rep.to_json())
    assert set(rep["invariant"].of("f(x)[0]")) == {"rhat", "ess_bulk", "ess_tail", "rhat_per_chain",
                                                   "ess_bulk_per_chain"}


def test_chains_in_different_modes_diverge_on_every_scale():
    """The negative control: two chains around two different networks (not copies of one) disagree on
    canonical weights and on invariant functionals too."""
    a, spec, _ = _permuted_chains(2, 300, seed=0)
    b, _, _ = _permuted_chains(2, 300, seed=7)  # another network (another initialisation)
    both = {k: torch.cat([a[k], b[k]]) for k in a}
    x = torch.randn(6, WIDTHS[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = _outputs({k: v.flatten(0, 1) for k, v in both.items()}, x).reshape(4, 300, -1)
    rep = CV.diagnose(both, spec, {"f(x)": out})
    assert rep["canonical"].rhat.max() > 1.5 and rep["invariant"].rhat.max() > 1.5
    assert not rep.converged()


def test_predictive_functionals():
    """Test log-likelihood = mean log p(y_n | x_n), the probabilities of the true class of the first inputs;
    a binary classifier may pass p(class 1)."""
    p = torch.tensor([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]], dtype=torch.float64)
    probs = p.expand(2, 3, 3, 2)
    y = torch.tensor([1, 0, 1])
    f = CV.predictive_functionals(probs, y, n_inputs=2)
    np.testing.assert_allclose(f["test log-likelihood"], np.full((2, 3), np.log([0.8, 0.6, 0.5]).mean()))
    np.testing.assert_allclose(f["p(y|x)"][0, 0], [0.8, 0.6])
    fb = CV.predictive_functionals(probs[..., 1], y, n_inputs=2)
    np.testing.assert_allclose(fb["test log-likelihood"], f["test log-likelihood"])
    with pytest.raises(ValueError, match="len\\(y\\)"):
        CV.predictive_functionals(probs, torch.tensor([0, 1]))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="nothing to diagnose"):
        CV.diagnose()
    with pytest.raises(ValueError, match="chains x draws"):
        CV.diagnose(functionals={"a": np.zeros((2, 10)), "b": np.zeros((3, 10))})
    with pytest.raises(ValueError, match="chains, draws"):
        CV.diagnose(functionals={"a": np.zeros(10)})
