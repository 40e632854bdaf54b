r"""symlib: weight-space symmetries of neural networks.

The companion library of the living paper reproducing Laurent, Aldea & Franchi, *A Symmetry-Aware
Exploration of Bayesian Neural Network Posteriors* (ICLR 2024).

``import symlib`` gives the nouns a researcher needs on their own networks::

    import symlib
    spec = symlib.spec_of(model, (3, 32, 32))                   # the symmetries, traced
    table = symlib.count(spec)                                  # how many, layer by layer
    g = symlib.random_element(spec)                             # a random permutation + positive scaling
    same = symlib.act(g, theta, spec)                           # other weights, same function
    symlib.assert_same_function(spec, theta, same)              # ... checked on random inputs
    canon = symlib.canonicalize(same, spec)                     # one representative per orbit
    light = symlib.minmass(theta, spec).theta                   # the lightest network of the scaling orbit
    folded = symlib.fold_batchnorm(theta, model, (3, 32, 32))   # (with BatchNorm: fold it first,
    light = symlib.minmass(folded.theta, folded.spec).theta     #  then min-mass on the folded network)
    res = symlib.mmd(set_a, set_b, spec=spec, symmetries="ns", n_permutations=1000)
    moved = symlib.align(theta_a, theta_b, spec).mean           # theta_b permuted to match theta_a
    merged = symlib.merge(theta_a, theta_b, spec, how="weights")  # their average after weight matching
    print(symlib.barrier(theta_a, theta_b, model).loss_barrier)  # the loss bump on the path, MNIST digits
    params, manifest = symlib.load("zoos/optunet")              # a zoo, a sample set, hf://owner/name
    print(symlib.compare("zoos/a", "zoos/b").format())          # the paper's MMD of two folders, per layer
    theta = symlib.load_checkpoints("runs/*.ckpt", model=MyNet())  # your files: .pt, .ckpt, safetensors, HF

Everything else is reached through its subpackage, loaded on first access (the layers, lowest first;
nothing imports a layer above it):

* leaves: :mod:`symlib.params` (the ``Params`` type), :mod:`symlib.store` (the on-disk format),
  :mod:`symlib.models`, :mod:`symlib.scales`, :mod:`symlib.progress`, :mod:`symlib.data` (datasets),
  :mod:`symlib.kernels` (compiled CPU kernels), :mod:`symlib.plotting`;
* :mod:`symlib.symmetry`: specs, the group action, canonical forms, counting, min-mass, alignment;
* :mod:`symlib.training`: recipes, data plans and the stacked trainer;
* :mod:`symlib.zoo`: checkpoint zoos (train, store, resume, shard, merge, cache);
* :mod:`symlib.stats`: MMD, uncertainty metrics, pairwise mutual information, predictions, MCMC
  diagnostics;
* :mod:`symlib.posteriors`: posterior approximations as checkpoint sets;
* :mod:`symlib.checkpoints` (:func:`load`, :func:`info`), :mod:`symlib.ckpt` (:func:`load_checkpoints`:
  checkpoint files of one's own), :mod:`symlib.comparison` (:func:`compare`),
  :mod:`symlib.paper` (what only the book's chapters use) and :mod:`symlib.cli` (the ``symlib`` command).
"""

import importlib

from symlib._version import __version__

# public name -> (module, attribute); resolved on first access, so that ``import symlib`` stays light
_NOUNS = {
    "Params": ("symlib.params", "Params"),
    "Spec": ("symlib.symmetry.spec", "Spec"),
    "SymmetryError": ("symlib.symmetry.spec", "SymmetryError"),
    "spec_of": ("symlib.symmetry.trace", "spec_of"),
    "mlp_spec": ("symlib.symmetry.spec", "mlp_spec"),
    "act": ("symlib.symmetry.ops", "act"),
    "random_element": ("symlib.symmetry.ops", "random_element"),
    "assert_same_function": ("symlib.symmetry.check", "assert_same_function"),
    "canonicalize": ("symlib.symmetry.canonical", "canonicalize"),
    "count": ("symlib.symmetry.counting", "table"),
    "minmass": ("symlib.symmetry.minmass", "minmass"),
    "fold_batchnorm": ("symlib.symmetry.minmass", "fold_batchnorm"),
    "align": ("symlib.symmetry.align", "align"),
    "merge": ("symlib.symmetry.merge", "merge"),
    "barrier": ("symlib.stats.barrier", "barrier"),
    "mmd": ("symlib.stats.mmd", "two_sample"),
    "load": ("symlib.checkpoints", "load"),
    "info": ("symlib.checkpoints", "info"),
    "compare": ("symlib.comparison", "compare"),
    "load_checkpoints": ("symlib.ckpt.loader", "load_checkpoints"),
}
_SUBPACKAGES = (
    "checkpoints", "ckpt", "cli", "comparison", "data", "kernels", "models", "paper", "params", "plotting",
    "posteriors", "progress", "scales", "stats", "store", "symmetry", "training", "zoo",
)
__all__ = [*_NOUNS, *_SUBPACKAGES, "__version__"]


def __getattr__(name):
    if name in _NOUNS:
        module, attr = _NOUNS[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"symlib.{name}")
    raise AttributeError(f"module 'symlib' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
