"""``canonicalize`` warns when a label's order is decided below the input dtype's resolution.

Two hidden neurons of a small ReLU network are given largest incoming weights (the "max" key) one float32
step apart (3e-8 of the label's largest key) while their other weights differ: in float32 the inputs
themselves are only known to 6e-8, so the canonical order of that label is not decided, and the call must
say so, naming the label and the two fixes. In float64, or with a wide gap, or with the "sum" key (whose
sums differ by far more), it must stay silent. The ResNet-50 case (torchvision, float32) is tested in
``test_torchvision.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from symlib import models
from symlib.symmetry import canonical
from symlib.symmetry.canonical import AmbiguousCanonicalForm
from symlib.symmetry.spec import mlp_spec


def _tied(dtype=torch.float32, ulps=1):
    """MLP 4-6-5-3 in float32 (cast to ``dtype``) whose layer-1 neurons 1 and 4 have largest incoming
    weights ``ulps`` float32 steps apart (0.9 and its ``ulps``-th float32 neighbour, 6e-8 apart per step),
    other weights apart, and whose neuron 0 has the label's largest key, 2."""
    torch.manual_seed(0)
    net = models.MLP([4, 6, 5, 3])
    spec = mlp_spec(net)
    theta = {k: v.detach().clone() for k, v in net.state_dict().items()}
    w = theta["0.weight"]
    top = torch.tensor(0.9)
    for _ in range(abs(ulps)):
        top = torch.nextafter(top, torch.tensor(float("inf") if ulps > 0 else 0.0))
    w[0] = torch.tensor([2.0, 0.1, -0.3, 0.4])  # the label's largest key: the tie is 3e-8 of it
    w[1] = torch.tensor([0.3, -0.2, 0.9, 0.1])
    w[4] = torch.tensor([-0.5, 0.6, float(top), 0.2])
    return spec, {k: v.to(dtype) for k, v in theta.items()}


def _canon_quiet(theta, spec, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmbiguousCanonicalForm)
        return canonical.canonicalize(theta, spec, scaling=None, **kw)


def test_warns_on_a_tie_below_float32_resolution():
    spec, theta = _tied()
    assert float(canonical.margins(theta, spec, scaling=None)["h0"]) < torch.finfo(torch.float32).resolution
    with pytest.warns(AmbiguousCanonicalForm) as record:
        canonical.canonicalize(theta, spec, scaling=None)
    assert len(record) == 1  # once per call
    msg = str(record[0].message)
    assert "'h0'" in msg and "'h1'" not in msg  # names the tied label only
    assert "float64" in msg and "key='sum'" in msg  # and the two fixes
    assert record[0].filename == __file__  # points at the caller's line


def test_silent_in_float64_untied_and_with_another_key():
    spec, theta = _tied(torch.float64)  # the same weights: a gap of 6e-8 is far above float64's resolution
    _canon_quiet(theta, spec)
    spec, theta = _tied(ulps=100000)  # a relative gap of 6e-3
    _canon_quiet(theta, spec)
    spec, theta = _tied()
    _canon_quiet(theta, spec, key="sum")


def test_a_warned_tie_is_a_real_ambiguity():
    """The warning is not idle: moving neuron 4's largest weight by two float32 steps (a rounding-level
    change of 1.2e-7) swaps the canonical order of neurons 1 and 4, and the canonical weights of
    the two nearly equal networks differ by O(1); with the "sum" key they agree to rounding."""
    spec, up = _tied(ulps=1)
    _, down = _tied(ulps=-1)
    assert float((up["0.weight"] - down["0.weight"]).abs().max()) < 2e-7
    with pytest.warns(AmbiguousCanonicalForm):
        a = canonical.canonicalize(up, spec, scaling=None)
    with pytest.warns(AmbiguousCanonicalForm):
        b = canonical.canonicalize(down, spec, scaling=None)
    assert float((a["0.weight"] - b["0.weight"]).abs().max()) > 0.5
    c, d = (_canon_quiet(t, spec, key="sum") for t in (up, down))
    assert float((c["0.weight"] - d["0.weight"]).abs().max()) < 1e-6
