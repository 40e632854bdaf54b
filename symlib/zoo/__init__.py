r"""Checkpoint zoos: train, store, resume, shard, merge, load and cache networks (book: "Checkpoint zoos").

The paper estimates the target posterior with many independently trained
checkpoints (1,000 OptuNets on MNIST, paper §4). A *zoo* is a directory:

* ``chunk-00000.safetensors``, ``chunk-00001.safetensors``, ...: the state of
  ``ZooConfig.chunk`` consecutive models per file, every tensor stacked along a
  new first axis, with the chunk's seeds and per-model metrics in the file's metadata;
* ``manifest.json``: the configuration (architecture, recipe, seeds), the data
  fingerprint, the final train/test accuracy and loss of every model, the chunks,
  the symlib version and the git commit.

Every file is written to a temporary name in the same folder and renamed
(:func:`os.replace`), so a killed run leaves only complete files; restarting it
skips the chunks already on disk, and :func:`repair` (``symlib zoo repair``) retrains exactly the
chunks that were damaged or lost since. ``shard=(k, n)`` trains chunks ``k, k + n,
k + 2n, ...`` only, so ``n`` machines (or a SLURM array) split a zoo;
:func:`merge` checks the shards and combines them. :func:`load_or_train`
caches zoos under ``$SYMLIB_CACHE`` (default ``~/.cache/symlib/zoos``), keyed
by preset, scale and a hash of the configuration.

The package splits these concepts into modules: :mod:`~symlib.zoo.config` (``ZooConfig``, presets),
:mod:`~symlib.zoo.chunks` (a zoo's chunks and manifest on the common format of :mod:`symlib.store`),
:mod:`~symlib.zoo.training` (data, training, shards) and :mod:`~symlib.zoo.cache` (load, merge, cache,
info), :mod:`~symlib.zoo.fanout` (shards as a submitit job array on SLURM or local processes: submit,
watch, resubmit, merge; :func:`status`) and :mod:`~symlib.zoo.dataset` (:func:`export` a zoo as a dataset
folder for the Hugging Face Hub with a manifest table, a card and a Croissant description; read one back,
``hf://`` addresses). Posterior sample sets (:mod:`symlib.posteriors.io`) use the same format;
:func:`symlib.load` reads either kind.
"""

from symlib.params import Params
from symlib.store import FORMAT, MANIFEST, tensor_digest
from symlib.zoo.cache import (
    cache_dir,
    cache_path,
    info,
    load,
    load_or_train,
    merge,
    models_from_stacked,
    repair,
)
from symlib.zoo.chunks import ZooError, read_chunk
from symlib.zoo.config import (
    ARCHS,
    CPU_EPOCHS,
    CPU_MODELS,
    CPU_MOMENTUM,
    PRESETS,
    ZooConfig,
    preset,
)
from symlib.zoo.dataset import export
from symlib.zoo.fanout import status
from symlib.zoo.training import load_data, train

__all__ = [
    "ARCHS",
    "CPU_EPOCHS",
    "CPU_MODELS",
    "CPU_MOMENTUM",
    "FORMAT",
    "MANIFEST",
    "PRESETS",
    "Params",
    "ZooConfig",
    "ZooError",
    "cache_dir",
    "cache_path",
    "export",
    "info",
    "load",
    "load_data",
    "load_or_train",
    "merge",
    "models_from_stacked",
    "preset",
    "read_chunk",
    "repair",
    "status",
    "tensor_digest",
    "train",
]
