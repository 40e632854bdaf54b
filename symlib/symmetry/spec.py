r"""Weight-space symmetries as data (book: chapter "A gentle example", paper §3.3-3.4, App. C).

A :class:`Spec` says, for every parameter tensor of a network, which axis each
symmetry acts on. One pure function (:func:`symlib.symmetry.ops.act`) then applies any
group element, and the same spec drives canonical forms, min-mass and counting,
so a new architecture is one spec, not five functions (the idea follows
git-re-basin's ``PermutationSpec``).

Two kinds of labels act on parameter axes:

* a **permutation label** ``p`` of size ``n`` reorders an axis:
  ``theta'[..., i, ...] = theta[..., perm[i], ...]``;
* a **scaling label** ``s`` of size ``n`` multiplies an axis by a power of a
  positive vector: ``theta'[..., i, ...] = lam[i] ** power * theta[..., i, ...]``.

For a ReLU multilayer perceptron (paper Prop. 3.2, 3.4), hidden layer ``l`` has
one permutation label and one scaling label, both acting on the rows of
``W_l`` and on ``b_l`` (power +1) and on the columns of ``W_{l+1}`` (power -1):

.. math:: W_l \leftarrow P_l\,\mathrm{diag}(\lambda_l)\,W_l\,\mathrm{diag}(\lambda_{l-1})^{-1}P_{l-1}^\top,
          \qquad b_l \leftarrow P_l\,\mathrm{diag}(\lambda_l)\,b_l .

Permutation and scaling labels are separate because they need not coincide:
a BatchNorm layer is permuted with the channels before it but absorbs their
scale and opens a scale of its own (paper App. D.4.3).

Parameters may carry leading batch dimensions (a stack of many networks); every
axis in a spec counts from the start of the parameter's own shape, recorded in
``Spec.shapes``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

import torch

from symlib.errors import SymmetryError
from symlib.params import Params
from symlib.symmetry.actions import Action, BiasShift, Rotary

__all__ = ["Action", "BiasShift", "Rotary", "Spec", "functional_forward", "mlp_spec", "with_scalings"]


@dataclasses.dataclass(frozen=True)
class Spec:
    r"""The symmetries of one architecture.

    Attributes:
        shapes: shape of every parameter (buffers included) of one network.
        perms: permutation labels, in forward order, with their sizes.
        scales: scaling labels, in forward order, with their sizes.
        actions: every (parameter, axis, label) action.
        weights: parameters that are weights (they count in the mass and in the
            keys used to sort and normalise neurons); biases and buffers do not.
            A BatchNorm ``weight`` (gamma) is a weight: it carries the scale that
            the BatchNorm opens (power +1), so it is that scale's only
            "incoming weight". The scale of a convolution followed by a
            BatchNorm has no outgoing weights (the running statistics, which
            are buffers, absorb it).
        output_bias: the last layer's bias, carrier of the softmax additive
            symmetry (paper App. C.1.3), or ``None``.
        no_scaling: why a hidden layer has no scaling symmetry (e.g. a tanh
            activation), keyed by layer; scaling code refuses such networks
            (:meth:`with_partial_scalings` keeps the scalings that hold and lifts
            the refusal, :meth:`without_scalings` drops every scaling).
        forward: ``forward(theta, x)`` evaluates one network (no batch dims),
            used by the functional check; ``None`` for a spec without a model.
        input_shape: shape of one input sample, for the functional check.
        blocks: permutation labels whose permutations must respect a block
            structure, ``label -> (G, tie)``: the ``n`` entries form ``G``
            consecutive blocks of ``n / G``; a valid permutation maps block
            ``g`` onto block ``sigma(g)`` (any order inside), and every label
            with the same ``tie`` uses the same block permutation ``sigma``.
            ``tie`` is ``None`` when ``sigma`` must be the identity (the
            blocks reach the network's output). Grouped convolutions create
            such labels (paper App. D.4.2), and so do attention heads: the
            query-key and value labels of one attention share a tie.
        continuous: permutation labels that also carry a continuous group
            (attention's features), ``label -> (kind, extra)``: each block of
            ``k = n / G`` entries (one head) carries :math:`GL(k)`, acting as
            :math:`A` on the label's power +1 side and :math:`A^{-\top}` on its
            power -1 side; ``kind`` is ``"qk"`` (queries on the +1 side, keys
            on the -1 side) or ``"vo"`` (values, and the inputs of the output
            projection), and ``extra`` more dimensions come from redundant
            biases (a key bias; a value bias, absorbed by the output bias).
            :mod:`symlib.symmetry.continuous` applies and counts them; canonical
            forms, min-mass and alignment leave them alone.
        vocab: the vocabulary size when the network reads token ids (integers
            in ``[0, vocab)``, e.g. a language model), else ``None``.
        aliases: the other names of a tied parameter, ``alias -> name`` (a
            state dict lists a language model's embedding and classifier under
            both names; the actions on both keep them equal); the alias is
            one tensor of the network, not two (:func:`symlib.symmetry.counting.totals`).
        norms: the weights of the normalisations over a token's features, ``weight -> kind``:
            ``"layer"`` (LayerNorm: centres, then divides by the standard deviation) or ``"rms"``
            (RMSNorm: divides by the root mean square). Which one decides the residual stream's group of
            rotations (:mod:`symlib.symmetry.stream`); BatchNorm is not one of them.
        rotary: the continuous group of rotary query-key heads, keyed by the key heads' permutation label
            (:class:`~symlib.symmetry.actions.Rotary`: one rotation and one scale per pair of features and
            key-value head), which ``continuous`` cannot express; :mod:`symlib.symmetry.continuous` applies
            and counts it.
        shifts: redundant directions among biases outside attention
            (:class:`~symlib.symmetry.actions.BiasShift`: a class token against its position embedding, a
            patch embedding's bias against the patch tokens' position embeddings, a LayerNorm's bias against
            its readers' biases); :mod:`symlib.symmetry.biases` applies and counts them.
    """

    shapes: Mapping[str, tuple[int, ...]]
    perms: Mapping[str, int]
    scales: Mapping[str, int]
    actions: tuple[Action, ...]
    weights: frozenset[str]
    output_bias: str | None = None
    no_scaling: Mapping[str, str] = dataclasses.field(default_factory=dict)
    forward: Callable[[Params, torch.Tensor], torch.Tensor] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    input_shape: tuple[int, ...] | None = None
    blocks: Mapping[str, tuple[int, str | None]] = dataclasses.field(default_factory=dict)
    continuous: Mapping[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    vocab: int | None = None
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    norms: Mapping[str, str] = dataclasses.field(default_factory=dict)
    rotary: Mapping[str, Rotary] = dataclasses.field(default_factory=dict)
    shifts: tuple[BiasShift, ...] = ()

    def __post_init__(self) -> None:
        for a in self.actions:
            if a.param not in self.shapes:
                raise SymmetryError(f"action on unknown parameter {a.param!r}")
            shape = self.shapes[a.param]
            if not 0 <= a.axis < len(shape):
                raise SymmetryError(f"axis {a.axis} out of range for {a.param!r} of shape {shape}")
            if a.groups != 1 and (a.axis != 1 or a.groups < 1 or shape[0] % a.groups):
                raise SymmetryError(
                    f"grouped action on {a.param!r} must be on axis 1 of a weight whose {shape[0]} "
                    f"output channels split into {a.groups} groups"
                )
            if a.groups != 1 and (a.start != 0 or a.inner != 1):
                raise SymmetryError(f"grouped action on {a.param!r} cannot also act on a slice or blocks")
            if a.start < 0 or a.inner < 1:
                raise SymmetryError(f"action on {a.param!r}: start must be >= 0 and inner >= 1")
            for label, sizes in ((a.perm, self.perms), (a.scale, self.scales)):
                if label is None:
                    continue
                n = sizes.get(label)
                ok = n is not None and (
                    n == shape[a.axis] * a.groups if a.groups != 1
                    else a.start + n * a.inner <= shape[a.axis]
                )
                if not ok:
                    raise SymmetryError(
                        f"label {label!r} of size {n} acts on axis {a.axis} "
                        f"of {a.param!r}, which has size {shape[a.axis]}"
                        + (f" x {a.groups} groups" if a.groups != 1 else "")
                        + (f" (from entry {a.start}, {a.inner} entries each)" if not a.plain else "")
                    )
        self._check_slices()
        for label, (g, _) in self.blocks.items():
            if label not in self.perms or g < 1 or self.perms[label] % g:
                raise SymmetryError(
                    f"blocks of {label!r}: {g} groups do not divide a permutation label of this spec"
                )
        for label, (kind, extra) in self.continuous.items():
            if label not in self.perms or kind not in ("qk", "vo") or extra < 0:
                raise SymmetryError(f"continuous group of {label!r}: not a permutation label of this spec, "
                                    "a kind other than 'qk' and 'vo', or a negative number of extra "
                                    "dimensions")
        self._check_rotary()
        self._check_shifts()
        for weight, kind in self.norms.items():
            if weight not in self.shapes or kind not in ("layer", "rms"):
                raise SymmetryError(f"normalisation {weight!r}: not a parameter of this spec, or a kind "
                                    "other than 'layer' and 'rms'")

    def _check_rotary(self) -> None:
        """Each rotary group keys a permutation label, and its rows lie in its parameters."""
        for label, r in self.rotary.items():
            d, ok = r.per_head, label in self.perms and r.heads >= 1 and r.per_head % 2 == 0
            rows = {"queries": [stop - start for _, start, stop in r.queries],
                    "keys": [stop - start for _, start, stop in r.keys]}
            ok = ok and all(p in self.shapes and 0 <= start < stop <= self.shapes[p][0]
                            for p, start, stop in r.queries + r.keys)
            ok = ok and rows["keys"] and all(n == r.heads * d for n in rows["keys"])
            ok = ok and rows["queries"] and len(set(rows["queries"])) == 1 \
                and rows["queries"][0] % (r.heads * d) == 0
            if not ok:
                raise SymmetryError(f"rotary group of {label!r}: not a permutation label of this spec, an "
                                    "odd number of features per head, or rows that are not whole heads of "
                                    "its parameters")

    def _check_shifts(self) -> None:
        """Each shift moves vectors of one size, within its parameters."""
        for s in self.shifts:
            sizes = {self.shapes[p][-1] for p, _, _ in s.plus + s.minus if p in self.shapes}
            ok = len(sizes) == 1 and all(p in self.shapes for p, _, _ in s.plus + s.minus)
            d = sizes.pop() if ok else 0
            ok = ok and all(0 <= a < b <= math.prod(self.shapes[p]) // d for p, a, b in s.plus + s.minus)
            ok = ok and all(w in self.shapes and b in self.shapes and self.shapes[w][0 if t else -1] == d
                            for w, b, t in s.readers)
            if not ok or s.kind not in ("token", "patch", "table", "sum", "norm"):
                raise SymmetryError(f"bias shift {s}: its rows must be vectors of one size inside their "
                                    "parameters, its readers' weights must read that size, and its kind "
                                    "one of 'token', 'patch', 'table', 'sum', 'norm'")

    def _check_slices(self) -> None:
        """Labels of one kind on one axis act on disjoint slices; one plain action covers its axis."""
        by_axis: dict[tuple[str, int, str], list[tuple[int, int, Action]]] = {}
        for a in self.actions:
            for kind, label, sizes in (("perm", a.perm, self.perms), ("scale", a.scale, self.scales)):
                if label is not None:
                    span = (a.start, a.start + sizes[label] * a.inner, a)
                    by_axis.setdefault((a.param, a.axis, kind), []).append(span)
        for (param, axis, kind), spans in by_axis.items():
            spans.sort(key=lambda x: x[:2])
            if len(spans) == 1 and spans[0][2].plain and spans[0][1] != self.shapes[param][axis]:
                raise SymmetryError(
                    f"{kind} label of size {spans[0][1]} acts on axis {axis} of {param!r}, which has size "
                    f"{self.shapes[param][axis]}"
                )
            for (_, stop, a), (start, _, b) in zip(spans, spans[1:], strict=False):
                if start < stop:
                    raise SymmetryError(
                        f"{kind} labels {getattr(a, kind)!r} and {getattr(b, kind)!r} overlap on axis {axis} "
                        f"of {param!r}: labels of one kind act on disjoint slices of an axis"
                    )

    # ----------------------------------------------------------------- queries
    def span(self, a: Action) -> tuple[int, int]:
        """The slice ``(start, stop)`` of ``a.param``'s axis ``a.axis`` that action ``a`` acts on (of the
        dense weight's axis for a grouped convolution, :func:`symlib.symmetry.ops.dense_weight`)."""
        if a.groups != 1:
            return 0, self.shapes[a.param][a.axis] * a.groups
        n = self.perms[a.perm] if a.perm is not None else self.scales[a.scale]
        return a.start, a.start + n * a.inner
    def batch_shape(self, theta: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
        """Leading batch dimensions of ``theta`` (a stack of networks), checked."""
        missing = [k for k in self.shapes if k not in theta]
        if missing:
            raise SymmetryError(
                f"parameters missing from theta: {missing[:5]}; pass the full state_dict of the "
                "architecture this spec was built for"
            )
        batch = None
        for name, shape in self.shapes.items():
            t = theta[name]
            if tuple(t.shape[t.ndim - len(shape):]) != tuple(shape) or t.ndim < len(shape):
                raise SymmetryError(
                    f"parameter {name!r} has shape {tuple(t.shape)}, expected (*batch, {shape}): "
                    "is this checkpoint from another architecture?"
                )
            b = tuple(t.shape[: t.ndim - len(shape)])
            if batch is None:
                batch = b
            elif b != batch:
                raise SymmetryError(f"parameter {name!r} has batch shape {b}, others {batch}")
        return batch or ()

    @functools.cached_property
    def _index(self) -> dict[tuple[str, str], tuple[Action, ...]]:
        """The actions of each permutation label (``("perm", label)``), scaling label (``("scale", label)``)
        and parameter (``("param", name)``), in the order of ``actions``: built once per spec, so that the
        queries below take the few actions they need instead of scanning all of them (a DenseNet-121 has
        about 3,500; canonical forms ask thousands of queries)."""
        out: dict[tuple[str, str], list[Action]] = {}
        for a in self.actions:
            for key in (("perm", a.perm), ("scale", a.scale), ("param", a.param)):
                if key[1] is not None:
                    out.setdefault(key, []).append(a)
        return {key: tuple(acts) for key, acts in out.items()}

    def of_label(self, label: str, kind: str = "scale") -> tuple[Action, ...]:
        """Every action of permutation (``kind="perm"``) or scaling (``kind="scale"``) label ``label``, in
        the order of ``actions``."""
        return self._index.get(("scale" if kind == "scale" else "perm", label), ())

    def on_param(self, param: str) -> tuple[Action, ...]:
        """Every action on parameter ``param``, in the order of ``actions``."""
        return self._index.get(("param", param), ())

    def incoming(self, label: str, kind: str = "scale") -> list[Action]:
        """Weight actions on the outgoing side (power > 0) of ``label``: the neurons' incoming weights."""
        return [a for a in self.of_label(label, kind) if a.param in self.weights and a.power > 0]

    def outgoing(self, label: str, kind: str = "scale") -> list[Action]:
        """Weight actions on the incoming side (power < 0) of ``label``: the neurons' outgoing weights."""
        return [a for a in self.of_label(label, kind) if a.param in self.weights and a.power < 0]

    def perm_of_scale(self, scale: str) -> str | None:
        """The permutation label that reorders the entries of scaling label ``scale``."""
        perms = {a.perm for a in self.of_label(scale, "scale")}
        if len(perms) != 1:
            raise SymmetryError(f"scaling label {scale!r} is permuted by {perms}, expected one label")
        return perms.pop()

    def require_scaling(self) -> None:
        """Raise a clear error when some hidden layer has no scaling symmetry."""
        if self.no_scaling:
            layer, why = next(iter(self.no_scaling.items()))
            more = f" (and {len(self.no_scaling) - 1} more layers)" if len(self.no_scaling) > 1 else ""
            raise SymmetryError(
                f"scaling symmetries need positively homogeneous activations (ReLU, LeakyReLU, "
                f"max/avg pooling), but layer {layer!r} {why}{more}. Permutations still apply: "
                "spec_of(model, input_shape, scalings='none') (or spec.without_scalings()) gives the "
                "permutation-only spec; scalings='partial' (or spec.with_partial_scalings()) keeps the "
                "scalings of the layers where they hold (on the command line: --scalings none or "
                "--scalings partial)."
            )

    def without_scalings(self) -> Spec:
        """The permutation-only spec: every scaling label dropped (valid for any activation)."""
        actions = tuple(
            dataclasses.replace(a, scale=None, power=a.power, offset=0.0)
            for a in self.actions if a.perm is not None
        )
        return dataclasses.replace(self, scales={}, actions=actions, no_scaling={})

    def with_partial_scalings(self) -> Spec:
        """The spec with the scalings that hold, without refusing scaling operations.

        The scaling labels of a spec are exact symmetries wherever they are
        declared; ``no_scaling`` only lists the layers whose activation (e.g.
        tanh, SiLU) fixed a scale, and makes scaling operations refuse the spec
        so that nobody mistakes a partial group for the full one. This drops
        that list: ``ops.random_element``, ``canonical.normalize`` and min-mass
        then act on the labels that scale.
        """
        return dataclasses.replace(self, no_scaling={})

    def groups_of(self, param: str) -> int:
        """Number of groups of a grouped convolution weight ``param`` (1 for any other parameter)."""
        return max((a.groups for a in self.on_param(param)), default=1)

    def tie_classes(self) -> dict[str | None, list[str]]:
        """Labels of ``blocks`` that share one block permutation, keyed by their tie."""
        out: dict[str | None, list[str]] = {}
        for label, (_, tie) in self.blocks.items():
            out.setdefault(tie, []).append(label)
        return out

    def with_forward(self, forward, input_shape) -> Spec:
        """The same spec with a ``forward(theta, x)`` and an input shape for the functional check."""
        return dataclasses.replace(self, forward=forward, input_shape=tuple(input_shape))


# --------------------------------------------------------------------------- MLPs
_HOMOGENEOUS = (torch.nn.ReLU, torch.nn.LeakyReLU, torch.nn.Identity)


def mlp_spec(model: torch.nn.Sequential, scalings: str = "auto") -> Spec:
    """Spec of an ``nn.Sequential`` of ``Linear`` layers and element-wise activations.

    Hidden layer ``l`` (the output of the ``l``-th Linear, 0-based) gets labels
    ``"h{l}"`` for both its permutation and its scaling. Any element-wise
    activation keeps the permutation symmetry; only positively homogeneous ones
    (ReLU, LeakyReLU, identity) keep the scaling symmetry.

    Args:
        model: the network, e.g. :class:`symlib.models.MLP`.
        scalings: ``"auto"``, ``"partial"`` or ``"none"``, as in
            :func:`symlib.symmetry.trace.spec_of`.

    Returns:
        The spec, with ``forward`` set to evaluate the model functionally.
    """
    if not isinstance(model, torch.nn.Sequential):
        raise SymmetryError(
            f"mlp_spec takes an nn.Sequential of Linear layers and activations, got "
            f"{type(model).__name__}; for other architectures use symlib.symmetry.trace.spec_of"
        )
    linears: list[str] = []
    acts: dict[int, torch.nn.Module] = {}
    for name, mod in model.named_children():
        if isinstance(mod, torch.nn.Linear):
            linears.append(name)
        elif linears and not isinstance(mod, (torch.nn.Dropout, torch.nn.Flatten)):
            if len(linears) in acts:
                raise SymmetryError(f"two activations in a row after layer {linears[-1]!r}")
            acts[len(linears)] = (name, mod)
    if len(linears) < 2:
        raise SymmetryError("an MLP needs at least two Linear layers to have hidden neurons")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    perms, scales, actions, no_scaling = {}, {}, [], {}
    for l, name in enumerate(linears[:-1]):
        label = f"h{l}"
        n = shapes[f"{name}.weight"][0]
        act_name, act = acts.get(l + 1, (None, torch.nn.Identity()))
        perms[label] = n
        homogeneous = isinstance(act, _HOMOGENEOUS)
        if homogeneous:
            scales[label] = n
        else:
            no_scaling[act_name] = f"uses {type(act).__name__}, which is not positively homogeneous"
        s = label if homogeneous else None
        nxt = linears[l + 1]
        actions.append(Action(f"{name}.weight", 0, label, s, 1))
        if f"{name}.bias" in shapes:
            actions.append(Action(f"{name}.bias", 0, label, s, 1))
        actions.append(Action(f"{nxt}.weight", 1, label, s, -1))
    weights = frozenset(f"{n}.weight" for n in linears)
    last_bias = f"{linears[-1]}.bias"
    spec = Spec(
        shapes=shapes,
        perms=perms,
        scales=scales,
        actions=tuple(actions),
        weights=weights,
        output_bias=last_bias if last_bias in shapes else None,
        no_scaling=no_scaling,
    )
    in_features = shapes[f"{linears[0]}.weight"][1]
    return with_scalings(spec, scalings).with_forward(functional_forward(model), (in_features,))


def with_scalings(spec: Spec, scalings: str) -> Spec:
    """``spec`` as is (``"auto"``), with partial scalings (``"partial"``) or without scalings (``"none"``)."""
    if scalings == "auto":
        return spec
    if scalings == "partial":
        return spec.with_partial_scalings()
    if scalings == "none":
        return spec.without_scalings()
    raise ValueError(f"scalings must be 'auto', 'partial' or 'none', got {scalings!r}")


def functional_forward(model: torch.nn.Module) -> Callable[[Params, torch.Tensor], torch.Tensor]:
    """``forward(theta, x)`` evaluating ``model`` with parameters and buffers from ``theta``."""
    model = model.eval()

    def forward(theta: Params, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, theta, (x,))

    return forward
