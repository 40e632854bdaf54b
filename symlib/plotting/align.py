"""Figures of the chapter "Aligning variational posteriors" (Rossi, Singh & Hannagan 2023): computed arrays
in, a matplotlib figure out (the book's style comes from :mod:`symlib.plotting`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from symlib.plotting import style as _style  # also sets the book's plotting style

LABELS = {"none": "unaligned", "weights": "weight matching (means)", "kl-mean": "KL, means only (App. Eq. 2)",
          "kl": "KL, exact", "wasserstein": "Wasserstein"}


def barrier_paths(ts: np.ndarray, nll: Mapping[str, np.ndarray], acc: Mapping[str, np.ndarray]):
    r"""Test loss and accuracy of the marginalised predictive along the interpolation paths.

    Args:
        ts: positions ``(T,)``.
        nll, acc: per alignment method, ``(pairs, T)`` arrays; the mean over pairs is drawn as a line
            and the range over pairs as a band.
    """
    fig, axs = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in nll:
        for ax, values, scale in ((axs[0], nll[name], 1.0), (axs[1], acc[name], 100.0)):
            v = scale * np.asarray(values)
            line, = ax.plot(ts, v.mean(0), marker="o", ms=3, label=LABELS.get(name, name))
            if v.shape[0] > 1:
                ax.fill_between(ts, v.min(0), v.max(0), color=line.get_color(), alpha=0.15, lw=0)
    axs[0].set(xlabel="$t$ (from $q_0$ to $q_1$)", ylabel="test NLL of $\\hat p_t$ (nats)",
               title="loss of the marginalised predictive")
    axs[1].set(xlabel="$t$ (from $q_0$ to $q_1$)", ylabel="test accuracy (%)", title="accuracy")
    axs[0].legend(fontsize="small")
    fig.tight_layout()
    return fig


def timings(widths: Sequence[int], seconds: Mapping[str, Sequence[float]],
            extra: Mapping[str, tuple[int, float]] | None = None):
    """Appendix Fig. A2: alignment time against network width, one line per problem.

    Args:
        widths: hidden widths.
        seconds: label -> wall-clock seconds per width.
        extra: label -> ``(width, seconds)`` single points to mark (e.g. the trained posteriors).
    """
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    for label, s in seconds.items():
        ax.plot(widths, s, marker="o", label=label)
    for label, (w, s) in (extra or {}).items():
        ax.plot([w], [s], marker="*", ms=12, ls="none", label=label)
    ax.set(xscale="log", yscale="log", xlabel="hidden width $n$", ylabel="seconds")
    ax.set_xticks(list(widths), [str(w) for w in widths])
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def mmd_removals(values: Mapping[str, Mapping[str, float]], p_values: Mapping[str, Mapping[str, float]]):
    """MMD between one half of a zoo and other sets, under each symmetry removal (grouped bars).

    Args:
        values: comparison -> removal -> MMD (x 100, the paper's unit).
        p_values: the same layout, permutation-test p-values (printed above the bars).
    """
    comps = list(values)
    removals = list(next(iter(values.values())))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    bars = _style.grouped_bars(ax, comps, removals, lambda r, c: values[c][r])
    for r, group in bars.items():
        for b, c in zip(group, comps, strict=True):
            ax.annotate(f"{p_values[c][r]:.2f}", (b.get_x() + b.get_width() / 2, max(b.get_height(), 0)),
                        ha="center", va="bottom", fontsize=7)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(ylabel="MMD (x 100)")
    ax.legend(title="symmetry removal", fontsize="small", ncol=len(removals))
    fig.tight_layout()
    return fig
