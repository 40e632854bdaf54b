r"""The gentle example: thousands of small perceptrons at once (book: chapter "A gentle example";
paper §3.1, App. A).

* :func:`two_gaussians` draws the paper's two linearly separable 2-D classes.
* :func:`train_mlps` trains many MLPs at once (ReLU, or tanh for the chapter's exercises): parameters
  are stacked along a leading model axis and every step is a handful of batched matrix products,
  each model with its own initialisation and its own shuffling of the data.
* :func:`train_mlp_loop` is the reference: one ``nn.Module`` after another with
  ``torch.optim.SGD``, as the authors' released notebook does. Given the same
  initialisation and batch order, both give the same weights (tested).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linprog

from symlib.models import MLP
from symlib.progress import bar as progress_bar
from symlib.symmetry.spec import Params


@dataclasses.dataclass(frozen=True)
class ToyData:
    """Two-class 2-D data: ``x (N, 2)``, ``y (N,)`` in {0, 1}, and how it was drawn."""

    x: torch.Tensor
    y: torch.Tensor
    means: tuple[tuple[float, float], tuple[float, float]]
    seed: int
    draws: int  # how many draws it took to get a separable sample


def is_linearly_separable(x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor) -> bool:
    """Whether a hyperplane separates the two classes strictly (an LP feasibility problem).

    Finds ``w, b`` with ``s_i (w . x_i + b) >= 1`` where ``s_i = +-1``.
    """
    x = np.asarray(x, dtype=np.float64)
    s = np.where(np.asarray(y) > 0, 1.0, -1.0)
    a_ub = -s[:, None] * np.hstack([x, np.ones((len(x), 1))])
    res = linprog(np.zeros(x.shape[1] + 1), A_ub=a_ub, b_ub=-np.ones(len(x)), bounds=(None, None),
                  method="highs")
    return res.status == 0


def two_gaussians(
    n_per_class: int = 200,
    means: tuple[tuple[float, float], tuple[float, float]] = ((-2.0, -2.0), (2.0, 2.0)),
    seed: int = 0,
    max_draws: int = 100,
    separable: bool = True,
) -> ToyData:
    """Two Gaussian classes with identity covariance, redrawn until linearly separable (paper App. A).

    Args:
        n_per_class: points per class (the paper: 200).
        means: class means (the authors' data: close to (-2, -2) and (2, 2)).
        seed: random seed of the first draw; later draws continue the same stream.
        max_draws: give up after this many non-separable draws.
        separable: redraw until a line separates the classes (the paper's setting); ``False`` keeps
            the first draw, overlapping classes included (the chapter's exercise on overlap).
    """
    if n_per_class < 1:
        raise ValueError(f"n_per_class must be positive, got {n_per_class}")
    rng = np.random.default_rng(seed)
    m = np.asarray(means, dtype=np.float64)
    y = np.repeat([0, 1], n_per_class)
    for draw in range(1, max_draws + 1):
        x = m[y] + rng.standard_normal((2 * n_per_class, 2))
        if not separable or is_linearly_separable(x, y):
            return ToyData(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32),
                           tuple(map(tuple, m.tolist())), seed, draw)
    raise ValueError(f"no linearly separable sample in {max_draws} draws: move the means {means} apart")


# ---------------------------------------------------------------------------- training
def init_mlps(widths: Sequence[int], n_models: int, generator: torch.Generator | None = None,
              dtype=torch.float32) -> Params:
    """PyTorch's default ``nn.Linear`` initialisation, drawn independently for each of ``n_models``.

    Weights and biases are ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``; keys match
    :class:`symlib.models.MLP` (``"0.weight"``, ``"0.bias"``, ``"2.weight"``, ...).
    """
    theta = {}
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=False)):
        bound = 1.0 / math.sqrt(a)
        w = torch.rand(n_models, b, a, generator=generator, dtype=torch.float64)
        bias = torch.rand(n_models, b, generator=generator, dtype=torch.float64)
        theta[f"{2 * i}.weight"] = ((2 * w - 1) * bound).to(dtype)
        theta[f"{2 * i}.bias"] = ((2 * bias - 1) * bound).to(dtype)
    return theta


def batch_orders(n_models: int, n_data: int, epochs: int, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
    """An independent random order of the data for every model and epoch: ``(epochs, n_models, n_data)``."""
    return torch.rand(epochs, n_models, n_data, generator=generator).argsort(dim=-1)


def _to_models_last(theta: Params, lo: int = 0, hi: int | None = None, device=None
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of stacked MLP parameters ``[lo:hi]`` laid out models-last (see :func:`_sgd_step`)."""
    n_layers = len(theta) // 2
    dense = torch.contiguous_format  # clone() always copies: contiguous() may return a view
    ws = [theta[f"{2 * i}.weight"][lo:hi].to(device).permute(1, 2, 0).clone(memory_format=dense)
          for i in range(n_layers)]
    bs = [theta[f"{2 * i}.bias"][lo:hi].to(device).t().clone(memory_format=dense) for i in range(n_layers)]
    return ws, bs


def _from_models_last(ws: list[torch.Tensor], bs: list[torch.Tensor]) -> Params:
    theta = {}
    for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
        theta[f"{2 * i}.weight"] = w.permute(2, 0, 1).contiguous()
        theta[f"{2 * i}.bias"] = b.t().contiguous()
    return theta


ACTIVATIONS = ("relu", "tanh")
"""Hidden activations :func:`train_mlps` supports (names of :class:`symlib.models.MLP`)."""


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _forward(ws: list[torch.Tensor], bs: list[torch.Tensor], x: torch.Tensor, activation: str = "relu"
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Models-last forward: inputs ``x (d, B, M)``; returns the activations (input first) and the
    pre-activations ``z_l (out, B, M)`` of every layer."""
    act = torch.relu if activation == "relu" else torch.tanh
    acts, zs = [x], []
    for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
        z = (w.unsqueeze(2) * acts[-1].unsqueeze(0)).sum(1) + b.unsqueeze(1)
        zs.append(z)
        if i < len(ws) - 1:
            acts.append(act(z))
    return acts, zs


def mean_losses(theta: Params, x: torch.Tensor, y: torch.Tensor, activation: str = "relu") -> torch.Tensor:
    """Mean binary cross-entropy of every stacked model on the whole set: ``(M,)``."""
    _check_activation(activation)
    return _mean_losses(*_to_models_last(theta, device=x.device), x, y, activation)


def _mean_losses(ws: list[torch.Tensor], bs: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                 activation: str = "relu") -> torch.Tensor:
    m = ws[0].shape[-1]
    logits = _forward(ws, bs, x.t().unsqueeze(-1).expand(-1, -1, m), activation)[1][-1][0]  # (N, M)
    return F.binary_cross_entropy_with_logits(logits, y.unsqueeze(-1).expand(-1, m), reduction="none").mean(0)


def _sgd_step(ws: list[torch.Tensor], bs: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float,
              activation: str = "relu") -> None:
    r"""One SGD step on the mean BCE of every model, in place, models on the last axis.

    Layout: activations ``(features, batch, M)``, weights ``(out, in, M)``, biases
    ``(out, M)``: every operation is element-wise over a contiguous model axis,
    which vectorises far better than ``M`` tiny matrix products. The backward
    pass is written out: with ``z_l = W_l a_{l-1} + b_l``,
    ``dL/dz_L = (sigmoid(z_L) - y) / B``, ``dL/dW_l = dz_l a_{l-1}^T``,
    ``dL/da_{l-1} = W_l^T dz_l`` and ``dz_{l-1} = dL/da_{l-1} * 1[z_{l-1} > 0]`` (ReLU) or
    ``* (1 - a_{l-1}^2)`` (tanh).
    """
    acts, zs = _forward(ws, bs, x, activation)
    dz = (torch.sigmoid(zs[-1]) - y) / x.shape[1]
    for i in range(len(ws) - 1, -1, -1):
        gw = (dz.unsqueeze(1) * acts[i].unsqueeze(0)).sum(2)
        gb = dz.sum(1)
        if i:
            da = (ws[i].unsqueeze(2) * dz.unsqueeze(1)).sum(0)
            dz = da * (zs[i - 1] > 0) if activation == "relu" else da * (1 - acts[i].square())
        ws[i].sub_(lr * gw)
        bs[i].sub_(lr * gb)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    theta: Params         # stacked parameters (M, ...)
    losses: torch.Tensor  # final mean training loss per model (M,)
    seconds: float


def train_mlps(
    data: ToyData,
    n_models: int,
    widths: Sequence[int] = (2, 2, 1),
    epochs: int = 10,
    batch_size: int = 10,
    lr: float = 2.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
    init: Params | None = None,
    orders: torch.Tensor | None = None,
    chunk: int = 100_000,
    progress: bool = True,
    activation: str = "relu",
) -> TrainResult:
    """Train ``n_models`` binary-classification MLPs at once with plain SGD (paper App. A).

    Each model has its own initialisation and its own shuffling of the data
    every epoch; the loss is the mean BCE with logits over each minibatch.

    Args:
        data: the training set.
        n_models: number of independent networks.
        widths: layer widths, input first (the paper: 2-2-1).
        epochs, batch_size, lr: SGD settings (the paper: 10, 10, 2).
        seed: seeds the initialisations and the data orders.
        device: where to train.
        init: optional stacked initial parameters (default: :func:`init_mlps`).
        orders: optional data orders ``(epochs, n_models, N)`` (default: :func:`batch_orders`).
        chunk: models trained together at most (memory bound).
        progress: show a progress bar over the steps.
        activation: hidden activation, ``"relu"`` (the paper) or ``"tanh"`` (a network with sign-flip
            instead of scaling symmetries; the chapter's exercises).
    """
    _check_activation(activation)
    if widths[-1] != 1:
        raise ValueError(f"binary classification needs one output unit, got widths {list(widths)}")
    if widths[0] != data.x.shape[1]:
        raise ValueError(f"widths[0]={widths[0]} but the data has {data.x.shape[1]} features")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    n = len(data.x)
    if init is None:
        init = init_mlps(widths, n_models, gen)
    if orders is None:
        orders = batch_orders(n_models, n, epochs, gen)
    x, y = data.x.to(device), data.y.to(device)
    steps = math.ceil(n / batch_size)
    start = time.perf_counter()
    out, losses = [], []
    bar = progress_bar(epochs * steps * math.ceil(n_models / chunk), "SGD steps", enabled=progress)
    for lo in range(0, n_models, chunk):
        hi = min(lo + chunk, n_models)
        ws, bs = _to_models_last(init, lo, hi, device)  # transposed back at the end
        order = orders[:, lo:hi].to(device)
        xt = x.t()
        for epoch in range(epochs):
            for s in range(steps):
                idx = order[epoch, :, s * batch_size:(s + 1) * batch_size].t()  # (B, M)
                _sgd_step(ws, bs, xt[:, idx], y[idx].unsqueeze(0), lr, activation)
                bar.update()
        losses.append(_mean_losses(ws, bs, x, y, activation))
        out.append(_from_models_last(ws, bs))
    bar.close()
    theta = {k: torch.cat([o[k] for o in out]).cpu() for k in init}
    return TrainResult(theta, torch.cat(losses).cpu(), time.perf_counter() - start)


def train_mlp_loop(
    data: ToyData,
    widths: Sequence[int] = (2, 2, 1),
    epochs: int = 10,
    batch_size: int = 10,
    lr: float = 2.0,
    init: Params | None = None,
    order: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    activation: str = "relu",
) -> tuple[Params, float]:
    """The reference: train one ``nn.Module`` with ``torch.optim.SGD`` in a Python loop.

    Args:
        init: one model's initial parameters (default: PyTorch's own init).
        order: that model's data orders ``(epochs, N)`` (default: a fresh shuffle per epoch).
        activation: hidden activation of the :class:`symlib.models.MLP`.

    Returns:
        The trained ``state_dict`` and its final mean training loss.
    """
    model = MLP(widths, activation=activation)
    if init is not None:
        model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    n = len(data.x)
    for epoch in range(epochs):
        perm = order[epoch] if order is not None else torch.randperm(n, generator=generator)
        for s in range(0, n, batch_size):
            idx = perm[s:s + batch_size]
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(data.x[idx]).squeeze(-1), data.y[idx])
            loss.backward()
            opt.step()
    with torch.no_grad():
        final = F.binary_cross_entropy_with_logits(model(data.x).squeeze(-1), data.y).item()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, final


# ---------------------------------------------------------------------------- Figure 1 statistics
@dataclasses.dataclass(frozen=True)
class DensitySummary:
    """What a 2-D weight density shows, in numbers (book: chapter "A gentle example").

    Attributes:
        half_width: the display window ``[-h, h]^2`` (holds ``coverage`` of the points).
        inside: fraction of points inside the window (the KDE uses only those).
        peak: location of the density's highest point.
        mirror_ratio: density at the peak swapped, ``(w_2, w_1)``, over the peak density:
            about 1 when the permutation duplicates the mode, about 0 when it does not.
        flip_ratio: density at the peak with the sign of its first coordinate flipped,
            ``(-w_1, w_2)``, over the peak density: about 1 when flipping the sign of a hidden
            neuron is a symmetry too (an odd activation such as tanh), not for ReLU.
        peakedness: peak density times the window's area, i.e. the peak over a uniform
            spread on the window; scale-free, so comparable between panels.
        above_diagonal: fraction of points with ``w_1 > w_2``.
    """

    half_width: float
    inside: float
    peak: tuple[float, float]
    mirror_ratio: float
    peakedness: float
    flip_ratio: float
    above_diagonal: float


def density_summary(w: np.ndarray, coverage: float = 0.98, grid: int = 121) -> DensitySummary:
    """Summarise the density of points ``w (n, 2)`` with a Gaussian KDE on its own window."""
    from scipy.stats import gaussian_kde

    w = np.asarray(w, dtype=np.float64)
    h = float(np.quantile(np.abs(w).max(axis=1), coverage))
    mask = (np.abs(w) <= h).all(axis=1)
    kde = gaussian_kde(w[mask].T)
    pts = np.mgrid[-h:h:grid * 1j, -h:h:grid * 1j].reshape(2, -1)
    dens = kde(pts)
    peak = pts[:, dens.argmax()]
    return DensitySummary(
        half_width=h,
        inside=float(mask.mean()),
        peak=(float(peak[0]), float(peak[1])),
        mirror_ratio=float(kde(peak[::-1, None])[0] / dens.max()),
        peakedness=float(dens.max() * (2 * h) ** 2),
        flip_ratio=float(kde(np.array([[-peak[0]], [peak[1]]]))[0] / dens.max()),
        above_diagonal=float((w[:, 0] > w[:, 1]).mean()),
    )
