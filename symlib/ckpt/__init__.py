r"""Bring your own checkpoints: the files researchers already have, read into symlib (book: "symlib on your
own network").

:func:`load_checkpoints` (``symlib.load_checkpoints``) reads ``torch.save`` files, Lightning ``.ckpt``
files, safetensors files, Hugging Face model folders (sharded too) and ``hf://`` repositories, timm
checkpoints and symlib folders into the stacked ``{name: (n, ...)}`` form every symlib function takes;
the architecture comes from the user's code or from the configuration beside the files, as a
:class:`~symlib.ckpt.recipe.Recipe` that manifests record. :mod:`~symlib.ckpt.convert` writes such a set
as a symlib folder (``symlib import``) and its canonical forms (``symlib canonicalize``); three adapters
turn the results of other Bayesian deep-learning libraries into stacked sets.

The modules, lowest first:

* :mod:`~symlib.ckpt.errors` (:class:`~symlib.ckpt.errors.CheckpointError`) and :mod:`~symlib.ckpt.lazy`
  (tensors inside files, read on demand);
* one module per file kind: :mod:`~symlib.ckpt.torchfile` (``torch.save``, Lightning; weights-only
  unpickling), :mod:`~symlib.ckpt.safetensorsfile`, :mod:`~symlib.ckpt.hf` (Hugging Face folders and
  repositories);
* :mod:`~symlib.ckpt.state` (which tensors of a file are the network's: the state dict and its prefix),
  :mod:`~symlib.ckpt.recipe` (architectures as data), :mod:`~symlib.ckpt.paths` (which checkpoints a
  path, folder or glob names), :mod:`~symlib.ckpt.loader` (the loader),
  :mod:`~symlib.ckpt.convert` (symlib folders from checkpoints);
* adapters: :mod:`~symlib.ckpt.from_laplace` (``laplace-torch``), :mod:`~symlib.ckpt.from_posteriors`
  (Normal Computing's ``posteriors``), :mod:`~symlib.ckpt.from_torch_uncertainty` (deep and packed
  ensembles).

Submodules load on first access.
"""

from symlib._lazy import submodules
from symlib.ckpt.errors import CheckpointError
from symlib.ckpt.loader import load_checkpoints

_MODULES = ("convert", "errors", "from_laplace", "from_posteriors", "from_torch_uncertainty", "hf", "lazy",
            "loader", "paths", "recipe", "safetensorsfile", "state", "torchfile")
__getattr__, __dir__ = submodules("symlib.ckpt", _MODULES)


__all__ = ["CheckpointError", "load_checkpoints", *_MODULES]
