"""Reading the MCMC rows of Table 1: SGHMC's temperatures and the HMC reference's diagnostics, from
sample sets (the real ones come from tests/posteriors)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from symlib import models
from symlib import training as T
from symlib.paper import samplers
from symlib.posteriors import hmc, sghmc
from symlib.posteriors.base import Setup


def _setup():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (48,), generator=g)
    rec = dataclasses.replace(T.OPTUNET_MNIST, epochs=1, batch_size=16, weight_decay=2e-4)
    return Setup("optunet", models.OptuNet, x, y, rec, name="synthetic", scale="tiny")


def test_sghmc_and_hmc_rows_are_read_off_their_sets():
    st = _setup()
    base = T.init_params(st.make_model, [1, 2])
    sg = sghmc.sample(st, 2, 2, 0, base=base, progress=False, burn_in=1, noise_batches=4)
    frame = samplers.sghmc_temperatures({("SGHMC", "multi-mode"): sg, ("X", "y"): object()})
    assert list(frame.index) == [("SGHMC", "multi-mode")] and frame.iloc[0]["setting"] == "corrected"
    row = frame.iloc[0]
    assert row["T_eff min"] <= row["T_eff chain min"] <= row["T_eff"]
    assert row["T_eff"] <= row["T_eff chain max"] <= row["T_eff max"]
    settings = samplers.setting_temperatures(st, base, n_batches=4)
    assert list(settings.index) == ["corrected", "paper"]
    # without a correction the minibatch noise only adds heat: above the stated temperature 1
    assert settings.loc["paper", "T_eff with crops (min)"] >= 1.0
    out = hmc.sample(st, 2, 4, seed=0, progress=False, n_warmup=3, n_leapfrog=2, grad_chunk=48,
                     polish_epochs=10,
                     n_test=16, n_probe=3)
    scales = samplers.hmc_scales(out)
    assert set(scales.index) == {"raw", "canonical", "invariant"}
    chains = samplers.hmc_chains(out)
    assert len(chains) == 2 and {"train NLL", "converged locally", "step size"} <= set(chains.columns)
    cost = samplers.hmc_cost(out)
    assert cost["polish epochs"] == 10 and cost["sampler gradients"] > 0
    parts = [v for k, v in cost.items() if k.endswith(" s") and k != "total s"]
    assert cost["total s"] == pytest.approx(sum(parts))
    d = out.diagnostics
    assert out.hyper["mass_matrix"] == "dense" and d["probes"] == "train" and len(d["polish"]["trace"]) == 2
    assert len(d["potential_trace"]) == 2 and len(d["potential_trace"][0]) == 4
