"""The method contract: one check of sizes, base models and hyper-parameter names for every method, before
any work is done."""

from __future__ import annotations

import inspect

import pytest
import torch

from symlib.posteriors import METHODS, base, sampling


def _setup():
    full = sampling.setup_for("mnist-optunet", "tiny")
    return base.Setup(full.arch, full.make_model, full.x[:16], full.y[:16], full.recipe, name="")


@pytest.mark.parametrize("name", METHODS)
def test_every_method_declares_the_contract(name):
    m = sampling.method(name)
    assert isinstance(m, base.Method) and m.name == name and m.base in base.BASE_USES
    sample = __import__(f"symlib.posteriors.{name}", fromlist=["sample"]).sample
    sig = inspect.signature(sample)
    assert list(sig.parameters)[:6] == ["setup", "n_modes", "n_per_mode", "seed", "base", "progress"]
    assert "Args:" in sample.__doc__ and "n_per_mode:" in sample.__doc__
    # the hyper-parameters are the draw function's own keyword arguments, documented in the docstring
    for h in m.hyper:
        if h in sig.parameters:
            assert f"{h}:" in sample.__doc__ or "**hyper" in sample.__doc__, (name, h)


@pytest.mark.parametrize("name", METHODS)
def test_unknown_hyper_parameters_fail_before_any_work(name, monkeypatch):
    m = sampling.method(name)
    monkeypatch.setattr(m, "draw", lambda *a, **k: pytest.fail("draw must not run"))
    with pytest.raises(TypeError, match=rf"unknown {name} hyper-parameter\(s\) \['bogus'\]; valid: "):
        m.sample(_setup(), 1, 2, bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        sampling.run(name, _setup(), 1, 2, bogus=1)


def test_base_policies():
    st = _setup()
    wrong = {"w": torch.zeros(1, 3)}
    with pytest.raises(ValueError, match="starts from trained base models"):
        sampling.method("swag").request(st, 1, 2, 0, None, False)
    with pytest.raises(ValueError, match="not 'optunet' networks"):
        sampling.method("laplace").request(st, 1, 2, 0, wrong, False)
    with pytest.raises(ValueError, match="do not pass base models"):
        sampling.method("ensemble").request(st, 1, 2, 0, wrong, False)
    with pytest.warns(UserWarning, match="base models are not used"):
        req = sampling.method("vi").request(st, 1, 2, 0, wrong, False)
    assert req.base is None
    assert sampling.method("sghmc").request(st, 1, 2, 0, None, False).base is None
    with pytest.raises(ValueError, match="n_per_mode must be >= 1"):
        sampling.method("hmc").request(st, 1, 0, 0, None, False)
