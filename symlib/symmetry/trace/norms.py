r"""Normalisations written out as arithmetic, as Hugging Face writes its RMSNorms (book: chapter
"Transformers: permutations without scalings"). See :mod:`symlib.symmetry.trace`; the table that picks
these rules is :mod:`~symlib.symmetry.trace.rules`.

Llama, Mistral and Qwen2 normalise the residual stream :math:`x \in \mathbb{R}^C` with

.. math:: \mathrm{rms}(x) = \gamma \odot \frac{x}{\sqrt{\tfrac{1}{C}\sum_i x_i^2 + \epsilon}}

as ``weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))``, not as ``F.rms_norm``. Two rules
cover it, and any normalisation written out the same way (a LayerNorm's ``x - x.mean(-1, keepdim=True)``):

* a reduction (``mean``, ``sum``, ``amax``) over the labelled feature axis is a statistic of the whole
  vector: a permutation of the features leaves it unchanged, :math:`\sum_i x_{\pi(i)} = \sum_i x_i`, so
  the result carries no label; a per-feature scale :math:`\lambda` does not (the sum mixes features), so
  the input's scales are fixed. The normalised :math:`x / s(x)` then carries :math:`x`'s permutation with
  its scale fixed, as after ``nn.RMSNorm``;
* a parameter vector times features whose scales are all fixed (the gain :math:`\gamma` after the
  normalisation) opens a new scale, on :math:`\gamma` (power +1) and, through the walk, on the columns of
  the next layers (power -1), as a LayerNorm's ``weight`` does:
  :math:`(\mu\gamma) \odot \hat x` read by :math:`W\,\mathrm{diag}(\mu)^{-1}` is the same function.

When the gain multiplies :math:`x \cdot \mathrm{rsqrt}(\mathrm{mean}(x^2) + \epsilon)` its weight is recorded
as an RMSNorm's (``Records.norms``, kind ``"rms"``). Every rule is ``rule(walker, node, op) -> state``.
"""

from __future__ import annotations

import torch.fx

from symlib.symmetry.trace import channelwise
from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, Seg, State
from symlib.symmetry.trace.walker import module_path, name_of


# --------------------------------------------------------------------------------------- statistics
def reduce(w, node, op=None) -> State:
    """mean / sum / amax: over the labelled feature axis a statistic (module docstring), else
    :func:`.channelwise.reduce` (a pool over positions)."""
    st = w.input(node)
    src = w.tensor_args(node)[0]
    dims = w.arg(node, 1, "dim")
    if w.is_fixed(st) or dims is None:
        return channelwise.reduce(w, node, op)
    nd = len(w.shape(src))
    dims = {d % nd for d in ((dims,) if isinstance(dims, int) else tuple(dims))}
    if st.axis not in dims or 0 in dims:
        return channelwise.reduce(w, node, op)
    layer = module_path(node) or node.name
    why = "normalises across features (a statistic over them), so no per-feature scaling"
    if src.name in w.no_scaling:  # x.pow(2) fixed the scales first: the norm is the reason, named by module
        del w.no_scaling[src.name]
        w.no_scaling[layer] = why
    w.fix_scales(st, layer, why)
    return UNLABELLED


# ---------------------------------------------------------------------------------------------- gains
def mul(w, node, op=None) -> State:
    """``a * b``: a parameter vector times features whose scales are fixed opens a scale (module
    docstring); anything else is :func:`.channelwise.mul`."""
    found = _gain(w, node)
    if found is None:
        return channelwise.mul(w, node, op)
    st, attr = found
    pa = attr.param_axis(st.axis - (len(w.shape(node)) - len(attr.shape)))
    layer = module_path(node) or attr.name.rsplit(".", 1)[0]
    out = []
    for s in st.segs:
        new = w.new(layer, s.n)
        w.perm_uf.union(new, FIXED)  # only its scale is new
        out.append(Seg(s.perm, new, s.n, s.inner))
    w.weights.add(attr.name)
    w.act_on(attr.name, pa, out, 1)
    if _normalised_by_rms(w, node):
        w.norms[attr.name] = "rms"
    return State(st.axis, tuple(out), st.producer)


def _gain(w, node) -> tuple[State, Attr] | None:
    """``(features, parameter)`` when ``node`` multiplies labelled features whose scales are all fixed by a
    parameter vector along their labelled axis (size 1 elsewhere), and nothing else; else ``None``."""
    args = list(node.args[:2]) + [node.kwargs[k] for k in ("other",) if k in node.kwargs]
    if len(args) != 2 or not all(isinstance(a, torch.fx.Node) for a in args):
        return None
    states = [w.states.get(a) for a in args]
    feats = [s for s in states if isinstance(s, State) and not w.is_fixed(s)]
    attrs = [s for s in states if isinstance(s, Attr) and s.in_state_dict and not s.opaque]
    if len(feats) != 1 or len(attrs) != 1:
        return None
    st, attr = feats[0], attrs[0]
    nd = len(w.shape(node))
    shape = (1,) * (nd - len(attr.shape)) + tuple(attr.shape)
    axis = st.axis
    if shape[axis] != w.shape(node)[axis] or any(n != 1 for i, n in enumerate(shape) if i != axis):
        return None
    if attr.param_axis(axis - (nd - len(attr.shape))) is None:
        return None
    if any(w.scale_uf.find(s.scale) != FIXED for s in st.segs):
        return None
    return st, attr


_COPIES = {"to", "_to_copy", "alias", "contiguous", "clone", "type_as", "float", "double"}


def _through_copies(x):
    while isinstance(x, torch.fx.Node) and x.op in ("call_function", "call_method") and \
            name_of(x.target) in _COPIES and x.args:
        x = x.args[0]
    return x


def _normalised_by_rms(w, node) -> bool:
    """Whether the features of the gain ``node`` are ``x * rsqrt(mean(x ** 2, -1) + eps)`` (or
    ``x / sqrt(...)``), copies and casts aside."""
    feats = next(a for a in node.args[:2] if isinstance(w.states.get(a), State))
    prod = _through_copies(feats)
    if not isinstance(prod, torch.fx.Node) or name_of(prod.target) not in ("mul", "div", "truediv") \
            or len(prod.args) != 2:
        return False
    x, r = (_through_copies(a) for a in prod.args)
    want = "div" if name_of(prod.target) != "mul" else "mul"
    for a, b in ((x, r), (r, x)) if want == "mul" else ((x, r),):
        root = {"mul": "rsqrt", "div": "sqrt"}[want]
        if isinstance(b, torch.fx.Node) and name_of(b.target) == root:
            stat = b.args[0]
            if isinstance(stat, torch.fx.Node) and name_of(stat.target) in ("add", "__add__"):
                stat = stat.args[0]
            if isinstance(stat, torch.fx.Node) and name_of(stat.target) == "mean":
                sq = stat.args[0]
                if isinstance(sq, torch.fx.Node) and name_of(sq.target) in ("pow", "__pow__") \
                        and sq.args[1:2] == (2,) and _through_copies(sq.args[0]) == a:
                    return True
    return False
