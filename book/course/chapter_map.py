"""Draw the course map's diagram: which chapter needs which (book/course/chapter_map.svg).

The figure is drawn offline with matplotlib and committed; no service renders it at build time.
After changing the chapters or their dependencies, redraw it:

    .venv/bin/python book/course/chapter_map.py

``tests/test_book_pages.py`` checks that every chapter of ``_toc.yml`` is in :data:`CHAPTERS` and that
the committed SVG is what this script draws.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SVG = HERE / "chapter_map.svg"

# name: (short title, column, row, chapters whose ideas it builds on). Only direct needs are listed:
# every chapter after "Symmetries of real architectures" also needs "A gentle example" through it.
CHAPTERS: dict[str, tuple[str, int, float, tuple[str, ...]]] = {
    "toy": ("A gentle example", 0, 1.5, ()),
    "architectures": ("Symmetries of\nreal architectures", 1, 1.5, ("toy",)),
    "minmass": ("Min-mass", 2, 0.0, ("architectures",)),
    "marginals": ("The posterior's\nmarginals", 2, 1.0, ("architectures",)),
    "permfreq": ("Permutations\nduring training", 2, 2.0, ("architectures",)),
    "table1": ("Table 1: posterior\napproximations", 2, 3.0, ("architectures",)),
    "collapse": ("Functional\ncollapse", 3, 2.75, ("table1",)),
    "alignment": ("Aligning variational\nposteriors", 3, 3.75, ("table1",)),
    "true_posterior": ("Against the true\nposterior", 3, 4.75, ("table1",)),
    "own_network": ("symlib on your\nown network", 4, 0.0, ("minmass", "alignment")),
    "transformers": ("Transformers: no\nscalings", 5, 2.0, ("collapse", "permfreq", "own_network")),
}
# Every arrow is a straight line from the right edge of a box to the left edge of a box further right; the
# places above keep each line clear of every other box (tests/test_book_pages.py checks the drawn figure).
RC = {"svg.fonttype": "none", "svg.hashsalt": "symlib-course-map", "font.size": 10}
# The chapters that load the cached 1,000-network OptuNet zoo (the first one to run trains it).
ZOO_USERS = ("minmass", "table1", "collapse", "alignment", "transformers")


def draw():
    """The figure (matplotlib), not saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    bottom = max(row for _, _, row, _ in CHAPTERS.values())
    right = max(col for _, col, _, _ in CHAPTERS.values())
    fig, ax = plt.subplots(figsize=(12.0, 1.0 + 0.75 * (bottom + 1)))
    w, h, dx, dy = 1.55, 0.64, 1.95, 1.0
    pos = {name: (col * dx, -row * dy) for name, (_, col, row, _) in CHAPTERS.items()}

    for name, (_, _, _, needs) in CHAPTERS.items():
        for dep in needs:
            (xa, ya), (xb, yb) = pos[dep], pos[name]
            ax.annotate("", xy=(xb - w / 2, yb), xytext=(xa + w / 2, ya),
                        arrowprops=dict(arrowstyle="-|>", color="#4a4a4a", lw=1.1, shrinkA=1, shrinkB=1))
    for name, (title, _, _, _) in CHAPTERS.items():
        x, y = pos[name]
        zoo = name in ZOO_USERS
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                    facecolor="#fff6e0" if zoo else "#eef3fb",
                                    edgecolor="#9a6a00" if zoo else "#2f5597", linewidth=1.3))
        ax.text(x, y, title, ha="center", va="center", linespacing=1.15)
    ax.text(-w / 2, -bottom * dy,
            "arrow: builds on the ideas of the chapter it comes from\n"
            "gold box: loads the cached 1,000-network OptuNet zoo\n(the first of them to run trains it)",
            ha="left", va="center", fontsize=9, color="#4a4a4a", linespacing=1.3)
    ax.set_xlim(-w / 2 - 0.1, right * dx + w / 2 + 0.1)
    ax.set_ylim(-bottom * dy - h / 2 - 0.1, h / 2 + 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout(pad=0.2)
    return fig


def svg_text() -> str:
    """The SVG of :func:`draw`, byte for byte reproducible (no date, fixed ids)."""
    import matplotlib.pyplot as plt

    # matplotlib's defaults, whatever style the process set before (a test may have applied the book's)
    with plt.style.context("default"), plt.rc_context(RC):
        fig = draw()
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        plt.close(fig)
    return buf.getvalue()


if __name__ == "__main__":
    SVG.write_text(svg_text(), encoding="utf-8")
    print(f"wrote {SVG}", file=sys.stderr)
