"""What only the book's chapters use: the studies of the paper, one module per chapter, and the
bookkeeping of a living paper (book: every chapter).

* :mod:`~symlib.paper.toy`: the gentle example's 10,000 perceptrons (§3.1, App. A);
* :mod:`~symlib.paper.table1`: assembling Table 1 (§4, App. B);
* :mod:`~symlib.paper.collapse`: functional collapse of a zoo (§5.1, App. D.2);
* :mod:`~symlib.paper.permfreq`: permutations during training (§5.2);
* :mod:`~symlib.paper.marginals`: the posterior's marginals (App. D.1, D.3);
* :mod:`~symlib.paper.interp`: predictives along interpolation paths (Rossi et al. 2023);
* :mod:`~symlib.paper.transformers`: a small vision transformer and the chapter on transformers;
* :mod:`~symlib.paper.chapters`: small helpers the chapters share (timers, the CIFAR-10 loader, ...);
* :mod:`~symlib.paper.book`: ``glue`` and the parameters cell of a papermill run;
* :mod:`~symlib.paper.caches`: the zoo and sample sets the chapters share, filled before they run
  (``make zoo``).

Submodules load on first access.
"""

from symlib._lazy import submodules

__all__ = ["book", "caches", "chapters", "collapse", "interp", "marginals", "permfreq", "table1", "toy",
           "transformers"]
__getattr__, __dir__ = submodules(__name__, __all__)
