"""The figures of the paper's first chapters (gentle example, min-mass): computed arrays in, a matplotlib
figure out. Functions never compute results themselves; they only draw what the chapter computed."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns

from symlib.plotting import style as _style  # noqa: F401  (sets the book's style)


def toy_data(x: np.ndarray, y: np.ndarray):
    """The two training classes of the gentle example (paper Figure 5)."""
    fig, ax = plt.subplots(figsize=(4.2, 4))
    for c, marker in ((0, "o"), (1, "s")):
        ax.scatter(*x[y == c].T, s=12, marker=marker, alpha=0.7, label=f"class {c}")
    ax.set(xlabel="$x_1$", ylabel="$x_2$", aspect="equal")
    ax.legend(loc="upper left")
    return fig


def figure1(panels: dict[str, np.ndarray], half_widths: Sequence[float], gridsize: int = 100):
    r"""Paper Figure 1: densities of the output weights ``(w_1, w_2)``, one panel per stage.

    Args:
        panels: title -> points ``(n, 2)``.
        half_widths: panel ``i`` shows ``[-h_i, h_i]^2`` (e.g. the window of
            :func:`symlib.paper.toy.density_summary`); points outside are left out of
            its density estimate (the caption should say how many).
        gridsize: KDE evaluation grid per axis.
    """
    fig, axs = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (title, w), h in zip(axs[0], panels.items(), half_widths, strict=True):
        inside = w[(np.abs(w) <= h).all(axis=1)]
        sns.kdeplot(x=inside[:, 0], y=inside[:, 1], fill=True, levels=12, thresh=0.02, cmap="mako_r",
                    gridsize=gridsize, clip=((-h, h),) * 2, ax=ax)
        ax.plot([-h, h], [-h, h], ls=":", lw=1, color="0.4")
        ax.set(xlim=(-h, h), ylim=(-h, h), aspect="equal",
               xlabel="$w_1$ (output weight of hidden neuron 1)", ylabel="$w_2$", title=title)
    fig.tight_layout()
    return fig


def figure2(mass_before: np.ndarray, mass_after: np.ndarray, max_before: dict[str, np.ndarray],
            max_after: dict[str, np.ndarray], sizes: dict[str, int], ts: np.ndarray, path: np.ndarray,
            n_paths: int = 20):
    r"""Paper Figure 2: min-mass on a zoo (book: chapter "Min-mass").

    Args:
        mass_before, mass_after: mass of every network, trained and at its optimum.
        max_before, max_after: layer -> largest absolute weight of every network.
        sizes: layer -> number of weights.
        ts: positions ``t`` on the segment ``lambda^{*t}`` (0: trained, 1: optimum).
        path: ``(len(ts), networks)`` mass along the segment over the trained mass.
        n_paths: how many networks panel (c) draws.
    """
    layers = list(max_before)
    fig, axs = plt.subplots(1, 3, figsize=(13, 3.6))
    lo, hi = min(mass_before.min(), mass_after.min()), max(mass_before.max(), mass_after.max())
    bins = np.linspace(lo, hi, 30)
    axs[0].hist(mass_before, bins=bins, alpha=0.6, label="trained")
    axs[0].hist(mass_after, bins=bins, alpha=0.6, label="min-mass")
    axs[0].set(xlabel=r"mass $M$", ylabel="networks", title="(a) mass")
    axs[0].legend()
    pos = np.arange(len(layers))
    for shift, values, color in ((-0.18, max_before, "C0"), (0.18, max_after, "C1")):
        axs[1].boxplot([values[k] for k in layers], positions=pos + shift, widths=0.3,
                       patch_artist=True, boxprops={"facecolor": color, "alpha": 0.6})
    axs[1].set_xticks(pos, [f"{k.split('.')[0]}\n{sizes[k]}" for k in layers])
    axs[1].set(xlabel="layer, number of weights", ylabel=r"$\max_i |w_i|$",
               title="(b) largest weight per layer")
    for i in range(min(n_paths, path.shape[1])):
        axs[2].plot(ts, path[:, i], color="C0", alpha=0.4, lw=1)
    axs[2].axvline(1.0, color="C1", ls="--", lw=1)
    axs[2].set(xlabel=r"$t$ (scales $\lambda^{*t}$)", ylabel=r"$M / M(\theta)$",
               title="(c) mass along the orbit")
    fig.tight_layout()
    return fig


def imbalance_scatter(at_init: dict[str, np.ndarray], trained: dict[str, np.ndarray]):
    """Incoming minus outgoing mass of every hidden neuron, at initialisation vs after training
    (book: chapter "Min-mass"; zero for every neuron at the min-mass optimum)."""
    fig, ax = plt.subplots(figsize=(4.2, 3.6))
    for k in at_init:
        ax.scatter(at_init[k], trained[k], s=6, alpha=0.5, label=k)
    ax.axhline(0, color="gray", lw=1, ls="--")
    ax.legend(title="layer", markerscale=2)
    ax.set(xlabel=r"$a_i - b_i$ at initialisation", ylabel=r"$a_i - b_i$ after training",
           title="(d) imbalance of each neuron")
    return fig
