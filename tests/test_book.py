"""The book's helpers: one parameters cell per page after a papermill run."""

from __future__ import annotations

import nbformat

from symlib.paper import book


def _nb(tmp_path, injected: str | None):
    nb = nbformat.v4.new_notebook()
    p = nbformat.v4.new_code_cell('scale = "cpu"  # tiny | cpu | paper\ndevice = "cpu"\nseed = 0')
    p.metadata["tags"] = ["parameters"]
    cells = [nbformat.v4.new_markdown_cell("# A chapter"), p]
    if injected is not None:
        inj = nbformat.v4.new_code_cell(injected)
        inj.metadata["tags"] = ["injected-parameters"]
        cells.append(inj)
    nb.cells = [*cells, nbformat.v4.new_code_cell("print(scale, device, seed)")]
    path = tmp_path / "chapter.ipynb"
    nbformat.write(nb, path)
    return path


def test_fold_parameters_shows_the_values_papermill_ran(tmp_path):
    path = _nb(tmp_path, '# Parameters\nscale = "paper"\ndevice = "cuda"\nextra = 3\n')
    assert book.fold_parameters(str(path))
    nb = nbformat.read(path, as_version=4)
    params, inj = nb.cells[1], nb.cells[2]
    assert params.source.splitlines() == [
        'scale = "paper"  # tiny | cpu | paper',
        'device = "cuda"',
        "seed = 0",
        "extra = 3",
    ]
    assert "remove-cell" in inj.metadata["tags"]
    # the page's parameters cell and the injected cell define the same values
    ns_params, ns_inj = {}, {"seed": 0}
    exec(params.source, ns_params)
    exec(inj.source, ns_inj)
    assert {k: ns_params[k] for k in ("scale", "device", "seed", "extra")} == {
        k: ns_inj[k] for k in ("scale", "device", "seed", "extra")
    }


def test_fold_parameters_without_papermill_is_a_no_op(tmp_path):
    path = _nb(tmp_path, None)
    before = path.read_text()
    assert not book.fold_parameters(str(path))
    assert path.read_text() == before
