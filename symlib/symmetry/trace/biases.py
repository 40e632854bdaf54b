r"""The redundant bias directions of a traced transformer (``Spec.shifts``; the maths:
:mod:`symlib.symmetry.biases`), found by one pass over the graph after the walk, which it does not touch.

* A sum of token vectors (a tree of ``add`` whose inner sums have no other reader) whose terms are: a
  parameter with one row per token (a learned position embedding), a concatenation along the tokens of
  parameters (class and distillation tokens) and of a biased layer's output moved to tokens (a patch
  embedding: ``flatten``, ``transpose``), a biased layer's output, or a gathered embedding table. Against
  a position embedding, each part of the concatenation gives a direction on its own rows (``"token"``,
  ``"patch"``); two summed tables give one (``"table"``), and so do two summed biased layers (``"sum"``:
  a distilled DeiT's two heads). Every parameter on the way is read there only.
* A LayerNorm with a bias whose output only affine layers with biases read (``Linear``, ``F.linear``,
  ``addmm`` with a ``(d, out)`` weight as in GPT-2's ``Conv1D``, the input projection of
  ``nn.MultiheadAttention`` reading it as query, key and value), possibly through a choice of tokens
  (``x[:, 0]``), a reshape that keeps the features last, dropout or a dtype conversion (``"norm"``).

Anything else gives no direction: the spec is then smaller than the group, never wrong.
"""

from __future__ import annotations

import torch.fx
from torch import nn

from symlib.symmetry.spec import BiasShift
from symlib.symmetry.trace.walker import name_of

_PASS = {"dropout", "to", "_to_copy", "contiguous", "clone", "alias", "type_as", "float", "double"}
_VIEWS = {"expand", "unsqueeze", "view", "reshape", "_unsafe_view", "to", "_to_copy", "contiguous", "alias",
          "clone"}
_MOVES = {"flatten", "transpose", "permute", "view", "reshape", "_unsafe_view", "contiguous", "t"}
_TOKENS = {"getitem", "select", "slice", "view", "reshape", "_unsafe_view", "flatten", "squeeze", "unsqueeze",
           "narrow", "contiguous"}
_IGNORED = {"_assert_tensor_metadata", "sym_size", "size", "getattr", "dim"}


def find(gm: torch.fx.GraphModule, model: nn.Module) -> tuple[BiasShift, ...]:
    """The redundant bias directions of ``model`` traced as ``gm`` (module docstring), in graph order."""
    modules = dict(gm.named_modules())
    names = {k: v.numel() for k, v in model.state_dict().items()}  # name -> entries
    out: list[BiasShift] = []
    for node in gm.graph.nodes:
        if _op(node, modules) == "add" and not _inner_sum(node, modules):
            out += _sum_shifts(node, modules, names)
        if _op(node, modules) in ("layer_norm", "LayerNorm"):
            shift = _norm_shift(node, modules, names)
            if shift is not None:
                out.append(shift)
    return tuple(out)


# ------------------------------------------------------------------------------------------ helpers
def _op(node, modules) -> str:
    if node.op == "call_module":
        mod = modules.get(node.target)
        if isinstance(mod, (nn.Identity, nn.Dropout)):
            return "dropout"
        return type(mod).__name__
    if node.op in ("call_function", "call_method"):
        return name_of(node.target)
    return node.op


def _users(node, modules) -> list:
    """The readers of ``node``, without shape queries and metadata checks."""
    return [u for u in node.users if _op(u, modules) not in _IGNORED]


def _shape(node):
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _tensor_args(node) -> list:
    return [a for a in node.args if isinstance(a, torch.fx.Node)]


def _param(node, modules, names) -> str | None:
    """The parameter that ``node`` is a view of, read nowhere else (``cls.expand(B, -1, -1)``)."""
    while node.op != "get_attr":
        if _op(node, modules) not in _VIEWS or not _tensor_args(node):
            return None
        node = _tensor_args(node)[0]
        if len(_users(node, modules)) != 1:
            return None
    return node.target if node.target in names and len(_users(node, modules)) == 1 else None


def _get(node, i: int, key: str):
    return node.args[i] if len(node.args) > i else node.kwargs.get(key)


def _attr(node) -> str | None:
    return node.target if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None


def _biased(node, modules, names) -> str | None:
    """The bias of the layer whose output ``node`` is (moved to tokens by ``flatten`` and ``transpose``),
    when that output is read nowhere else and holds its features last: a convolution's output counts only
    once a ``transpose`` or ``permute`` has moved its channels (a patch embedding), never as it comes
    (channels first, where the sum's last axis is a spatial one)."""
    moved = False
    while True:
        op = _op(node, modules)
        if op in _MOVES or op == "dropout":
            moved = moved or op in ("transpose", "permute", "t")
            node = _tensor_args(node)[0]
            if len(_users(node, modules)) != 1:
                return None
            continue
        break
    if node.op == "call_module":
        mod = modules[node.target]
        ok = (isinstance(mod, nn.Linear) or (isinstance(mod, nn.modules.conv._ConvNd) and moved)) \
            and mod.bias is not None
        return f"{node.target}.bias" if ok and f"{node.target}.bias" in names else None
    if op == "linear" or (op in ("conv2d", "conv1d", "conv3d", "convolution") and moved):
        bias = _attr(_get(node, 2, "bias"))
        return bias if bias in names else None
    return None


def _table(node, modules, names) -> str | None:
    """The embedding table that ``node`` gathers rows of, read nowhere else."""
    while _op(node, modules) in _PASS:
        node = _tensor_args(node)[0]
    op = _op(node, modules)
    if node.op == "call_module" and isinstance(modules[node.target], nn.Embedding):
        table = f"{node.target}.weight"
    elif op == "embedding":  # aten.embedding(weight, ids); F.embedding(ids, weight)
        args = _tensor_args(node)
        table = next((_attr(a) for a in args if _attr(a)), None)
        attr = next((a for a in args if _attr(a)), None)
        if attr is None or len(_users(attr, modules)) != 1:
            return None
    else:
        return None
    return table if table in names else None


# -------------------------------------------------------------------------------- sums of token vectors
def _inner_sum(node, modules) -> bool:
    users = _users(node, modules)
    return len(users) == 1 and _op(users[0], modules) == "add"


def _leaves(node, modules) -> list:
    out = []
    for a in _tensor_args(node):
        if _op(a, modules) == "add" and len(_users(a, modules)) == 1:
            out += _leaves(a, modules)
        else:
            out.append(a)
    return out


def _sum_shifts(node, modules, names) -> list[BiasShift]:
    shape = _shape(node)
    leaves = _leaves(node, modules)
    if shape is None or len(shape) < 2 or len(leaves) < 2:
        return []
    d, tokens = shape[-1], shape[-2]
    pos, rest = None, []
    for leaf in leaves:
        p = _param(leaf, modules, names)
        leaf_shape = _shape(leaf)
        if p is not None and pos is None and leaf_shape and tuple(leaf_shape[-2:]) == (tokens, d):
            pos = p
        else:
            rest.append(leaf)
    whole: list[tuple[str, str]] = []  # (param, kind) moving on every row
    out = []
    for leaf in rest:
        table, bias = _table(leaf, modules, names), _biased(leaf, modules, names)
        if table is not None:
            whole.append((table, "table"))
        elif bias is not None:
            whole.append((bias, "patch"))
        elif pos is not None and _op(leaf, modules) == "cat" and len(_users(leaf, modules)) == 1:
            out += _cat_shifts(leaf, pos, modules, names)
    if pos is not None:
        out += [BiasShift(((p, 0, _rows(p, names, d)),), ((pos, 0, tokens),), kind=k) for p, k in whole]
    elif len(whole) > 1:
        first = whole[0][0]
        kind = "table" if all(k == "table" for _, k in whole) else "sum"
        out += [BiasShift(((first, 0, _rows(first, names, d)),), ((p, 0, _rows(p, names, d)),), kind=kind)
                for p, _ in whole[1:]]
    return out


def _rows(param: str, names, d: int) -> int:
    return names[param] // d


def _cat_shifts(node, pos: str, modules, names) -> list[BiasShift]:
    """A concatenation along the tokens against position embedding ``pos``: a direction per part that is a
    token parameter or a biased layer's output, on that part's rows of ``pos``."""
    parts = _get(node, 0, "tensors")
    dim = _get(node, 1, "dim") or 0
    shape = _shape(node)
    if not isinstance(parts, (list, tuple)) or shape is None or dim % len(shape) != len(shape) - 2:
        return []
    out, start = [], 0
    for part in parts:
        n = _shape(part)[dim]
        token, bias = _param(part, modules, names), _biased(part, modules, names)
        if token is not None:
            out.append(BiasShift(((token, 0, n),), ((pos, start, start + n),), kind="token"))
        elif bias is not None:
            out.append(BiasShift(((bias, 0, 1),), ((pos, start, start + n),), kind="patch"))
        start += n
    return out


# ------------------------------------------------------------------------------------------ LayerNorms
def _norm_shift(node, modules, names) -> BiasShift | None:
    if node.op == "call_module":
        mod = modules[node.target]
        bias = f"{node.target}.bias" if getattr(mod, "bias", None) is not None else None
        shape = tuple(mod.normalized_shape)
    else:
        bias = _attr(_get(node, 3, "bias"))
        shape = tuple(_get(node, 1, "normalized_shape") or ())
    if bias not in names or len(shape) != 1:
        return None
    d = shape[0]
    readers, todo, seen = [], [node], set()
    while todo:
        cur = todo.pop()
        for u in _users(cur, modules):
            if u in seen:
                continue
            seen.add(u)
            reader = _reader(u, cur, modules, names, d)
            if reader is not None:
                readers.append(reader)
                continue
            op, out = _op(u, modules), _shape(u)
            if (op in _PASS or op in _TOKENS) and out and out[-1] == d and _tensor_args(u)[0] is cur:
                todo.append(u)
                continue
            return None
    return BiasShift(((bias, 0, 1),), readers=tuple(dict.fromkeys(readers)), kind="norm") if readers else None


def _reader(u, cur, modules, names, d: int) -> tuple[str, str, bool] | None:
    """``(weight, bias, transposed)`` of an affine layer with a bias that reads ``cur`` as its input."""
    op = _op(u, modules)
    if u.op == "call_module":
        mod = modules[u.target]
        if isinstance(mod, nn.Linear) and mod.bias is not None and u.args[0] is cur:
            return f"{u.target}.weight", f"{u.target}.bias", False
        mha = isinstance(mod, nn.MultiheadAttention) and mod._qkv_same_embed_dim
        if (mha and mod.in_proj_bias is not None and len(_tensor_args(u)) >= 3
                and all(a is cur for a in _tensor_args(u)[:3])):
            return f"{u.target}.in_proj_weight", f"{u.target}.in_proj_bias", False
        return None
    if op == "linear" and _get(u, 0, "input") is cur:
        w, b = _attr(_get(u, 1, "weight")), _attr(_get(u, 2, "bias"))
        return (w, b, False) if w in names and b in names else None
    if op == "addmm" and len(u.args) >= 3 and u.args[1] is cur:
        b, w = _attr(u.args[0]), _attr(u.args[2])
        return (w, b, True) if w in names and b in names else None
    return None
