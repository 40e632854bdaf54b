"""One function per paper figure: computed arrays in, a matplotlib figure out (book: every chapter).

Import this module once to set the book's plotting style. Functions never
compute results themselves; they only draw what the chapter computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns

sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
plt.rcParams.update({"figure.dpi": 110, "savefig.bbox": "tight", "axes.titlesize": "medium"})


def glue_figure(name: str, fig) -> None:
    """Glue ``fig`` under ``name`` for the book (myst-nb) and close it, so it is shown only where glued."""
    from myst_nb import glue

    glue(name, fig, display=False)
    plt.close(fig)


def window(points: Sequence[np.ndarray], coverage: float = 0.98) -> float:
    """Half-width of a square window centred on 0 holding ``coverage`` of the points of every set."""
    return float(max(np.quantile(np.abs(p).max(axis=1), coverage) for p in points))


def toy_data(x: np.ndarray, y: np.ndarray):
    """The two training classes of the gentle example (paper Figure 5)."""
    fig, ax = plt.subplots(figsize=(4.2, 4))
    for c, marker in ((0, "o"), (1, "s")):
        ax.scatter(*x[y == c].T, s=12, marker=marker, alpha=0.7, label=f"class {c}")
    ax.set(xlabel="$x_1$", ylabel="$x_2$", aspect="equal")
    ax.legend(loc="upper left")
    return fig


def figure1(panels: dict[str, np.ndarray], half_width: float, gridsize: int = 100):
    r"""Paper Figure 1: densities of the output weights ``(w_1, w_2)``, one panel per stage.

    Args:
        panels: title -> points ``(n, 2)``.
        half_width: every panel shows ``[-h, h]^2``; points outside are left out
            of the density estimate (the caption should say how many).
        gridsize: KDE evaluation grid per axis.
    """
    fig, axs = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (title, w) in zip(axs[0], panels.items()):
        inside = w[(np.abs(w) <= half_width).all(axis=1)]
        sns.kdeplot(x=inside[:, 0], y=inside[:, 1], fill=True, levels=12, thresh=0.02, cmap="mako_r",
                    gridsize=gridsize, clip=((-half_width, half_width),) * 2, ax=ax)
        ax.plot([-half_width, half_width], [-half_width, half_width], ls=":", lw=1, color="0.4")
        ax.set(xlim=(-half_width, half_width), ylim=(-half_width, half_width), aspect="equal",
               xlabel="$w_1$ (output weight of hidden neuron 1)", ylabel="$w_2$", title=title)
    fig.tight_layout()
    return fig
