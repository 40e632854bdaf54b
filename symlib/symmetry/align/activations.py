r"""Activation matching: the permutations that pair the neurons of two networks by how their outputs correlate
on a batch (Ainsworth, Hayase & Srinivasa 2023, "Git Re-Basin"; book: chapter "Transformers").

For every permutation label, the features :math:`z^a_i(x), z^b_j(x)` that the label permutes are recorded
on a batch :math:`x` (every token and spatial position counts as a sample), standardised, and compared by
their correlation matrix :math:`C_{ij} = \mathrm{corr}(z^a_i, z^b_j)`, summed over every layer that
writes the label (a residual stream is written by several). The features are the rows a label permutes
of the weights that produce them:

* the output of a ``Linear`` (its last axis), a convolution (its channel axis, grouped or not) or a
  Hugging Face ``Conv1D`` (GPT-2's projections, last axis), or the slice of it a label acts on (a fused
  query-key-value projection);
* the queries, keys or values of an ``nn.MultiheadAttention``, computed from its inputs and the slice of
  ``in_proj_weight`` the label acts on;
* a label whose entries cover ``m`` consecutive features each (one entry per rotary head, whose features
  cannot move inside it) compares entries by :math:`C_{ij} = \sum_{t<m} \mathrm{corr}(z^a_{i,t},
  z^b_{j,t})`.

A label whose features no layer outputs but which holds one entry per block of a tie (T5's relative
position bias table, one column per head) takes the tie's block permutation. A label without blocks
takes :math:`P = \arg\max_P \sum_i C_{i,P(i)}`, one linear assignment
(``scipy.optimize.linear_sum_assignment``). A label whose permutations respect ``G`` blocks (attention
heads, groups of a grouped convolution; ``Spec.blocks``) is matched in two levels, as heads are in
the model-merging literature: the score of pairing block :math:`g` of ``a`` with block :math:`h` of
``b`` is the best assignment inside them, :math:`S_{gh} = \max_\pi \sum_i C_{gk+i,\,hk+\pi(i)}`,
summed over every label that shares the block permutation (a head's queries and keys with its values);
one assignment over :math:`S` pairs the blocks (the identity when the blocks may not move), and the
assignment inside each pair of blocks orders their features. A network's features at one label do not
depend on its permutations of the other labels, so every label is solved on one forward pass per
network.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from symlib.params import Params
from symlib.symmetry.spec import Spec, SymmetryError

__all__ = ["activation_perms"]

OUTPUT = 3  # an nn.MultiheadAttention's output (its out_proj is applied through its weight, not called)


@dataclasses.dataclass(frozen=True)
class _Opener:
    """Where the features of a label are read: module ``module``, the ``n * inner`` features that begin at
    ``start`` of its output (for ``nn.MultiheadAttention``: of its projection of input ``which``, 0 query,
    1 key, 2 value, or of its attention output, ``which = OUTPUT``)."""

    module: str
    start: int
    n: int
    inner: int
    which: int = -1


def _opener(a, spec: Spec, modules: dict[str, nn.Module]) -> _Opener | None:
    """The opener of one action, or ``None`` when the action does not permute the features a module
    outputs (an input axis, a bias, a norm's gain, a grouped input axis)."""
    n = spec.perms[a.perm]
    if a.param.endswith(".in_proj_weight") and a.axis == 0:
        name = a.param[: -len(".in_proj_weight")]
        mod = modules.get(name)
        if isinstance(mod, nn.MultiheadAttention) and mod._qkv_same_embed_dim:
            e = mod.embed_dim
            return _Opener(name, a.start % e, n, a.inner, a.start // e)
        return None
    if not a.param.endswith(".weight") or a.groups != 1:
        return None
    name = a.param[: -len(".weight")]
    mod = modules.get(name)
    parent, _, leaf = name.rpartition(".")
    if leaf == "out_proj" and isinstance(modules.get(parent), nn.MultiheadAttention) and a.axis == 0:
        return _Opener(parent, a.start, n, a.inner, OUTPUT)  # called through its weight, not as a module
    if isinstance(mod, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d) and a.axis == 0:
        return _Opener(name, a.start, n, a.inner)
    if type(mod).__name__ == "Conv1D" and a.axis == 1 and getattr(mod, "weight", None) is not None:
        return _Opener(name, a.start, n, a.inner)  # Hugging Face's transposed linear layer (GPT-2)
    return None


def openers(spec: Spec, model: nn.Module) -> dict[str, list[_Opener]]:
    """For every permutation label, the places its features can be recorded (module docstring)."""
    modules = dict(model.named_modules())
    out: dict[str, list[_Opener]] = {k: [] for k in spec.perms}
    for a in spec.actions:
        if a.perm is None or a.power < 0:
            continue
        op = _opener(a, spec, modules)
        if op is not None and op not in out[a.perm]:
            out[a.perm].append(op)
    return out


def _record(model: nn.Module, params: Params, x: torch.Tensor, where: list[_Opener]
            ) -> dict[_Opener, torch.Tensor]:
    """The features of every opener on inputs ``x``, each as ``(samples, n, inner)``."""
    got: dict[_Opener, torch.Tensor] = {}
    modules = dict(model.named_modules())
    by_module: dict[str, list[_Opener]] = {}
    for op in where:
        by_module.setdefault(op.module, []).append(op)

    def hook(ops: list[_Opener]):
        def fn(module, args, kwargs, output):
            for op in ops:
                if op.which == OUTPUT:
                    z = output[0][..., op.start: op.start + op.n * op.inner]
                elif op.which >= 0:  # MultiheadAttention: project the query, key or value input ourselves
                    names = ("query", "key", "value")
                    inp = args[op.which] if len(args) > op.which else kwargs[names[op.which]]
                    e = module.embed_dim
                    lo = op.which * e + op.start
                    hi = lo + op.n * op.inner
                    bias = module.in_proj_bias[lo:hi] if module.in_proj_bias is not None else None
                    z = F.linear(inp, module.in_proj_weight[lo:hi], bias)
                else:
                    conv = isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d)
                    z = output.movedim(1, -1) if conv else output  # channels last
                    z = z[..., op.start: op.start + op.n * op.inner]
                got[op] = z.detach().reshape(-1, op.n, op.inner)
        return fn

    handles = [modules[m].register_forward_hook(hook(ops), with_kwargs=True) for m, ops in by_module.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            torch.func.functional_call(model, params, (x,), tie_weights=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return got


def _standardized(z: torch.Tensor) -> torch.Tensor:
    z = z.to(torch.float64)
    z = z - z.mean(0)
    return z / (z.norm(dim=0) + 1e-12)


def _correlation(za: torch.Tensor, zb: torch.Tensor) -> torch.Tensor:
    """``C[i, j] = sum_t corr(za[:, i, t], zb[:, j, t])`` for features ``(samples, n, inner)``."""
    return torch.einsum("sit,sjt->ij", _standardized(za), _standardized(zb))


def _assign(cost: np.ndarray) -> tuple[np.ndarray, float]:
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(cost, maximize=True)
    return cols, float(cost[rows, cols].sum())


def _followers(spec: Spec, where: dict[str, list[_Opener]]) -> set[str]:
    """Labels without recorded features that follow their tie's block permutation alone: one entry per
    block (a table of one column per head, as T5's relative position bias), tied with a label whose
    features are recorded and that has as many blocks."""
    out = set()
    for tie, labels in spec.tie_classes().items():
        if tie is None:
            continue
        for q in labels:
            g = spec.blocks[q][0]
            seen = any(where[x] and spec.blocks[x][0] == g for x in labels)
            if not where[q] and spec.perms[q] == g and seen:
                out.add(q)
    return out


def _blockwise(corrs: dict[str, np.ndarray], groups: int, movable: bool,
               followers: list[str] = ()) -> dict[str, np.ndarray]:
    """Two-level assignment of labels that share one block permutation (module docstring); each of
    ``followers`` (one entry per block) takes the block permutation itself."""
    inside: dict[tuple[str, int, int], np.ndarray] = {}
    score = np.zeros((groups, groups))
    pairs = [(g, h) for g in range(groups) for h in range(groups) if movable or g == h]
    for label, c in corrs.items():
        k = c.shape[0] // groups
        for g, h in pairs:
            cols, value = _assign(c[g * k:(g + 1) * k, h * k:(h + 1) * k])
            inside[label, g, h] = cols
            score[g, h] += value
    sigma = _assign(score)[0] if movable else np.arange(groups)
    out = {}
    for label, c in corrs.items():
        k = c.shape[0] // groups
        out[label] = np.concatenate([sigma[g] * k + inside[label, g, sigma[g]] for g in range(groups)])
    out.update({label: np.asarray(sigma) for label in followers})
    return out


def activation_perms(a: Params, b: Params, spec: Spec, model: nn.Module, batch: torch.Tensor | tuple
                     ) -> dict[str, torch.Tensor]:
    r"""Activation matching: for every label, the permutation of ``b``'s neurons that maximises the summed
    correlation of their features with ``a``'s on ``batch``, respecting the label's blocks (module
    docstring).

    Args:
        a, b: one network each, of ``spec``'s architecture.
        spec: the symmetries of ``model``.
        model: the network; its layers' outputs are recorded with forward hooks (it is not modified).
        batch: inputs ``(n, *input_shape)``, or ``(inputs, targets)``.

    Returns:
        ``{label: perm}``; ``ops.permute(b, spec, perms)`` is ``b`` matched to ``a``.

    Raises:
        SymmetryError: a label whose features no recordable layer produces (a layer this module does not
            know, e.g. a custom projection); weight matching (``how="weights"``) needs no activations.
    """
    x = batch[0] if isinstance(batch, tuple | list) else batch
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        raise ValueError("batch must be a tensor of inputs (n, *input_shape), or (inputs, targets)")
    where = openers(spec, model)
    followers = _followers(spec, where)
    for label, ops in where.items():
        if not ops and label not in followers:
            raise SymmetryError(
                f"label {label!r} is written by no Linear, convolution, Conv1D or MultiheadAttention "
                f"projection whose outputs could be recorded, so activation matching cannot see its "
                f"features; merge with how='weights'")
    ref = next(iter(a.values()))
    if x.is_floating_point():
        x = x.to(ref.dtype if ref.is_floating_point() else x.dtype)
    x = x.to(ref.device)
    every = [op for ops in where.values() for op in ops]
    za, zb = _record(model, a, x, every), _record(model, b, x, every)
    corrs = {label: sum(_correlation(za[op], zb[op]) for op in ops).cpu().numpy()
             for label, ops in where.items() if ops}
    cols: dict[str, np.ndarray] = {}
    for label, c in corrs.items():
        if label not in spec.blocks:
            cols[label] = _assign(c)[0]
    for tie, labels in spec.tie_classes().items():
        for groups in sorted({spec.blocks[q][0] for q in labels}):
            same = [q for q in labels if spec.blocks[q][0] == groups]
            cols.update(_blockwise({q: corrs[q] for q in same if q in corrs}, groups, movable=tie is not None,
                                   followers=[q for q in same if q in followers]))
    return {label: torch.as_tensor(np.asarray(cols[label]), dtype=torch.long, device=ref.device)
            for label in spec.perms}
