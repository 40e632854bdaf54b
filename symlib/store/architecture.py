"""The network a folder's manifest records: one typed reader for every kind of folder (book: "Checkpoint
zoos").

Every manifest ``symlib`` writes (a zoo, a posterior sample set, an imported or canonical set, an exported
dataset) records the :class:`~symlib.models.recipe.Recipe` of its network under ``"architecture"``;
:func:`architecture` reads it back. Folders written before manifests recorded one are read through one
adapter (:func:`adapt`): a zoo's configuration (``"config"``: ``arch``, ``num_classes``, ``channels``,
``width``, ``image_size``) or a sample set's ``"model"`` record (a :mod:`symlib.models` class and its
keyword arguments) names a network of the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from symlib.errors import StoreError
from symlib.models import registry
from symlib.models.recipe import Recipe

__all__ = ["adapt", "architecture"]


def architecture(manifest: Mapping[str, Any], where: str = "") -> Recipe | None:
    """The recipe of the network a manifest records (``"architecture"``, or :func:`adapt` for a folder
    written before manifests recorded one); ``None`` when it names no network (a sample set of a network
    outside the registry, written without a recipe).

    Raises:
        StoreError: the record is damaged, or names a network the registry does not hold.
    """
    rec = manifest.get("architecture")
    if rec:
        if not isinstance(rec, Mapping):
            raise StoreError(f"{where}: the manifest's architecture is {rec!r}, not a recipe record; the "
                             f"manifest was edited or damaged: restore it")
        return Recipe.from_record(rec, where)
    return adapt(manifest, where)


def adapt(manifest: Mapping[str, Any], where: str = "") -> Recipe | None:
    """The recipe of a manifest that records none: a zoo's configuration or a sample set's ``"model"``
    class (module docstring); ``None`` when neither names a registered network."""
    if manifest.get("kind", "zoo") == "zoo" and isinstance(manifest.get("config"), Mapping):
        cfg = manifest["config"]
        net = registry.REGISTRY.get(str(cfg.get("arch")))
        if net is None:
            return None
        args = net.arguments(num_classes=cfg.get("num_classes", 10), in_channels=cfg.get("channels", 3),
                             width=cfg.get("width"))
        size = int(cfg.get("image_size", 28))
        return Recipe("symlib", net.name, args, (int(cfg.get("channels", 1)), size, size))
    model = manifest.get("model") or {}
    if isinstance(model, Mapping) and model.get("class"):
        net = registry.of_factory(f"symlib.models:{model['class']}")
        if net is None:
            raise StoreError(f"{where}: the manifest names symlib.models class {model['class']!r}, which the "
                             f"registry does not hold (registered: {sorted(registry.REGISTRY)})")
        kwargs = dict(model.get("kwargs") or {})
        return Recipe("symlib", net.name, kwargs, net.input_shape(kwargs))
    return None
