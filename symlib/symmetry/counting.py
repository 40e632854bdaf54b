r"""Counting weight-space symmetries (book: chapter "Symmetries of real architectures"; paper App. D.1, D.4).

From a :class:`~symlib.symmetry.spec.Spec` (e.g. :func:`symlib.symmetry.trace.spec_of`), every
permutation label of ``n`` channels contributes

* ``n!`` permutations when nothing constrains it (paper D.1: an MLP has
  :math:`\prod_\ell n_\ell!` permutation-generated copies of each network);
* :math:`((n/G)!)^G` when a grouped convolution with ``G`` groups reads or
  writes it (paper D.4.2), times :math:`G!` once per tie for moving whole groups
  together with the groups they feed (the paper's count leaves these swaps out);
* one factor for all the layers a residual stream ties together (D.4.4),
  instead of one per layer;

and every scaling label of ``n`` channels contributes ``n`` scaling degrees of
freedom (sDoF): one positive factor per channel (D.4.1: per output channel of a
convolution; D.4.3: a BatchNorm absorbs the scale before it and adds its own).
The group of the network is the product over labels, so its order is the
product of the per-label counts; :func:`table` lists them per layer.

Attention (book: chapter "Transformers: permutations without scalings") adds a
continuous group (``Spec.continuous``, :mod:`symlib.symmetry.continuous`): per head,
:math:`GL(d_k)` on queries and keys and :math:`GL(d_v)` on values, :math:`d_k^2 + d_v^2`
dimensions, plus the redundant key and value biases. They are counted apart, as
``continuous`` dimensions: the in-head permutations counted in the finite group are
a subgroup of them, and so are per-feature scalings of the attention's features,
which therefore are not scaling labels. A residual stream that only LayerNorms (RMSNorms) read
also rotates (:mod:`symlib.symmetry.stream`): :math:`O(d-1)`, :math:`(d-1)(d-2)/2` dimensions
(:math:`O(d)`, :math:`d(d-1)/2`), counted apart again, as ``stream_rotations``. Rotary heads keep
:math:`d` dimensions per key-value head of :math:`GL(d)` (``Spec.rotary``, in ``continuous``), and biases
outside attention add redundant directions (a class token against its position embedding, a LayerNorm's
bias against its readers' biases: :mod:`symlib.symmetry.biases`), counted as ``bias_shifts``.
"""

from __future__ import annotations

import math

import torch

from symlib.symmetry.spec import Spec


class Count(int):
    """An exact count that prints at any size: an ``int`` in every operation, whose ``repr`` and ``str``
    show a number of more than 4,000 digits as ``m.mmmmme+N (N+1 digits)`` (Python refuses to convert
    integers of more than 4,300 digits to text, so ``print(totals(spec))`` of a transformer would fail)."""

    def __repr__(self) -> str:
        if self.bit_length() < 13_000:  # under about 3,900 decimal digits: the plain integer
            return int.__repr__(self)
        exp = math.floor(math.log10(self)) if self > 0 else 0  # math.log10 takes arbitrary-size ints
        mantissa = 10 ** (math.log10(self) - exp)
        return f"{mantissa:.6f}e+{exp} ({exp + 1} digits)"

    __str__ = __repr__


def _log10_factorial(n: int) -> float:
    return math.lgamma(n + 1) / math.log(10)


def _weights(spec: Spec, label: str) -> list[str]:
    """Weights whose rows (outputs) carry permutation ``label``."""
    out = []
    for a in spec.of_label(label, "perm"):
        if a.axis == 0 and a.power > 0 and a.param in spec.weights and a.param not in out:
            out.append(a.param)
    return out


def _layers(spec: Spec, label: str) -> list[str]:
    """Layers whose outputs carry permutation ``label`` (rows of their weights)."""
    return list(dict.fromkeys(p.rsplit(".", 1)[0] for p in _weights(spec, label)))


def _components(blocks: int, k: int) -> float:
    """log10 of the components of ``blocks`` orthogonal or general linear groups of ``k x k`` matrices,
    each of which an odd permutation of its ``k`` features reaches: 2 per block when ``k >= 2``."""
    return blocks * math.log10(2) if k >= 2 else 0.0


def count(spec: Spec) -> list[dict]:
    r"""Per-label symmetry counts.

    Args:
        spec: the architecture's symmetries.

    Returns:
        One dict per permutation label, in forward order, with ``label``,
        ``layers`` (the layers sharing it), ``channels``, ``groups``,
        ``permutations`` (exact integer: within-group orders times group
        swaps), ``log10_permutations``, ``untied_log10`` (log10 of the count
        if every linear or convolutional layer of ``layers`` had its own free
        permutation, i.e. without residual ties and groups), ``scaling_dof`` (entries of the
        scaling labels reordered by this label) and ``continuous`` (dimensions of the label's
        continuous group, :func:`symlib.symmetry.continuous.dims`; 0 for most labels) and
        ``stream_rotations`` (dimensions of the rotations of a residual stream,
        :func:`symlib.symmetry.stream.dims`; 0 for every other label), ``bias_shifts`` (dimensions of the
        redundant bias directions outside attention whose vectors carry this label,
        :func:`symlib.symmetry.biases.dims`; a final row with label ``None`` holds those on unlabelled
        features), and ``discrete_log10``: log10 of
        the distinct components of the set of networks the permutations reach together with the
        continuous groups, the isolated copies of a network. A stream's permutations are orthogonal maps
        of it (a permutation matrix is orthogonal and fixes the all-ones vector), and a head's
        permutations of its features are changes of basis of the head (:math:`GL(d_k)`,
        :math:`GL(d_v)`). Both groups have two components, told apart by the sign of the determinant: a
        continuous path through networks with the same function joins an even permutation to the
        identity, and an odd one to a reflection, never to the identity. So a stream keeps a factor 2
        (for :math:`d \ge 2`), each head a factor 2 per continuous label (for :math:`k \ge 2` features),
        and the heads' order stays discrete.
        A rotary head's group (``Spec.rotary``, counted in ``continuous``) and the bias shifts act inside a
        head or on biases: they hold no permutation, and leave the permutations of their labels discrete.
    """
    from symlib.symmetry import biases as _biases
    from symlib.symmetry import continuous as _continuous
    from symlib.symmetry import stream as _stream

    cont = _continuous.dims(spec)
    rotations = _stream.dims(spec)
    shifts = _biases.dims(spec)
    scale_dof: dict[str | None, int] = {}
    for s, n in spec.scales.items():
        perm = {a.perm for a in spec.of_label(s, "scale")}
        key = perm.pop() if len(perm) == 1 else None
        scale_dof[key] = scale_dof.get(key, 0) + n
    first_of_tie: set[str] = set()
    for tie, labels in spec.tie_classes().items():
        if tie is not None:
            first_of_tie.add(next(x for x in spec.perms if x in labels))
    rows = []
    for label, n in spec.perms.items():
        groups, _ = spec.blocks.get(label, (1, None))
        within = math.factorial(n // groups) ** groups
        swaps = math.factorial(groups) if label in first_of_tie else 1
        layers = _layers(spec, label)
        log10 = groups * _log10_factorial(n // groups) + math.log10(swaps)
        # inside a continuous group: a GL(k) per head or the stream's rotations; a rotary group and the
        # bias shifts hold no permutation (they act inside each head, or on biases)
        connected = label in spec.continuous or rotations.get(label, 0) > 0
        rows.append({
            "label": label,
            "layers": layers,
            "channels": n,
            "groups": groups,
            "permutations": Count(within * swaps),
            "log10_permutations": log10,
            "discrete_log10": math.log10(swaps) + _components(groups, n // groups) if connected else log10,
            "untied_log10": sum(len(spec.shapes[w]) >= 2 for w in _weights(spec, label))
            * _log10_factorial(n),
            "scaling_dof": scale_dof.get(label, 0),
            "continuous": cont.get(label, 0),
            "stream_rotations": rotations.get(label, 0),
            "bias_shifts": shifts.get(label, 0),
        })
    if scale_dof.get(None) or shifts.get(None):
        rows.append({
            "label": None, "layers": [], "channels": 0, "groups": 1, "permutations": 1,
            "log10_permutations": 0.0, "discrete_log10": 0.0, "untied_log10": 0.0,
            "scaling_dof": scale_dof.get(None, 0), "continuous": 0, "stream_rotations": 0,
            "bias_shifts": shifts.get(None, 0),
        })
    return rows


def totals(spec: Spec) -> dict:
    """Whole-network counts: ``permutations`` (exact), ``log10_permutations``, ``discrete_log10`` (the
    permutations in no continuous group: :func:`count`), ``scaling_dof``,
    ``continuous`` (dimensions of attention's continuous groups), ``stream_rotations`` (dimensions of
    the residual streams' rotations, :mod:`symlib.symmetry.stream`), ``bias_shifts`` (dimensions of the
    redundant bias directions outside attention, :mod:`symlib.symmetry.biases`), ``parameters`` (entries of
    the
    weights and biases acted on or not, buffers excluded, a tied parameter once: ``spec.aliases``)."""
    rows = count(spec)
    perms = math.prod(r["permutations"] for r in rows)
    params = sum(
        math.prod(shape) for name, shape in spec.shapes.items()
        if not name.endswith(("running_mean", "running_var", "num_batches_tracked"))
        and name not in spec.aliases
    )
    return {
        "permutations": Count(perms),
        "log10_permutations": sum(r["log10_permutations"] for r in rows),
        "discrete_log10": sum(r["discrete_log10"] for r in rows),
        "untied_log10": sum(r["untied_log10"] for r in rows),
        "scaling_dof": sum(r["scaling_dof"] for r in rows),
        "continuous": sum(r["continuous"] for r in rows),
        "stream_rotations": sum(r["stream_rotations"] for r in rows),
        "bias_shifts": sum(r["bias_shifts"] for r in rows),
        "parameters": params,
    }


def table(model_or_spec, input_shape=None, exact_below: float = 1e15):
    """A book-ready ``pandas.DataFrame`` of :func:`count`, with a final ``total`` row.

    Args:
        model_or_spec: a :class:`~symlib.symmetry.spec.Spec`, or a model to trace with
            :func:`symlib.symmetry.trace.spec_of` (then ``input_shape`` is required).
        input_shape: shape of one input sample, for a model.
        exact_below: show exact permutation counts below this size (larger
            ones only as log10).
    """
    import pandas as pd

    spec = model_or_spec
    if isinstance(model_or_spec, torch.nn.Module):
        if input_shape is None:
            raise ValueError("table(model) needs input_shape, e.g. (3, 32, 32), to trace the model")
        from symlib.symmetry.trace import spec_of

        spec = spec_of(model_or_spec, input_shape)
    rows = count(spec)
    tot = totals(spec)
    frame = pd.DataFrame(
        [
            {
                "label": r["label"],
                "layers": ", ".join(r["layers"]),
                "channels": r["channels"],
                "groups": r["groups"],
                "permutations": r["permutations"] if r["permutations"] < exact_below else None,
                "log10_permutations": round(r["log10_permutations"], 2),
                "scaling_dof": r["scaling_dof"],
                "log10_discrete": round(r["discrete_log10"], 2),
                "continuous": r["continuous"],
                "stream_rotations": r["stream_rotations"],
                "bias_shifts": r["bias_shifts"],
            }
            for r in rows
        ]
        + [{
            "label": "total", "layers": "", "channels": sum(r["channels"] for r in rows), "groups": None,
            "permutations": tot["permutations"] if tot["permutations"] < exact_below else None,
            "log10_permutations": round(tot["log10_permutations"], 2), "scaling_dof": tot["scaling_dof"],
            "log10_discrete": round(tot["discrete_log10"], 2), "continuous": tot["continuous"],
            "stream_rotations": tot["stream_rotations"], "bias_shifts": tot["bias_shifts"],
        }]
    )
    # a network without continuous groups (an MLP, a CNN): no columns of zeros, and its discrete count is
    # its count of permutations
    frame = frame.drop(columns=[c for c in ("continuous", "stream_rotations", "bias_shifts") if not tot[c]])
    if not (tot["continuous"] or tot["stream_rotations"]):
        frame = frame.drop(columns="log10_discrete")
    frame["groups"] = frame["groups"].astype("Int64")
    # exact integers (no float rounding) where shown, <NA> where only the log10 is
    frame["permutations"] = frame["permutations"].astype("Int64")
    return frame


def paper_models() -> dict[str, tuple[torch.nn.Module, tuple[int, ...]]]:
    """The architectures of the paper with the shape of one input: name -> (model, input_shape)."""
    from symlib import models

    return {
        "MLP 784-512-512-512-10": (models.MLP([784, 512, 512, 512, 10]), (784,)),
        "OptuNet (MNIST)": (models.OptuNet(), (1, 28, 28)),
        "ResNet-20 (CIFAR-10)": (models.ResNet20(num_classes=10), (3, 32, 32)),
        "ResNet-18 (CIFAR-100)": (models.ResNet18(num_classes=100), (3, 32, 32)),
    }


def summary(named=None):
    """One row per model: parameters, log10 of the permutation group's order (with and without the
    residual ties and groups), scaling degrees of freedom (and the continuous dimensions of attention,
    when some model has attention). A ``pandas.DataFrame`` for the book.

    Args:
        named: ``name -> (model, input_shape)``; default :func:`paper_models`.
    """
    import pandas as pd

    from symlib.symmetry.trace import spec_of

    rows = []
    for name, (model, shape) in (named or paper_models()).items():
        tot = totals(spec_of(model, shape))
        rows.append({
            "model": name,
            "parameters": tot["parameters"],
            "log10_permutations": round(tot["log10_permutations"], 1),
            "log10_permutations_untied": round(tot["untied_log10"], 1),
            "scaling_dof": tot["scaling_dof"],
            "continuous": tot["continuous"],
        })
    frame = pd.DataFrame(rows)
    return frame if frame["continuous"].any() else frame.drop(columns="continuous")
