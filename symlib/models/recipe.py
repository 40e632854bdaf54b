r"""The recipe of a network: how to rebuild the architecture a set of weights belongs to (book: "symlib
on your own network"; not the SGD recipe of :mod:`symlib.training`).

Weights alone do not say which network they belong to; a :class:`Recipe` does, as data that every manifest
``symlib`` writes records under ``"architecture"`` (:meth:`Recipe.record`) and that any later command
rebuilds (:meth:`Recipe.build`):

* ``builder="symlib"``: a network of the registry (:mod:`symlib.models.registry`), named by its key
  (``"optunet"``), with keyword arguments;
* ``builder="factory"``: any importable callable returning an ``nn.Module``, named
  ``package.module:Factory`` (``--model``) or ``path/to/file.py:Factory``, called with keyword arguments
  (``--model-args`` as JSON); ``timm.create_model`` is one, with ``{"model_name": ...}``;
* ``builder="transformers"``: a Hugging Face ``config.json`` (its ``model_type`` and ``architectures``);
* ``builder="timm"``: a timm model name and its arguments (timm's ``config.json``: ``"architecture"``,
  ``"model_args"``).

With the shape of one input (``--input-shape``; the registry and timm's configs carry one), the network's
symmetries can be traced (:func:`symlib.spec_of`). :func:`from_config` reads the recipe a Hugging Face or
timm ``config.json`` names; ``symlib.store.architecture`` reads the one a manifest records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from symlib.errors import CheckpointError
from symlib.models import registry

__all__ = ["BUILDERS", "Recipe", "from_config", "load_factory", "parse_shape"]

BUILDERS = ("symlib", "factory", "transformers", "timm")
TOKENS = 8  # the length of the dummy token sequence that traces a text model when no input shape is given
"""The ways a recipe builds its network (module docstring)."""


def parse_shape(text: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """``"1,28,28"`` (or ``"1x28x28"``, or a sequence) as ``(1, 28, 28)``; ``None`` stays ``None``."""
    if text is None:
        return None
    if isinstance(text, str):
        parts = [p for p in text.replace("x", ",").replace(" ", ",").split(",") if p]
    else:
        parts = list(text)
    try:
        shape = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise CheckpointError(f"input shape {text!r}: expected integers such as 1,28,28 (channels, height, "
                              f"width of one input, without the batch axis)") from None
    if not shape or any(d < 1 for d in shape):
        raise CheckpointError(f"input shape {text!r}: expected positive integers such as 1,28,28")
    return shape


def load_factory(target: str) -> Callable[..., Any]:
    """The callable named ``package.module:attr`` (``attr`` may be dotted) or ``path/file.py:attr``.

    Raises:
        CheckpointError: not of that form, or the module or attribute cannot be imported (naming why).
    """
    if ":" not in target:
        raise CheckpointError(f"--model {target!r}: expected MODULE:CALLABLE, e.g. mypackage.nets:MyNet or "
                              f"path/to/mynet.py:MyNet")
    where, _, attr = target.rpartition(":")
    try:
        if where.endswith(".py") or os.sep in where or "/" in where:
            file = Path(where).expanduser().resolve()
            if not file.is_file():
                raise FileNotFoundError(f"no file {file}")
            name = f"_symlib_model_{file.stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:8]}"
            module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, file)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
        else:
            module = importlib.import_module(where)
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except SystemExit as e:  # the user's module ended the process while being imported
        raise CheckpointError(f"--model {target!r}: importing it called sys.exit({e.code!r}); a model module "
                              f"must not exit when imported (guard its script part with "
                              f"`if __name__ == '__main__':`)") from None
    except Exception as e:  # ImportError, AttributeError, errors of the user's module
        raise CheckpointError(
            f"--model {target!r}: cannot import it ({type(e).__name__}: {e}); the module must be importable "
            f"here (on PYTHONPATH, or a path to a .py file)"
        ) from None
    if not callable(obj):
        raise CheckpointError(f"--model {target!r}: {type(obj).__name__} is not callable")
    return obj


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to rebuild the network of a set of checkpoints (module docstring).

    Attributes:
        builder: ``"symlib"``, ``"factory"``, ``"transformers"`` or ``"timm"``.
        target: the registry key (``"optunet"``), the factory (``module:callable``), the transformers
            class (``"BertForMaskedLM"``, or ``""`` for ``AutoModel``) or the timm model name.
        args: the factory's keyword arguments, the transformers config, or timm's model arguments.
        input_shape: one input's shape without the batch axis (for the spec), if known.
    """

    builder: str
    target: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    input_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.builder not in BUILDERS:
            raise CheckpointError(f"unknown architecture builder {self.builder!r}; one of {BUILDERS}")

    @property
    def name(self) -> str:
        """A short name of the architecture (the callable's or model's name)."""
        if self.builder == "factory":
            base = self.target.rpartition(":")[2].rpartition(".")[2]
            return str(self.args.get("model_name", base)) if base == "create_model" else base
        if self.builder == "transformers":
            return self.target or str(self.args.get("model_type", "transformers"))
        return self.target

    def describe(self) -> str:
        """The recipe in words, for messages."""
        if self.builder in ("symlib", "factory"):
            args = f"(**{json.dumps(self.args, sort_keys=True)})" if self.args else "()"
            return f"{self.target}{args}"
        if self.builder == "transformers":
            return f"transformers {self.target or 'AutoModel'} ({self.args.get('model_type')})"
        return f"timm {self.target}"

    @property
    def vocab(self) -> int | None:
        """The vocabulary size of a network that reads token ids: a Hugging Face text model's
        ``vocab_size`` (its ``config.json``); ``None`` for image models and other builders (pass
        ``vocab=``, ``--vocab``)."""
        if self.builder != "transformers" or "vocab_size" not in self.args:
            return None
        if "num_channels" in self.args or "image_size" in self.args:
            return None
        return int(self.args["vocab_size"])

    @property
    def file(self) -> Path | None:
        """The ``.py`` file of a factory named by its path (``path/to/nets.py:MyNet``); ``None`` otherwise."""
        where = self.target.rpartition(":")[0]
        if self.builder != "factory" or not (where.endswith(".py") or "/" in where or os.sep in where):
            return None
        return Path(where)

    def record(self, folder: str | os.PathLike | None = None) -> dict[str, Any]:
        """The recipe as JSON-able data (what a manifest records as ``"architecture"``).

        A factory named by its file also records ``"file"``: the file's path relative to ``folder`` (the
        set that records it, so a set moved with its model file still finds it) and its sha256 (so a
        changed file is named).
        """
        rec: dict[str, Any] = {"builder": self.builder, "target": self.target, "args": self.args,
                               "input_shape": list(self.input_shape) if self.input_shape else None}
        file = self.file
        if file is not None and file.is_file():
            rel = os.path.relpath(file.resolve(), Path(folder).resolve()) if folder is not None else None
            rec["file"] = {"relative": rel, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}
        return rec

    @classmethod
    def from_record(cls, rec: Mapping[str, Any], where: str = "") -> Recipe:
        """The inverse of :meth:`record` (a clear error for a damaged record). A factory file that is not
        where the record says is looked for at its path relative to the folder ``where``; when it is in
        neither place, or its content changed, the error names the file and ``--model`` as the override.
        """
        try:
            recipe = cls(str(rec["builder"]), str(rec["target"]), dict(rec.get("args") or {}),
                         parse_shape(rec.get("input_shape")))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: bad architecture record {dict(rec)!r} ({e})") from None
        file, meta = recipe.file, rec.get("file")
        if file is None or not isinstance(meta, Mapping):
            return recipe
        attr = recipe.target.rpartition(":")[2]
        if not file.is_file() and meta.get("relative") and where and Path(where).is_dir():
            moved = (Path(where) / str(meta["relative"])).resolve()
            if moved.is_file():
                file, recipe = moved, dataclasses.replace(recipe, target=f"{moved}:{attr}")
        if not file.is_file():
            raise CheckpointError(
                f"{where}: the network's factory file {file} (recorded with the set) is not found, nor at "
                f"{meta.get('relative')!r} beside the set; pass the model (--model path/to/file.py:{attr}, "
                f"model= in Python) to say where it is now")
        if meta.get("sha256") and hashlib.sha256(file.read_bytes()).hexdigest() != meta["sha256"]:
            raise CheckpointError(
                f"{where}: the network's factory file {file} changed since the set was written (its sha256 "
                f"differs from the one recorded); if it still builds the same network, pass it as the model "
                f"(--model {file}:{attr}) to use it")
        return recipe

    def with_shape(self, input_shape: Sequence[int] | str | None) -> Recipe:
        """The same recipe with ``input_shape`` (kept when ``None``)."""
        shape = parse_shape(input_shape)
        return self if shape is None else dataclasses.replace(self, input_shape=shape)

    def build(self, meta: bool = False) -> torch.nn.Module:
        """A freshly built network (on the meta device with ``meta=True``: shapes only, no memory).

        Raises:
            CheckpointError: the builder cannot be imported, fails, or returns no ``nn.Module``.
        """
        if self.builder in ("symlib", "factory"):
            fn = registry.network(self.target) if self.builder == "symlib" else load_factory(self.target)
            make = lambda: fn(**self.args)  # noqa: E731
        elif self.builder == "transformers":
            make = self._transformers
        else:
            make = self._timm
        try:
            if meta:
                with torch.device("meta"):
                    model = make()
            else:
                model = make()
        except CheckpointError:
            raise
        except SystemExit as e:  # the user's factory ended the process
            raise CheckpointError(f"building {self.describe()} called sys.exit({e.code!r}); a factory must "
                                  f"return an nn.Module") from None
        except Exception as e:  # the user's code
            if meta:  # some constructors need real tensors: build for real
                return self.build(meta=False)
            raise CheckpointError(f"building {self.describe()} failed ({type(e).__name__}: {e})") from None
        if not isinstance(model, torch.nn.Module):
            raise CheckpointError(f"{self.describe()} returned a {type(model).__name__}, not an nn.Module")
        return model

    def _transformers(self) -> torch.nn.Module:
        try:
            import transformers
        except ImportError:
            raise ImportError("a Hugging Face architecture needs transformers (pip install "
                              "transformers)") from None
        args = dict(self.args)
        model_type = args.get("model_type")
        if model_type not in transformers.CONFIG_MAPPING:
            raise CheckpointError(f"config.json: model_type {model_type!r} is unknown to transformers "
                                  f"{transformers.__version__}")
        cfg = transformers.CONFIG_MAPPING[model_type].from_dict(args)
        if getattr(cfg, "use_cache", False):  # symlib never generates: a key/value cache only hides the graph
            cfg.use_cache = False
        cls = getattr(transformers, self.target, None) if self.target else None
        if self.target and cls is None:
            raise CheckpointError(f"config.json: architecture {self.target!r} is unknown to transformers "
                                  f"{transformers.__version__}")
        return cls(cfg) if cls is not None else transformers.AutoModel.from_config(cfg)

    def _timm(self) -> torch.nn.Module:
        try:
            import timm
        except ImportError:
            raise ImportError("a timm architecture needs timm (pip install timm)") from None
        return timm.create_model(self.target, pretrained=False, **self.args)

    def shape(self, model: torch.nn.Module | None = None) -> tuple[int, ...]:
        """The input shape: given, the registry's for its arguments, or the one a timm model's
        configuration names.

        Raises:
            CheckpointError: unknown (then pass ``input_shape=``, ``--input-shape``).
        """
        if self.input_shape is not None:
            return self.input_shape
        if self.builder == "symlib":
            return tuple(registry.network(self.target).input_shape(self.args))
        cfg = getattr(model, "pretrained_cfg", None) or {}
        if cfg.get("input_size"):
            return tuple(int(d) for d in cfg["input_size"])
        if self.vocab is not None:  # a text model: TOKENS token ids (the symmetries do not depend on it)
            positions = self.args.get("max_position_embeddings") or self.args.get("n_positions") or TOKENS
            return (min(TOKENS, int(positions)),)
        raise CheckpointError(f"the input shape of {self.describe()} is unknown: pass it (input_shape=, "
                              f"--input-shape C,H,W) to trace the network's symmetries")

    @classmethod
    def of(cls, model: Any, args: Mapping[str, Any] | None = None,
           input_shape: Sequence[int] | str | None = None) -> Recipe:
        """A recipe from what a user passes: a ``Recipe``, the name of a registered network
        (``"optunet"``, :mod:`symlib.models.registry`), a ``"module:callable"`` string, a class or function
        (recorded by its import path), or an ``nn.Module`` instance (recorded as its class, rebuilt without
        arguments)."""
        if isinstance(model, Recipe):
            return model.with_shape(input_shape)
        shape = parse_shape(input_shape)
        if isinstance(model, str) and ":" not in model and model in registry.REGISTRY:
            args = dict(args or {})
            return cls("symlib", model, args, shape or tuple(registry.network(model).input_shape(args)))
        if isinstance(model, str):
            where, sep, attr = model.rpartition(":")
            if sep and (where.endswith(".py") or "/" in where or os.sep in where):  # a file: by its full path
                model = f"{Path(where).expanduser().resolve()}:{attr}"
            return cls("factory", model, dict(args or {}), shape)
        target = model if not isinstance(model, torch.nn.Module) else type(model)
        path = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"
        return cls("factory", path, dict(args or {}), shape)


def from_config(folder: str | os.PathLike, cfg: Mapping[str, Any]) -> Recipe:
    """The recipe a Hugging Face ``config.json`` names: timm's (``"architecture"``, ``"model_args"``,
    ``"pretrained_cfg"``) or transformers' (``"model_type"``, ``"architectures"``)."""
    if "architecture" in cfg and "model_type" not in cfg:
        args = dict(cfg.get("model_args") or {})
        if "num_classes" in cfg:
            args.setdefault("num_classes", cfg["num_classes"])
        size = (cfg.get("pretrained_cfg") or {}).get("input_size")
        return Recipe("timm", str(cfg["architecture"]), args, parse_shape(size) if size else None)
    if "model_type" not in cfg:
        raise CheckpointError(f"{Path(folder) / 'config.json'}: names neither a transformers model_type nor "
                              f"a timm architecture; pass the architecture (--model)")
    archs = cfg.get("architectures") or []
    shape = None
    if "num_channels" in cfg and "image_size" in cfg:
        size = cfg["image_size"]
        size = size if isinstance(size, list | tuple) else (size, size)
        shape = (int(cfg["num_channels"]), *map(int, size))
    return Recipe("transformers", str(archs[0]) if archs else "", dict(cfg), shape)
