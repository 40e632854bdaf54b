r"""Which tensors of a checkpoint file are the network's: its state dict and prefix (book: "symlib on your
own network").

A file may hold more than a network's ``state_dict``: a Lightning ``.ckpt`` keeps it under
``"state_dict"`` with the LightningModule's attribute as a prefix (``model.conv1.weight``) beside the
optimizer's state; a training loop may save ``{"model": ..., "optimizer": ..., "epoch": ...}``; a model
wrapped by ``DataParallel`` or ``torch.compile`` prefixes every name with ``module.`` or ``_orig_mod.``.
:func:`select` finds the network's tensors:

* the *state dict*: the file itself when it maps names to tensors, else a mapping of names to tensors
  inside it (optimizer, scheduler, loop and callback states are never candidates): the only one, or
  ``"state_dict"`` (Lightning, timm), or the one that holds the architecture's tensors, or the one named
  by ``key``;
* the *prefix*: with the architecture (a :class:`Reference`), the one prefix under which every tensor of
  the architecture is found (tensors the architecture ties to others may be absent, as
  ``save_pretrained`` leaves them); without it, ``module.`` and ``_orig_mod.`` wrappers, and for a Lightning
  checkpoint the attribute that holds every tensor, are removed; or the ``prefix`` given.

A missing or ambiguous choice is an error that lists the candidates. With the architecture, a file whose
tensors all carry one more leading axis holds a stack of networks (samples saved with ``torch.save``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from symlib.ckpt.errors import CheckpointError
from symlib.ckpt.lazy import Parsed, Ref
from symlib.models.recipe import Recipe

__all__ = ["SKIP", "WRAPPERS", "Reference", "Selection", "candidates", "dtype_kind", "select", "shape_of"]

#: Parts of a checkpoint that are never the network's weights (matched in the names of nested keys).
SKIP = ("optim", "sched", "scaler", "loops", "callbacks", "hyper_parameters", "hparams", "lr_")
#: Prefixes that wrappers add to every name (``DataParallel``/``DistributedDataParallel``, ``torch.compile``).
WRAPPERS = ("module.", "_orig_mod.")


def shape_of(leaf: Ref | torch.Tensor) -> tuple[int, ...]:
    """The shape of a tensor of a file, read or not."""
    return tuple(leaf.shape)


def dtype_kind(dtype: torch.dtype) -> str:
    """``"float"``, ``"complex"``, ``"bool"``, ``"unsigned"`` or ``"signed"``: what a checkpoint's tensor
    must share with the network's (its precision may differ: a float16 copy of float32 weights loads)."""
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    if dtype == torch.bool:
        return "bool"
    return "unsigned" if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else "signed"


def _is_tensor(x: Any) -> bool:
    return isinstance(x, Ref | torch.Tensor)


@dataclasses.dataclass(frozen=True)
class Reference:
    """The tensors of one network of the wanted architecture.

    Attributes:
        shapes: ``{name: shape}`` of its ``state_dict``.
        ties: ``{name: (name, other names)}`` for tensors that are one object under several names (tied
            weights): a file may hold any one of them.
        what: the architecture, for messages.
        kinds: ``{name: kind}`` of each tensor's dtype (:func:`dtype_kind`); a file's tensor of another
            kind (a float weight read as integers: a damaged header) is refused.
    """

    shapes: dict[str, tuple[int, ...]]
    ties: dict[str, tuple[str, ...]]
    what: str
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)

    def names(self, k: str) -> tuple[str, ...]:
        """``k`` and the names tied to it."""
        return self.ties.get(k, (k,))

    @classmethod
    def of(cls, model: torch.nn.Module, what: str | None = None) -> Reference:
        """The reference of a module (built on the meta device or not)."""
        sd = model.state_dict(keep_vars=True)
        groups: dict[int, list[str]] = {}
        for k, v in sd.items():
            groups.setdefault(id(v), []).append(k)
        ties = {k: (k, *[o for o in g if o != k]) for g in groups.values() if len(g) > 1 for k in g}
        return cls({k: tuple(v.shape) for k, v in sd.items()}, ties, what or type(model).__name__,
                   {k: dtype_kind(v.dtype) for k, v in sd.items()})

    @classmethod
    def of_recipe(cls, recipe: Recipe) -> Reference:
        """The names and shapes of one network of ``recipe`` (built on the meta device)."""
        return cls.of(recipe.build(meta=True), recipe.describe())


@dataclasses.dataclass(frozen=True)
class Selection:
    """The network's tensors in one file.

    Attributes:
        key: where the state dict is in the file (``""``: the file is one; ``"state_dict"``, ...).
        prefix: removed from its names.
        names: ``{network tensor name: name in the state dict}``.
        n: networks in the file (more than 1 for a stack: every tensor has one more leading axis).
    """

    key: str
    prefix: str
    names: dict[str, str]
    n: int = 1


def _walk(obj: Any, path: str, depth: int, out: dict[str, Mapping]) -> None:
    if not isinstance(obj, Mapping) or not obj:
        return
    if all(isinstance(k, str) for k in obj) and all(_is_tensor(v) or v is None for v in obj.values()) \
            and any(_is_tensor(v) for v in obj.values()):
        out[path] = {k: v for k, v in obj.items() if v is not None}
        return
    if depth >= 3:
        return
    for k, v in obj.items():
        if isinstance(k, str) and not any(s in k.lower() for s in SKIP):
            _walk(v, f"{path}.{k}" if path else k, depth + 1, out)


def candidates(obj: Any) -> dict[str, Mapping[str, Ref | torch.Tensor]]:
    """Every mapping of names to tensors in a file's content: ``{where: mapping}`` (``""``: the top)."""
    out: dict[str, Mapping] = {}
    _walk(obj, "", 0, out)
    return out


def _groups(names) -> str:
    counts: dict[str, int] = {}
    for n in names:
        head = n.split(".", 1)[0] + "." if "." in n else n
        counts[head] = counts.get(head, 0) + 1
    return ", ".join(f"{h!r} ({c} tensors)" for h, c in sorted(counts.items())[:12]) + (
        ", ..." if len(counts) > 12 else "")


def _prefixes(names: Mapping[str, Any], ref: Reference) -> list[str]:
    if not ref.shapes:
        return []
    k0 = max(ref.shapes, key=lambda k: (k not in ref.ties, len(k)))
    found = []
    for n in names:
        for alt in ref.names(k0):
            if n.endswith(alt):
                p = n[: len(n) - len(alt)]
                if (p == "" or p.endswith(".")) and all(
                        any(p + a in names for a in ref.names(k)) for k in ref.shapes):
                    found.append(p)
    return sorted(set(found))


def _where(key: str) -> str:
    return "the file itself" if key == "" else repr(key)


def _choose_dict(parsed: Parsed, dicts: dict[str, Mapping], ref: Reference | None, key: str | None) -> str:
    path = parsed.path
    listing = "; ".join(f"{_where(k)} ({len(v)} tensors)" for k, v in dicts.items())
    if key is not None:
        if key not in dicts:
            raise CheckpointError(f"{path}: no state dict under key {key!r}; the file holds: "
                                  f"{listing or 'none'}")
        return key
    if not dicts:
        obj = parsed.obj
        top = sorted(map(str, obj))[:12] if isinstance(obj, Mapping) else type(obj).__name__
        raise CheckpointError(f"{path}: holds no state dict (a mapping of names to tensors); its content: "
                              f"{top}")
    if "" in dicts:
        return ""
    if ref is not None:
        fits = [k for k, v in dicts.items() if _prefixes(v, ref)]
        if len(fits) == 1:
            return fits[0]
        if len(fits) > 1:
            raise CheckpointError(f"{path}: several state dicts hold the tensors of {ref.what}: "
                                  f"{', '.join(map(_where, fits))}; choose one with key= (--key)")
        return "state_dict" if "state_dict" in dicts else next(iter(dicts))  # the prefix check names it
    if "state_dict" in dicts:
        return "state_dict"
    if len(dicts) == 1:
        return next(iter(dicts))
    raise CheckpointError(f"{path}: holds several state dicts: {listing}; choose one with key= (--key), or "
                          f"pass the architecture (model=, --model) to find the one that fits")


def _choose_prefix(parsed: Parsed, sd: Mapping, ref: Reference | None, prefix: str | None, where: str) -> str:
    path = parsed.path
    if prefix is not None:
        if prefix and not any(n.startswith(prefix) for n in sd):
            raise CheckpointError(f"{path}: no tensor of {where} starts with prefix {prefix!r}; its names "
                                  f"start with: {_groups(sd)}")
        return prefix
    if ref is not None:
        found = _prefixes(sd, ref)
        if len(found) == 1:
            return found[0]
        if not found:
            first = next(iter(ref.shapes), "?")
            raise CheckpointError(
                f"{path}: the tensors of {ref.what} (e.g. {first!r}) are not all in {where} under any "
                f"prefix; its names start with: {_groups(sd)}. Another architecture? Else pass prefix= "
                f"(--prefix) or key= (--key)"
            )
        raise CheckpointError(f"{path}: the tensors of {ref.what} are in {where} under several prefixes: "
                              f"{found}; choose one with prefix= (--prefix)")
    p = ""
    names = list(sd)
    changed = True
    while changed:
        changed = False
        for w in WRAPPERS:
            if names and all(n.startswith(p + w) for n in names):
                p += w
                changed = True
    if parsed.kind == "lightning":
        heads = {n[len(p):].split(".", 1)[0] for n in names if "." in n[len(p):]}
        if len(heads) == 1 and all("." in n[len(p):] for n in names):
            p += heads.pop() + "."
    return p


def _n_stacked(parsed: Parsed, sd: Mapping, names: dict[str, str], ref: Reference) -> int:
    counts = set()
    for k, n in names.items():
        have, want = shape_of(sd[n]), ref.shapes[k]
        kind = dtype_kind(sd[n].dtype)
        if ref.kinds.get(k, kind) != kind:
            raise CheckpointError(f"{parsed.path}: tensor {n!r} holds {str(sd[n].dtype)[6:]} values, but "
                                  f"{ref.what} has {ref.kinds[k]} values for {k!r}: the file's header is "
                                  f"damaged, or it is another network's")
        if have == want:
            counts.add(None)
        elif len(have) == len(want) + 1 and have[1:] == want:
            counts.add(have[0])
        else:
            raise CheckpointError(f"{parsed.path}: tensor {n!r} has shape {have}, but {ref.what} has {want} "
                                  f"for {k!r}: another architecture or width?")
    if len(counts) > 1:
        raise CheckpointError(f"{parsed.path}: some tensors carry a leading axis of networks and others do "
                              f"not ({sorted(map(str, counts))}); save one network per file, or a stack with "
                              f"one leading axis on every tensor")
    got = counts.pop()
    return 1 if got is None else int(got)


def select(parsed: Parsed, ref: Reference | None = None, prefix: str | None = None,
           key: str | None = None) -> Selection:
    """Find the network's tensors in a parsed file (module docstring).

    Args:
        parsed: the file.
        ref: the architecture's tensors (names, shapes, ties), if known.
        prefix: the prefix to remove (``""``: none), instead of finding it.
        key: where the state dict is in the file (``"state_dict"``, ``"model"``, ...), instead of finding it.

    Raises:
        CheckpointError: no state dict, several that fit, a prefix that matches nothing or several, a
            tensor the architecture lacks or has with another shape.
    """
    if isinstance(parsed.obj, Mapping) and "pytorch-lightning_version" in parsed.obj:
        parsed.kind = "lightning"
    dicts = candidates(parsed.obj)
    where = _choose_dict(parsed, dicts, ref, key)
    sd = dicts[where]
    what = "the file" if where == "" else f"its state dict {where!r}"
    p = _choose_prefix(parsed, sd, ref, prefix, what)
    if ref is None:
        names = {n[len(p):]: n for n in sd if n.startswith(p)}
        return Selection(where, p, names, 1)
    names = {}
    for k in ref.shapes:
        have = [p + a for a in ref.names(k) if p + a in sd]
        if not have:
            raise CheckpointError(f"{parsed.path}: tensor {p + k!r} of {ref.what} is missing from {what} "
                                  f"(another architecture?)")
        names[k] = have[0]
    used = set(names.values())
    extra = [n for n in sd if n.startswith(p) and n not in used and n[len(p):] not in ref.shapes]
    if extra:
        raise CheckpointError(f"{parsed.path}: tensor {extra[0]!r} of {what} is not in {ref.what} "
                              f"({len(extra)} such tensors): another architecture? (or pass prefix=, "
                              f"--prefix)")
    return Selection(where, p, names, _n_stacked(parsed, sd, names, ref))
