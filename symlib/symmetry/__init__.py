"""Weight-space symmetries: the maths, for any network (book: chapters "A gentle example",
"Symmetries of real architectures", "Min-mass", "Aligning variational posteriors"; paper §3, App. C).

* :mod:`~symlib.symmetry.actions`: what one label does to one parameter axis (the records of a spec);
* :mod:`~symlib.symmetry.spec`: a network's symmetries as data (:class:`~symlib.symmetry.spec.Spec`);
* :mod:`~symlib.symmetry.trace`: specs of convolutional networks and transformers by tracing (``spec_of``);
* :mod:`~symlib.symmetry.ops`: the group action (``act``, ``random_element``, compose, inverse);
* :mod:`~symlib.symmetry.check`: does a transformed network compute the same function?
* :mod:`~symlib.symmetry.counting`: how many symmetries (paper App. D.4);
* :mod:`~symlib.symmetry.canonical`: canonical forms (normalise, sort, ``canonicalize``);
* :mod:`~symlib.symmetry.keys`: the sort keys and norms of a layer's neurons, which canonical forms use;
* :mod:`~symlib.symmetry.rounding`: how far rounding moves a sort key, and the warning of an ambiguous form;
* :mod:`~symlib.symmetry.minmass`: the lightest network of a scaling orbit (paper §3.6);
* :mod:`~symlib.symmetry.align`: aligning two networks or posteriors by permutations;
* :mod:`~symlib.symmetry.merge`: merging two networks after weight or activation matching;
* :mod:`~symlib.symmetry.continuous`: the continuous symmetries of attention (``GL`` per head);
* :mod:`~symlib.symmetry.stream`: the rotations of a pre-norm transformer's residual stream (Procrustes).

Depends on nothing in symlib but :mod:`symlib.params` (and :mod:`symlib.models` for the paper's
architectures). Submodules load on first access.
"""

from symlib._lazy import submodules

__all__ = ["actions", "align", "biases", "canonical", "check", "continuous", "counting", "keys", "merge",
           "minmass", "ops", "rounding", "spec", "stream", "trace"]
__getattr__, __dir__ = submodules(__name__, __all__)
