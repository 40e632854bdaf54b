r"""Sample sets as the MMD sees them: symmetries removed, weights flattened per layer (book: chapter
"Table 1"; paper §4).

A *layer* (:func:`layers_of`) is a module's weight with its bias (and a BatchNorm's gamma with its beta),
flattened together; buffers (running statistics) are left out. :func:`prepare` turns two sets into a
:class:`Pair`; :func:`layered` removes the symmetries of many sets once, so that any two of them form a
pair without repeating the removal (Table 1's 12 sets against one target).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from symlib import progress as _progress
from symlib.params import Params
from symlib.symmetry import canonical
from symlib.symmetry.spec import Spec

__all__ = [
    "SYMMETRIES",
    "Layered",
    "Pair",
    "check_set",
    "flatten",
    "layered",
    "layers_of",
    "prepare",
    "remove_symmetries",
]

SYMMETRIES = ("raw", "ns", "minmass", "perm", "scale")


_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


# ----------------------------------------------------------------------------- inputs
def remove_symmetries(params: Params, spec: Spec | None, how: str = "ns", check: bool = True) -> Params:
    """The sample set ``params`` (stacked ``(S, ...)``) with the symmetries named by ``how`` removed.

    Args:
        params: stacked state dicts.
        spec: the architecture's symmetries (:func:`symlib.symmetry.trace.spec_of`); unused for ``"raw"``.
        how: ``"raw"`` (nothing), ``"ns"`` (the paper's: unit L2-norm neurons, then sort by the maximum
            incoming weight), ``"minmass"`` (min-mass scaling, then the same sort), ``"perm"`` (sort
            only) or ``"scale"`` (unit-norm only).
        check: verify that every network computes the same function afterwards.
    """
    if how not in SYMMETRIES:
        raise ValueError(f"unknown symmetry removal {how!r}; choose one of {SYMMETRIES}")
    if how == "raw":
        return dict(params)
    if spec is None:
        raise ValueError(f"removing symmetries ({how!r}) needs the spec: pass spec=trace.spec_of(model, ...)")
    scaling = {"ns": "normalize", "minmass": "minmass", "perm": None}
    if how == "scale":
        return canonical.normalize(params, spec, check=check)
    return canonical.canonicalize(params, spec, key="max", scaling=scaling[how], check=check)


def layers_of(source: Spec | Mapping | Sequence[str], by: str = "module") -> dict[str, tuple[str, ...]]:
    """Layers as ``{layer: parameter names}``, in the order of ``source`` (buffers left out).

    Args:
        source: a :class:`~symlib.symmetry.spec.Spec`, a state dict, or parameter names.
        by: ``"module"`` (a weight with its bias: ``"fc.weight"`` and ``"fc.bias"`` form layer ``"fc"``)
            or ``"tensor"`` (each parameter alone).
    """
    names = list(source.shapes) if isinstance(source, Spec) else list(source)
    if by not in ("module", "tensor"):
        raise ValueError(f"by must be 'module' or 'tensor', got {by!r}")
    out: dict[str, list[str]] = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _BUFFERS:
            continue
        out.setdefault(prefix if by == "module" and prefix else name, []).append(name)
    if not out:
        raise ValueError(f"no parameters to compare among {names[:5]}")
    return {k: tuple(v) for k, v in out.items()}


def unwrap(samples) -> Params:
    """A stacked state dict from a dict or a :class:`symlib.posteriors.base.SampleSet`."""
    params = getattr(samples, "params", samples)
    if not isinstance(params, Mapping):
        raise TypeError(f"expected stacked weights {{name: (S, ...)}} or a SampleSet, got {type(samples)}")
    return dict(params)


def check_set(params: Params, layers: Mapping[str, Sequence[str]], what: str) -> int:
    """Refuse a set the MMD cannot compare, naming the problem and the fix: a tensor a layer needs is
    absent, the set holds fewer than 2 samples (the unbiased estimator divides by ``S (S - 1)``), or
    a weight is NaN or infinite (the estimate would be NaN and its p-value would look significant).

    Returns:
        The number of samples ``S``.
    """
    names = [n for ns in layers.values() for n in ns]
    missing = [n for n in names if n not in params]
    if missing:
        raise KeyError(f"{what} lacks {missing[:5]}, which the layers need: are both sets of one "
                       "architecture?")
    sizes = {int(params[n].shape[0]) if params[n].dim() else 0 for n in names}
    if len(sizes) > 1:
        raise ValueError(f"{what}: its tensors hold different numbers of samples ({sorted(sizes)}); pass "
                         "stacked state dicts {name: (S, ...)}")
    s = sizes.pop()
    if s < 2:
        raise ValueError(f"{what} holds {'no samples (an empty set)' if s == 0 else 'only 1 sample'}; the "
                         "unbiased MMD needs at least 2 samples per set: pass a larger set")
    for n in names:
        v = params[n]
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = (~torch.isfinite(v)).reshape(s, -1).any(1).nonzero().flatten().tolist()
            raise ValueError(
                f"{what}: tensor {n!r} holds NaN or infinite weights (samples {bad[:10]}"
                f"{'...' if len(bad) > 10 else ''} of {s}); the MMD of such weights is NaN and its p-value "
                "meaningless: drop these samples (e.g. diverged runs) or fix how they were produced"
            )
    return s


def flatten(params: Params, layers: Mapping[str, Sequence[str]], dtype=torch.float64) -> list[torch.Tensor]:
    """One ``(S, d_layer)`` matrix per layer: its parameters flattened and concatenated, one row a sample."""
    out = []
    for layer, names in layers.items():
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"layer {layer!r} needs {missing}, absent from the sample set: same architecture?")
        s = params[names[0]].shape[0]
        out.append(torch.cat([params[n].reshape(s, -1).to(dtype) for n in names], dim=1))
    return out


@dataclasses.dataclass(frozen=True)
class Pair:
    """Two sample sets flattened per layer, ready to compare.

    Attributes:
        names: layer names; ``sizes``: their parameter counts.
        x: target layers, ``(m, d)`` each; ``y``: method layers, ``(n, d)`` each.
        symmetries: which symmetries were removed (:func:`remove_symmetries`).
        dxx: optional cached within-target distances per layer, ``(2, m(m-1)/2)`` (L1, L2; the upper
            triangle, :func:`~symlib.stats.mmd.kernels.pdist`), shared by
            :func:`~symlib.stats.mmd.compare.table` across methods.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    x: tuple[torch.Tensor, ...]
    y: tuple[torch.Tensor, ...]
    symmetries: str = "raw"
    dxx: tuple[torch.Tensor, ...] | None = None

    @property
    def m(self) -> int:
        return int(self.x[0].shape[0])

    @property
    def n(self) -> int:
        return int(self.y[0].shape[0])


def prepare(target, samples, spec: Spec | None = None, symmetries: str = "raw", layers=None,
            dtype=torch.float64, check: bool = True) -> Pair:
    """Remove symmetries from both sets and flatten them per layer (the target is ``X``).

    Args:
        target, samples: stacked state dicts ``(S, ...)`` or ``SampleSet`` s of one architecture.
        spec: the architecture's symmetries; needed unless ``symmetries="raw"``.
        symmetries: see :func:`remove_symmetries`.
        layers: ``{layer: names}`` (:func:`layers_of`); by default one layer per module of ``spec`` (or
            of ``target``'s keys).
        dtype: of the comparison (float64: the statistic is a difference of large sums).
    """
    target, samples = unwrap(target), unwrap(samples)
    layers = layers_of(spec if spec is not None else target) if layers is None else dict(layers)
    check_set(target, layers, "the target set")
    check_set(samples, layers, "the compared set")
    xs = flatten(remove_symmetries(target, spec, symmetries, check), layers, dtype)
    ys = flatten(remove_symmetries(samples, spec, symmetries, check), layers, dtype)
    for name, x, y in zip(layers, xs, ys, strict=True):
        if x.shape[1] != y.shape[1]:
            raise ValueError(f"layer {name!r} has {x.shape[1]} vs {y.shape[1]} parameters: "
                             "are both sets of one architecture?")
    return Pair(tuple(layers), tuple(int(x.shape[1]) for x in xs), tuple(xs), tuple(ys), symmetries)


@dataclasses.dataclass(frozen=True)
class Layered:
    """Sample sets with their symmetries removed once and flattened per layer (:func:`layered`), so that
    any two of them form a :class:`Pair` without repeating the removal.

    Attributes:
        names, sizes: the layers and their parameter counts.
        data: ``{(set name, symmetries): (S, d) per layer}``.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    data: Mapping[tuple[str, str], tuple[torch.Tensor, ...]]

    def pair(self, reference: str, name: str, symmetries: str = "raw"):
        """The :class:`Pair` (``reference`` as ``X``, ``name`` as ``Y``) under ``symmetries``."""
        for k in (reference, name):
            if (k, symmetries) not in self.data:
                have = sorted({s for _, s in self.data})
                raise KeyError(f"no set {k!r} with symmetries {symmetries!r} (removals computed: {have})")
        x, y = self.data[(reference, symmetries)], self.data[(name, symmetries)]
        return Pair(self.names, self.sizes, x, y, symmetries)


def layered(sets: Mapping[str, object], spec=None, symmetries: Sequence[str] = ("raw", "ns"),
            dtype=torch.float64, check: bool = True, progress: bool = False) -> Layered:
    """Remove the symmetries of every set once per removal and flatten it per layer .

    Args:
        sets: ``{name: SampleSet or stacked state dict}``, the target among them.
        spec: the architecture's symmetries (needed unless only ``"raw"``).
        symmetries: removals (:func:`symlib.stats.mmd.remove_symmetries`).
        dtype: of the comparison; ``check``: verify that every network keeps its function.
    """

    if not sets:
        raise ValueError("layered needs at least one sample set: pass {name: set}")
    first = dict(getattr(next(iter(sets.values())), "params", next(iter(sets.values()))))
    layers = layers_of(spec if spec is not None else first)
    for name, s in sets.items():
        check_set(unwrap(s), layers, f"set {name!r}")
    data = {}
    with _progress.bar(len(sets) * len(symmetries), desc="remove symmetries", enabled=progress) as bar:
        for sym in symmetries:
            for name, s in sets.items():
                params = dict(getattr(s, "params", s))
                clean = remove_symmetries(params, spec, sym, check)
                data[(name, sym)] = tuple(flatten(clean, layers, dtype))
                bar.update()
    sizes = tuple(int(x.shape[1]) for x in data[next(iter(data))])
    return Layered(tuple(layers), sizes, data)
