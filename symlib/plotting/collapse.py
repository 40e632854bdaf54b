"""Figures of the chapters on functional collapse, permutations during training and the posterior's
marginals (paper Fig. 3, 4, 7, 8, 9; App. D.1): computed arrays in, a matplotlib figure out.

Importing this module imports :mod:`symlib.plotting`, which sets the book's style.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from symlib.plotting import style as _style  # also sets the book's plotting style


def mutual_information(mi_id: np.ndarray, mi_ood: np.ndarray, r: float, p: float,
                       ci: tuple[float, float], labels: tuple[str, str] = ("ID", "OOD"),
                       threshold: float | None = None, bins: int = 40):
    r"""Paper Figures 3, 7 and 8: pairwise mutual information of two-member ensembles.

    Args:
        mi_id, mi_ood: ``(P,)`` mean MI over the test set of every pair of checkpoints, in nats, on
            in-distribution and out-of-distribution data.
        r, p, ci: Pearson's correlation between the two, its p-value and confidence interval.
        labels: names of the two datasets.
        threshold: optional ID MI below which a pair counts as functionally collapsed (drawn).
    """
    fig, axs = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, v, name, color in ((axs[0], mi_id, labels[0], "C0"), (axs[1], mi_ood, labels[1], "C1")):
        ax.hist(v, bins=bins, color=color, alpha=0.8)
        ax.axvline(np.median(v), color="k", lw=1, ls="--", label="median")
        ax.set(xlabel=f"MI on {name} (nats)", ylabel="pairs", title=f"({'ab'[ax is axs[1]]}) {name}")
    if threshold is not None:
        axs[0].axvline(threshold, color="C3", lw=1.5, label="collapse threshold")
        axs[2].axvline(threshold, color="C3", lw=1.5)
    axs[0].legend(fontsize="small")
    axs[2].scatter(mi_id, mi_ood, s=3, alpha=0.3, color="C2", rasterized=True)
    axs[2].set(xlabel=f"MI on {labels[0]} (nats)", ylabel=f"MI on {labels[1]} (nats)",
               title=f"(c) Pearson r = {r:.2f} [{ci[0]:.2f}, {ci[1]:.2f}], p = {p:.1e}")
    fig.tight_layout()
    return fig


def mi_vs_distance(mi_id: np.ndarray, dist_raw: np.ndarray, dist_canon: np.ndarray,
                   threshold: float | None = None):
    """Weight-space distance of every pair of checkpoints against their ID mutual information,
    raw and after symmetry removal (book: chapter "Functional collapse")."""
    fig, axs = plt.subplots(1, 2, figsize=(9, 3.6), sharex=True)
    for ax, d, title in ((axs[0], dist_raw, "(a) raw weights"), (axs[1], dist_canon, "(b) canonical forms")):
        ax.scatter(mi_id, d, s=3, alpha=0.3, rasterized=True)
        if threshold is not None:
            ax.axvline(threshold, color="C3", lw=1.5)
        ax.set(xlabel="MI on ID data (nats)", ylabel=r"$\|\theta_i - \theta_j\|_2$", title=title)
    fig.tight_layout()
    return fig


def kendall_tau(steps: np.ndarray, taus: Mapping[str, np.ndarray], lr: np.ndarray,
                epoch_steps: int | None = None, smooth: int = 1, milestones: Sequence[int] = (),
                title: str | None = None):
    r"""Paper Figure 4: Kendall's :math:`\tau` between successive sorting permutations against the
    step, averaged over layers and runs, with the learning rate on a twin axis.

    Args:
        steps: ``(S,)`` step indices.
        taus: sorting key -> ``(S,)`` mean tau.
        lr: ``(S,)`` learning rate of each step.
        epoch_steps: steps per epoch, to label the top axis in epochs.
        smooth: running-mean window for display (1: raw curve).
        milestones: steps at which the learning rate decays, marked by vertical lines (paper Fig. 4
            right: epochs 25 and 50 of the ResNet-18 recipe; :func:`symlib.paper.permfreq.milestone_steps`).
        title: optional axes title.
    """
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for i, (key, t) in enumerate(taus.items()):
        t = np.asarray(t, dtype=np.float64)
        if smooth > 1:
            t = np.convolve(t, np.ones(smooth) / smooth, mode="same")
        ax.plot(steps, t, lw=1, color=f"C{i}", label=f"key: {key}")
    ax.set(xlabel="training step", ylabel=r"Kendall's $\tau$ (successive steps)")
    for i, m in enumerate(milestones):
        ax.axvline(m, color="C3", ls=":", lw=1.2, label="lr decay" if i == 0 else None)
    if title:
        fig.suptitle(title)
    ax.legend(loc="lower right")
    ax2 = ax.twinx()
    ax2.plot(steps, lr, color="0.3", ls="--", lw=1.2)
    ax2.set_ylabel("learning rate (dashed)")
    ax2.grid(False)
    ax2.set_ylim(0, 1.1 * float(np.nanmax(lr)) if np.isfinite(np.nanmax(lr)) and np.nanmax(lr) > 0 else 1)
    if epoch_steps:
        top = ax.secondary_xaxis("top", functions=(lambda s: s / epoch_steps, lambda e: e * epoch_steps))
        top.set_xlabel("epoch")
    fig.tight_layout()
    return fig


def flip_rates(rates: Mapping[str, Mapping[str, float]]):
    """Share of steps at which a layer's order changed, per sorting key and learning-rate phase.

    Args:
        rates: key -> {phase label: rate}.
    """
    keys = list(rates)
    phases = list(next(iter(rates.values())))
    fig, ax = plt.subplots(figsize=(6, 3.4))
    _style.grouped_bars(ax, phases, keys, lambda k, ph: rates[k][ph])
    ax.set(ylabel="steps with a permutation (share)", xlabel="learning-rate phase")
    ax.legend(title="sorting key")
    fig.tight_layout()
    return fig


def marginals(values: Mapping[str, np.ndarray], pvalues: Mapping[str, np.ndarray], bins: int = 40,
              clip: float = 0.995):
    r"""Paper Figure 9: the marginal of one weight, neuron by neuron, at each stage of symmetry removal,
    with the KS p-values of equal marginals for every pair of neurons.

    Args:
        values: stage -> ``(M, n)`` one weight per neuron and checkpoint.
        pvalues: stage -> ``(n, n)`` p-value matrix (diagonal NaN).
        bins: histogram bins.
        clip: the x range covers this central quantile of each stage's values.
    """
    stages = list(values)
    fig, axs = plt.subplots(len(stages), 2, figsize=(11, 3.1 * len(stages)),
                            gridspec_kw={"width_ratios": [2.2, 1]}, squeeze=False)
    for row, stage in enumerate(stages):
        v = np.asarray(values[stage])
        lo, hi = np.quantile(v, [(1 - clip) / 2, (1 + clip) / 2])
        edges = np.linspace(lo, hi, bins + 1)
        centres = (edges[:-1] + edges[1:]) / 2
        colors = plt.cm.viridis(np.linspace(0, 1, v.shape[1]))
        for i in range(v.shape[1]):
            h, _ = np.histogram(v[:, i], bins=edges, density=True)
            axs[row, 0].plot(centres, h, color=colors[i], lw=1, alpha=0.8)
        axs[row, 0].set(xlabel="weight value", ylabel="density", title=f"{stage}: one curve per neuron")
        pv = np.asarray(pvalues[stage])
        im = axs[row, 1].imshow(np.log10(np.clip(pv, 1e-12, 1)), vmin=-12, vmax=0, cmap="magma")
        ticks = np.arange(0, pv.shape[0], max(1, pv.shape[0] // 4))
        axs[row, 1].set(xlabel="neuron", ylabel="neuron", title=r"KS $\log_{10} p$",
                        xticks=ticks, yticks=ticks)
        axs[row, 1].grid(False)
        fig.colorbar(im, ax=axs[row, 1], fraction=0.046)
    fig.tight_layout()
    return fig


def pca_explained(ratios: Mapping[str, np.ndarray], fractions: Sequence[float] = (0.5, 0.9)):
    """Cumulative explained variance of the checkpoints' principal components (paper App. D.3).

    Args:
        ratios: label -> explained variance ratio of every component (decreasing).
        fractions: horizontal guides.
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, r in ratios.items():
        r = np.asarray(r)
        ax.plot(np.arange(1, len(r) + 1), np.cumsum(r), label=label)
    for f in fractions:
        ax.axhline(f, color="0.5", lw=0.8, ls=":")
    ax.set(xlabel="number of principal components", ylabel="explained variance (cumulative)", ylim=(0, 1.02))
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def meanshift(bandwidths: Mapping[str, np.ndarray], counts: Mapping[str, np.ndarray],
              n_points: Mapping[str, int] | None = None):
    """Number of modes mean shift finds against its bandwidth (paper App. D.1).

    Args:
        bandwidths: sample -> bandwidths, relative to the sample's median pairwise distance.
        counts: sample -> modes found at each bandwidth.
        n_points: sample -> number of points (drawn as a dotted line: every point its own mode).
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for i, (label, h) in enumerate(bandwidths.items()):
        ax.plot(h, counts[label], marker="o", ms=3, color=f"C{i}", label=label)
        if n_points and label in n_points:
            ax.axhline(n_points[label], color=f"C{i}", lw=0.8, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="bandwidth / median pairwise distance",
           ylabel="modes found")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
