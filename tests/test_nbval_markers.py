"""The cells whose outputs `make nbval` compares are marked with nbval's cell tag ``nbval-check-output``, in
the chapter's source (``notebooks/<name>.md``, the ``:tags:`` of the cell) and in its executed notebook
(``book/<name>.ipynb``), never with a ``# NBVAL_CHECK_OUTPUT`` comment that readers of the pages, the
notebooks and the students' assignments would see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAG = "nbval-check-output"

# chapter: the start of the first line of each cell nbval checks, in order (the cells once marked with the
# comment NBVAL_CHECK_OUTPUT)
CHECKED = {
    "alignment": ["fig_net = models.MLP([2, 2, 1])"],
    "architectures": ["nets = counting.paper_models()",
                      "assert models.num_parameters(models.OptuNet()) == 392"],
    "collapse": ['print("the library\'s pairwise MI equals the direct formula'],
    "marginals": [],
    "minmass": ['print("scaling labels and sizes:"', 'print("our optimum equals cvxpy\'s to 1e-6:"',
                "dead = {k: v.clone() for k, v in one(0).items()}"],
    "own_network": ["spec = symlib.spec_of(net, input_shape)", "counts = symlib.count(spec)",
                    "assert err32 < 1e-5 and err64 < 1e-10"],
    "permfreq": ['print("taus lie in [-1, 1]:"'],
    "table1": ["plan = pd.DataFrame("],
    "toy": ["data = toy.two_gaussians(n_per_class=200, seed=seed)", 'n = len(panels["raw"])'],
    "transformers": ["make_vit = functools.partial(tf.TinyViT",
                     "optunet_spec = symlib.spec_of(models.OptuNet()",
                     'assert kinds[stream] == "stream"'],
    "true_posterior": ["# Asserted on every run: the diagnostics exist on the three scales"],
}
CHAPTERS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.md"))


def _source(cell) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def _checked(cells, name: str) -> list[str]:
    """The first line of each code cell tagged for nbval, cut to the length of the start listed for it."""
    lines = [_source(c).splitlines()[0] for c in cells
             if c["cell_type"] == "code" and TAG in c.get("metadata", {}).get("tags", [])]
    starts = CHECKED[name]
    return [line[: len(starts[i])] if i < len(starts) else line for i, line in enumerate(lines)]


def test_every_chapter_is_listed():
    assert sorted(CHECKED) == CHAPTERS
    assert sum(map(len, CHECKED.values())) == 18


@pytest.mark.parametrize("name", CHAPTERS)
def test_no_nbval_comment_in_a_chapter(name):
    for path in (ROOT / "notebooks" / f"{name}.md", ROOT / "book" / f"{name}.ipynb"):
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            assert "NBVAL_" not in text, f"{path.name}: an nbval comment that readers see"


@pytest.mark.parametrize("name", CHAPTERS)
def test_the_checked_cells_are_tagged_in_the_source_and_the_executed_notebook(name):
    jupytext = pytest.importorskip("jupytext")
    source = jupytext.read(ROOT / "notebooks" / f"{name}.md")
    assert _checked(source.cells, name) == CHECKED[name], f"notebooks/{name}.md"
    executed = ROOT / "book" / f"{name}.ipynb"
    if executed.is_file():
        nb = json.loads(executed.read_text(encoding="utf-8"))
        assert _checked(nb["cells"], name) == CHECKED[name], f"book/{name}.ipynb"
        for cell in nb["cells"]:  # each checked cell keeps its outputs to compare with
            if TAG in cell.get("metadata", {}).get("tags", []):
                assert cell["outputs"], f"book/{name}.ipynb: a checked cell without outputs"


def test_nbval_checks_the_outputs_of_a_tagged_cell():
    plugin = pytest.importorskip("nbval.plugin")
    assert dict(plugin.find_metadata_tags({"tags": ["hide-input", TAG]})) == {"check": True}
