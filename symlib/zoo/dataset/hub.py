"""``hf://`` addresses of exported datasets, resolved through the Hugging Face Hub's cache (book:
"Checkpoint zoos").

``symlib.load("hf://owner/name")`` reads a dataset the Hub holds: :func:`resolve` asks
``huggingface_hub`` for a local copy (its cache; with ``HF_HUB_OFFLINE=1`` the cache only), which is
then read, after :func:`symlib.zoo.dataset.verify`, like any local folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from symlib.store import StoreError

HF_PREFIX = "hf://"

__all__ = ["HF_PREFIX", "resolve"]


def resolve(address: str | os.PathLike) -> Path:
    """A local folder for ``address``: a path as it is, or ``hf://owner/name[@revision]`` (also
    ``hf://datasets/owner/name``) resolved through ``huggingface_hub``'s cache (``snapshot_download``;
    with ``HF_HUB_OFFLINE=1`` only the cache is used).

    Raises:
        ImportError: ``hf://`` without ``huggingface_hub`` installed.
        StoreError: the dataset is neither in the cache nor reachable.
    """
    text = str(address)
    if not text.startswith(HF_PREFIX):
        return Path(address)
    repo = text[len(HF_PREFIX):].strip("/")
    repo = repo.removeprefix("datasets/")
    repo, _, revision = repo.partition("@")
    if repo.count("/") != 1:
        raise StoreError(f"{text}: expected hf://owner/name or hf://owner/name@revision")
    try:
        import huggingface_hub
    except ImportError:
        raise ImportError(
            f"{text}: loading from the Hugging Face Hub needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        local = huggingface_hub.snapshot_download(
            repo_id=repo, repo_type="dataset", revision=revision or None
        )
    except Exception as e:  # offline without a cached copy, unknown repository, network errors
        raise StoreError(
            f"{text}: cannot resolve the dataset ({type(e).__name__}: {e}); without a network, download it "
            f"once (`hf download {repo} --repo-type dataset`) or pass a local folder"
        ) from None
    return Path(local)
