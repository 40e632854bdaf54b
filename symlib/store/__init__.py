r"""The on-disk format of checkpoint sets: one owner for zoos and posterior sample sets (book: "Checkpoint
zoos").

A checkpoint set is a folder:

* ``chunk-00000.safetensors``, ``chunk-00001.safetensors``, ...: consecutive networks per file, every
  tensor stacked along a new first axis; the file's metadata (its *header*) holds the format, what the
  chunk belongs to (a zoo's config hash or a sample set's identity hash), its own index, per-network
  records (seeds, metrics, sample indices), the sha256 of its tensors (:func:`tensor_digest`) and the
  sha256 of the header itself (:func:`header_digest`), all checked whenever the file is read
  (:func:`read_chunk`), so that damaged weights, a damaged header and a chunk file moved to another
  chunk's name are named rather than loaded;
* ``manifest.json``: what the folder holds (``"kind"``: a zoo, the default, or ``"posterior"``), the
  chunks written so far and whether the set is complete.

Every file is written to a temporary name in the same folder and renamed (:func:`os.replace`), so a
killed run leaves only complete files (:func:`atomic_write_bytes`; their mode follows the umask, as for
any file the user writes); the temporary files a killed run leaves are removed by the next run
(:func:`remove_stale`, :func:`remove_leftovers` for a folder assembled beside its target). A chunk is
written byte for byte the same from the same tensors and metadata (:func:`serialize`), so a chunk written
again has the sha256 of the original. No command writes into an exported dataset or beside files it did
not write (:func:`check_out`: :func:`exported`, :func:`foreign`), and a full disk is named with the folder
(:func:`no_space`).

Chunks written before headers carried their own sha256 (the same format, ``symlib-zoo/1``) still load:
their header must hold exactly the entries those versions wrote, and the readers compare its records
with the manifest's.

:mod:`symlib.zoo` adds what a zoo's manifest records; :mod:`symlib.store.sets` is the format of stacked
sets (``"kind": "posterior"``), which :mod:`symlib.posteriors.io` (posterior samples) and
:mod:`symlib.ckpt.convert` (imported and canonical checkpoints) write with their own manifest fields;
:func:`symlib.load` and :func:`symlib.info` read either kind (:func:`kind_of`).

The package splits the format by concept: :mod:`~symlib.store.files` (atomic writes, manifests,
provenance, the errors), :mod:`~symlib.store.chunks` (chunk files: headers, digests, checks),
:mod:`~symlib.store.folders` (an output folder checked before any work) and
:mod:`~symlib.store.architecture` (the network a manifest records, :func:`architecture`), whose names are
all re-exported here, and :mod:`~symlib.store.sets` (a set of networks stacked along a first axis:
writing with resumption, reading, checking), used as ``store.sets`` (its names would clash with the
chunk-level ones).
"""

from symlib.store.architecture import adapt, architecture
from symlib.store.chunks import (
    ADDED,
    HEADER,
    LEGACY,
    atomic_save,
    check_tensors,
    chunk_name,
    damaged_identity,
    header_digest,
    header_records,
    read_chunk,
    read_header,
    sample_records,
    serialize,
    tensor_digest,
)
from symlib.store.files import (
    FORMAT,
    KINDS,
    MANIFEST,
    STALE,
    DamagedError,
    StoreError,
    alive,
    assemble,
    atomic_write_bytes,
    file_sha256,
    git_commit,
    jsonable,
    kind_of,
    no_space,
    provenance,
    read_manifest,
    remove_leftovers,
    remove_stale,
    temporary,
    write_manifest,
)
from symlib.store.folders import (
    PLAN,
    WORK,
    check_folder,
    check_out,
    check_owners,
    exported,
    foreign,
    refuse_exported,
)

__all__ = [
    "ADDED",
    "PLAN",
    "STALE",
    "WORK",
    "adapt",
    "alive",
    "architecture",
    "assemble",
    "FORMAT",
    "HEADER",
    "KINDS",
    "LEGACY",
    "MANIFEST",
    "DamagedError",
    "StoreError",
    "atomic_save",
    "atomic_write_bytes",
    "check_folder",
    "check_tensors",
    "file_sha256",
    "check_owners",
    "check_out",
    "chunk_name",
    "damaged_identity",
    "exported",
    "foreign",
    "git_commit",
    "header_digest",
    "header_records",
    "jsonable",
    "kind_of",
    "no_space",
    "provenance",
    "read_chunk",
    "read_header",
    "read_manifest",
    "refuse_exported",
    "remove_leftovers",
    "remove_stale",
    "sample_records",
    "serialize",
    "temporary",
    "tensor_digest",
    "write_manifest",
]
