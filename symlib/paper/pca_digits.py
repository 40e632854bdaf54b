r"""The problem of chapter "Against the true posterior": MNIST digits seen through a few principal
components, classified by small ReLU MLPs with a Gaussian prior (book: chapter "Against the true
posterior"; beyond the paper).

The embedded MNIST digits (:func:`symlib.data.load`) are projected on the first ``n_components``
principal components of the 4,000 embedded training images, each component scaled to unit variance on
them; the training set is the first ``n_per_class`` digits of every class (500 at the default), the test
set the 1,000 embedded test digits and the out-of-distribution set as many FashionMNIST test images
through the same projection. The networks are :class:`symlib.models.MLPClassifier` ``(n_components,
*hidden, 10)``; the Bayesian model is

.. math:: p(\theta \mid D) \propto \prod_{n=1}^N \mathrm{softmax}(f_\theta(x_n))_{y_n} \;
          \mathcal N(\theta; 0, \sigma_p^2 I),

temperature 1, every weight and bias with the prior :math:`\mathcal N(0, \sigma_p^2)`. The posterior
methods of :mod:`symlib.posteriors` get the same prior through their recipe's weight decay,
:math:`wd = 1 / (N \sigma_p^2)` (:attr:`symlib.posteriors.base.Setup.prior_precision` is then
:math:`1 / \sigma_p^2`).

* :func:`load` gives the data (:class:`Data`), :func:`setup` the training problem of a hidden layout
  (architecture ``"mlp-classifier"``, stacked), :func:`likelihood` the full-batch negative log-likelihood
  of stacked flat weights for the samplers of :mod:`symlib.posteriors.hmc`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence

import torch

from symlib import models
from symlib import scales as _scales
from symlib.params import flatten, unflatten
from symlib.posteriors.base import Setup
from symlib.training import mlp as _mlp
from symlib.training.recipe import Recipe

__all__ = ["PROBLEM", "Data", "Problem", "likelihood", "load", "n_params", "setup", "widths"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """The data and the prior.

    Attributes:
        n_components: principal components kept (the inputs' dimension).
        n_per_class: training digits per class (the first ones of each class).
        n_test: test digits (the first ones); n_ood: FashionMNIST test images.
        prior_sd: :math:`\\sigma_p` of the Gaussian prior of every weight and bias.
        recipe: the SGD recipe of the trained networks (weight decay set from the prior by :func:`setup`).
    """

    n_components: int = 4
    n_per_class: int = 50
    n_test: int = 1000
    n_ood: int = 1000
    prior_sd: float = 1.0
    recipe: Recipe = Recipe(epochs=100, batch_size=50, lr=0.05, momentum=0.9, milestones=(50, 75), gamma=0.2)

    @property
    def n_train(self) -> int:
        return 10 * self.n_per_class


PROBLEM = Problem()
"""The chapter's problem: 4 components, 500 training digits, prior :math:`\\mathcal N(0, 1)`."""


@dataclasses.dataclass(frozen=True, eq=False)
class Data:
    """The projected digits: ``x (N, d)``, ``y (N,)`` for training, the test set and the OOD inputs
    (float64), the projection (``mean (784,)``, ``basis (d, 784)``, ``scale (d,)``), the share of the
    training images' variance the components hold, and a fingerprint of all of it."""

    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_ood: torch.Tensor
    mean: torch.Tensor
    basis: torch.Tensor
    scale: torch.Tensor
    explained: float
    fingerprint: str

    def project(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``(N, 1, 28, 28)`` (normalised like MNIST) to the standardised components ``(N, d)``."""
        flat = images.reshape(images.shape[0], -1).to(torch.float64)
        return (flat - self.mean) @ self.basis.T / self.scale


@functools.lru_cache(maxsize=4)
def load(problem: Problem = PROBLEM) -> Data:
    """The projected embedded digits of ``problem`` (computed once per process; no download)."""
    from symlib import data

    _scales.check_int("n_components", problem.n_components, 1)
    _scales.check_int("n_per_class", problem.n_per_class, 1)
    train, test = data.load("mnist", "train"), data.load("mnist", "test")
    ood = data.load_ood("mnist", "test")
    flat = train.x.reshape(train.x.shape[0], -1).to(torch.float64)
    mean = flat.mean(0)
    _, s, v = torch.linalg.svd(flat - mean, full_matrices=False)
    basis = v[: problem.n_components]
    # a fixed sign per component (the largest entry positive), so the inputs do not depend on the SVD
    basis = basis * torch.sign(basis.gather(1, basis.abs().argmax(1, keepdim=True)))
    z = (flat - mean) @ basis.T
    scale = z.std(0)
    idx = torch.cat([torch.nonzero(train.y == c).flatten()[: problem.n_per_class] for c in range(10)])
    if len(idx) != problem.n_train:
        raise ValueError(f"n_per_class={problem.n_per_class} exceeds the digits of a class (400 embedded)")
    if problem.n_test > test.x.shape[0] or problem.n_ood > ood.x.shape[0]:
        raise ValueError(f"n_test and n_ood are at most {test.x.shape[0]} and {ood.x.shape[0]}")
    proj = Data(
        x=(z / scale)[idx], y=train.y[idx].clone(),
        x_test=torch.empty(0), y_test=test.y[: problem.n_test].clone(), x_ood=torch.empty(0),
        mean=mean, basis=basis, scale=scale,
        explained=float((s[: problem.n_components] ** 2).sum() / (s**2).sum()), fingerprint="",
    )
    x_test = proj.project(test.x[: problem.n_test])
    x_ood = proj.project(ood.x[: problem.n_ood])
    h = hashlib.sha256(json.dumps(dataclasses.asdict(problem), sort_keys=True, default=str).encode())
    for t in (train.fingerprint, test.fingerprint, ood.fingerprint):
        h.update(t.encode())
    return dataclasses.replace(proj, x_test=x_test, x_ood=x_ood, fingerprint=h.hexdigest()[:16])


def widths(hidden: Sequence[int], problem: Problem = PROBLEM) -> tuple[int, ...]:
    """The layer widths of an MLP with hidden layers ``hidden``: ``(inputs, *hidden, 10)``."""
    hidden = tuple(int(h) for h in hidden)
    if any(h < 1 for h in hidden):
        raise ValueError(f"hidden widths must be positive, got {list(hidden)}")
    return (problem.n_components, *hidden, 10)


def n_params(hidden: Sequence[int], problem: Problem = PROBLEM) -> int:
    """The number of weights and biases of the MLP with hidden layers ``hidden``."""
    w = widths(hidden, problem)
    return sum((a + 1) * b for a, b in zip(w[:-1], w[1:], strict=False))


def setup(hidden: Sequence[int], scale: str = "cpu", device: str | torch.device = "cpu",
          problem: Problem = PROBLEM, dtype: torch.dtype = torch.float32) -> Setup:
    """The training problem of the MLP with hidden layers ``hidden`` for :mod:`symlib.posteriors`:
    architecture ``"mlp-classifier"`` (stacked), the training digits on ``device`` in ``dtype``, the
    problem's recipe with weight decay :math:`1 / (N \\sigma_p^2)` (the prior), no augmentation; at the
    ``tiny`` scale a tenth of its epochs."""
    _scales.check_scale(scale)
    d = load(problem)
    w = widths(hidden, problem)
    rec = dataclasses.replace(problem.recipe, weight_decay=1.0 / (problem.n_train * problem.prior_sd**2),
                              crop_padding=0, flip=False)
    if scale == "tiny":  # a smoke test: a tenth of the epochs
        rec = rec.scaled(max(1, rec.epochs // 10))
    return Setup(
        arch="mlp-classifier",
        make_model=functools.partial(models.MLPClassifier, w),
        x=d.x.to(device, dtype),
        y=d.y.to(device),
        recipe=rec,
        num_classes=10,
        name="pca-digits-" + "-".join(str(v) for v in w),
        scale=scale,
        data_info={"fingerprint": d.fingerprint, "widths": list(w), "problem": dataclasses.asdict(problem)},
    )


def likelihood(hidden: Sequence[int], problem: Problem = PROBLEM, x: torch.Tensor | None = None,
               y: torch.Tensor | None = None):
    r"""The full-batch negative log-likelihood of stacked flat weights ``(R, D)`` (the order of
    :func:`symlib.training.mlp.shapes`): ``flat -> (L (R,), grad L (R, D))``, :math:`L = \sum_n
    -\log \mathrm{softmax}(f_\theta(x_n))_{y_n}` in float64 (default data: the training digits).
    Returns ``(likelihood, shapes)``."""
    d = load(problem)
    x = d.x if x is None else x.to(torch.float64)
    y = d.y if y is None else y
    shapes = _mlp.shapes(widths(hidden, problem))
    names, n = list(shapes), x.shape[0]

    def nll(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, g = _mlp.mlp_loss_grads(unflatten(flat, shapes), x, y)
        return n * loss, n * flatten(g, names)

    return nll, shapes
