r"""Compare two checkpoint sets on disk with the paper's MMD (book: chapter "Table 1"; paper §4, App. B.4).

The paper's central operation compares two sets of checkpoints of one architecture, layer by layer, on
raw weights and with the symmetries removed ("NS"). :func:`compare` does it for two folders: zoos,
posterior sample sets or exported datasets (``hf://owner/name`` included), loaded and checked with
:func:`symlib.load`, or checkpoint files of one's own (:func:`symlib.load_checkpoints`). The architecture
and its symmetry spec come from the manifests (a zoo's configuration, a sample set's ``model`` record, an
imported set's recipe) or from ``model=`` (``--model``), so no Python is needed: ``symlib compare A B``.

For every symmetry removal, :func:`symlib.stats.mmd.table` gives :math:`\widehat{\mathrm{MMD}}{}^2_u`
per layer (median over the 20 MMDAgg kernels) and their mean weighted by the layers' parameter counts,
with percentile bootstrap intervals and the permutation p-value of "both sets come from one
distribution" (:mod:`symlib.stats.mmd`). ``A`` plays the paper's target (its distances set the
bandwidths). Reported numbers are ``100 x`` the estimate, as in Table 1.

The two-sample test assumes two independent sets: sets that share a network (the same file or folder,
or the same weights, :func:`symlib.ckpt.loader.shared`) are refused unless ``allow_duplicates=True``
(``--allow-duplicates``), and the result then says that they overlap (:attr:`Comparison.warning`). Within
a set of checkpoint files, repeated networks are refused as :func:`symlib.load_checkpoints` refuses them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symlib import store

__all__ = ["Comparison", "architecture", "check_json", "compare", "write_json"]


def architecture(manifest: dict[str, Any], where: str = "") -> tuple[str, torch.nn.Module, tuple[int, ...]]:
    """The architecture recorded in a manifest: ``(name, a freshly built module, input shape)``, from the
    recipe it records (:func:`symlib.store.architecture`: a zoo's, a sample set's, an imported set's).

    Raises:
        StoreError: the manifest does not say how to rebuild its networks.
    """
    return _built(store.architecture(manifest, where), manifest, where)


def _built(recipe: Any, manifest: dict[str, Any], where: str) -> tuple[str, torch.nn.Module, tuple[int, ...]]:
    if recipe is None:
        raise _unknown(manifest, where)
    model = recipe.build()
    return recipe.name, model, recipe.shape(model)


def _unknown(manifest: dict[str, Any], where: str) -> store.StoreError:
    return store.StoreError(
        f"{where}: the set of architecture {manifest.get('arch')!r} records no network to rebuild, so "
        f"its symmetries are unknown; compare it with --symmetries raw, or in Python with a spec"
    )


def _describe(path: str, manifest: dict[str, Any], n: int) -> str:
    nets = f"{n} {manifest.get('arch') or 'networks'}"
    if manifest.get("kind", "zoo") == "zoo":
        return f"{path} (zoo {manifest.get('preset')}/{manifest.get('scale')}, {nets})"
    return f"{path} ({manifest.get('method')} {manifest.get('n_modes')}x{manifest.get('n_per_mode')}, {nets})"


def _check_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], arch_a: str, arch_b: str, wa: str,
                wb: str) -> None:
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise ValueError(
            f"cannot compare {wa} with {wb}: different architectures ({arch_a} vs {arch_b}; tensors only in "
            f"A {only_a[:4]}, only in B {only_b[:4]}); the MMD compares sets of one architecture"
        )
    for k in a:
        if tuple(a[k].shape[1:]) != tuple(b[k].shape[1:]):
            raise ValueError(
                f"cannot compare {wa} with {wb}: layer tensor {k!r} has shape {tuple(a[k].shape[1:])} in A "
                f"and {tuple(b[k].shape[1:])} in B (another width or number of classes?); the MMD compares "
                "sets of one architecture"
            )


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Two checkpoint sets compared by the MMD (:func:`compare`).

    Attributes:
        a, b: the two folders (``a`` plays the target); ``n_a``, ``n_b``: their sizes; ``arch``: the
            architecture.
        results: ``{symmetries: symlib.stats.mmd.Result}``.
        n_permutations, n_bootstrap, seed, level: the test's settings.
        shared: distinct networks in both sets (compared with ``allow_duplicates=True``; 0 otherwise).
    """

    a: str
    b: str
    n_a: int
    n_b: int
    arch: str
    results: dict[str, Any]
    n_permutations: int
    n_bootstrap: int
    seed: int
    level: float = 0.95
    described: tuple[str, str] = ("", "")
    shared: int = 0

    @property
    def warning(self) -> str | None:
        """The line that says the sets overlap (``None`` when they share no network)."""
        if not self.shared:
            return None
        return (f"warning: the sets overlap ({self.shared} shared network{'s' if self.shared > 1 else ''}): "
                f"the two-sample test assumes independent sets, so the MMD, its intervals and p-values are "
                f"biased")

    def rows(self, scale: float = 100.0) -> list[dict[str, Any]]:
        """One dict per symmetry removal and layer, then ``layer="all"`` (the weighted mean over layers):
        ``mmd`` (``scale x`` the median over kernels of :math:`\\widehat{\\mathrm{MMD}}{}^2_u`), ``lo`` and
        ``hi`` (bootstrap interval, when run), ``p`` (permutation p-value, when run), ``params``."""
        out = []
        for sym, res in self.results.items():
            per = (scale * res.value(layers=None)).tolist()
            lo_hi = None
            if res.boot is not None:
                lo_hi = (scale * res.interval(layers=None, level=self.level)).tolist()
            ps = res.p_value(layers=None).tolist() if res.permuted is not None else None
            for i, name in enumerate(res.names):
                out.append(self._row(sym, name, res.sizes[i], per[i], lo_hi[i] if lo_hi else None,
                                     ps[i] if ps else None))
            agg_ci = (scale * res.interval(level=self.level)).tolist() if res.boot is not None else None
            agg_p = float(res.p_value()) if res.permuted is not None else None
            out.append(self._row(sym, "all", sum(res.sizes), scale * float(res.value()), agg_ci, agg_p))
        return out

    @staticmethod
    def _row(sym, layer, params, value, ci, p) -> dict[str, Any]:
        return {"symmetries": sym, "layer": layer, "params": int(params), "mmd": value,
                "lo": ci[0] if ci else None, "hi": ci[1] if ci else None, "p": p}

    def to_dict(self) -> dict[str, Any]:
        """Everything :meth:`rows` holds, with the settings (what ``symlib compare --json`` writes), the
        networks the sets share and the :attr:`warning` (``None`` when they share none)."""
        return {
            "a": self.a, "b": self.b, "n_a": self.n_a, "n_b": self.n_b, "arch": self.arch,
            "shared": self.shared, "warning": self.warning,
            "statistic": "100 x MMD^2_u, median over the 20 MMDAgg kernels per layer; layer 'all': mean over "
                         "layers weighted by their parameter counts",
            "n_permutations": self.n_permutations, "n_bootstrap": self.n_bootstrap, "seed": self.seed,
            "level": self.level, "rows": self.rows(),
        }

    def format(self) -> str:
        """A plain-text table of :meth:`rows`."""
        def num(v, fmt="{:.4f}"):
            return "-" if v is None else fmt.format(v)

        boot = ""
        if self.n_bootstrap:
            boot = f", {self.level:.0%} bootstrap interval ({self.n_bootstrap} resamples)"
        lines = [
            f"A: {self.described[0] or self.a}",
            f"B: {self.described[1] or self.b}",
            *([self.warning] if self.warning else []),
            "100 x MMD^2 (median over 20 kernels; 'all': weighted mean over layers)"
            + boot
            + (f", permutation p-value ({self.n_permutations} re-splits)" if self.n_permutations else ""),
            f"{'symmetries':10s} {'layer':24s} {'params':>8s} {'MMD':>10s} {'interval':>23s} {'p':>7s}",
        ]
        for r in self.rows():
            ci = f"[{num(r['lo'])}, {num(r['hi'])}]" if r["lo"] is not None else "-"
            lines.append(f"{r['symmetries']:10s} {r['layer']:24s} {r['params']:8d} {num(r['mmd']):>10s} "
                         f"{ci:>23s} {num(r['p'], '{:.3f}'):>7s}")
        return "\n".join(lines)


def compare(
    a: str | os.PathLike,
    b: str | os.PathLike,
    symmetries: Sequence[str] = ("raw", "ns"),
    n_permutations: int = 200,
    n_bootstrap: int = 200,
    seed: int = 0,
    level: float = 0.95,
    device: str | torch.device = "cpu",
    progress: bool = False,
    model: Any = None,
    model_args: dict[str, Any] | None = None,
    input_shape: Sequence[int] | str | None = None,
    prefix: str | None = None,
    key: str | None = None,
    trust_pickle: bool = False,
    allow_duplicates: bool = False,
    scalings: str = "auto",
    vocab: int | None = None,
) -> Comparison:
    r"""The paper's MMD between two checkpoint folders, per layer and aggregated, with intervals and
    p-values (``symlib.compare``; module docstring).

    Args:
        a, b: zoo folders, posterior sample-set folders or exported datasets (``hf://owner/name`` too), or
            checkpoint files, folders and globs (:func:`symlib.load_checkpoints`); ``a`` plays the target of
            the paper (its distances set the kernels' bandwidths).
        symmetries: removals (:data:`symlib.stats.mmd.SYMMETRIES`): ``"raw"``, ``"ns"`` (the paper's),
            ``"minmass"``, ``"perm"``, ``"scale"``.
        n_permutations: re-splits for the permutation test (0: none).
        n_bootstrap: resamples for the percentile intervals (0: none).
        seed: of the permutations and resamples.
        level: of the intervals.
        device: where to compute.
        progress: progress bars.
        model, model_args, input_shape: the architecture, where a folder does not record it (arguments of
            :func:`symlib.load_checkpoints`; a ``"module:callable"`` string on the command line).
        prefix, key, trust_pickle: how to read checkpoint files (as :func:`symlib.load_checkpoints`).
        allow_duplicates: compare sets that share networks (refused by default: the test assumes
            independent sets), the result then carrying a :attr:`~Comparison.warning`; and keep repeated
            networks within a set of checkpoint files (as :func:`symlib.load_checkpoints`).
        scalings, vocab: of the traced symmetries (:func:`symlib.spec_of`; ``"all"`` is ``"auto"``): which
            scaling symmetries to remove (``"none"`` for permutations only), and the vocabulary of a
            network that reads token ids (a Hugging Face text model's ``vocab_size`` by default).

    Returns:
        A :class:`Comparison` (``.format()``, ``.rows()``, ``.to_dict()``).

    Raises:
        ValueError: the sets hold different architectures or layer shapes, or an unknown removal.
        symlib.store.StoreError: a folder is missing, incomplete or damaged.
        symlib.ckpt.CheckpointError: the sets share networks, or a set of files repeats one (without
            ``allow_duplicates``).
    """
    from symlib.ckpt import recipe as recipes
    from symlib.stats import mmd

    syms = tuple(symmetries)
    if not syms:
        raise ValueError(
            f"no symmetry removal given (an empty --symmetries); pass a comma-separated list among "
            f"{list(mmd.SYMMETRIES)}, e.g. raw,ns"
        )
    bad = [s for s in syms if s not in mmd.SYMMETRIES]
    if bad:
        raise ValueError(f"unknown symmetry removal(s) {bad}; choose among {list(mmd.SYMMETRIES)}")
    from symlib.ckpt import loader

    opts = {"model_args": model_args, "input_shape": input_shape, "key": key, "trust_pickle": trust_pickle,
            "device": device, "allow_duplicates": allow_duplicates}
    got_a, got_b = loader.read(a, model, prefix, **opts), loader.read(b, model, prefix, **opts)
    (pa, ma), (pb, mb) = (got_a.params, got_a.record()), (got_b.params, got_b.record())
    arch_a, arch_b = str(ma.get("arch")), str(mb.get("arch"))
    na, nb = int(next(iter(pa.values())).shape[0]), int(next(iter(pb.values())).shape[0])
    for who, path, n in (("A", a, na), ("B", b, nb)):
        if n < 2:
            raise ValueError(
                f"{who}: {path} holds {n} checkpoint; the unbiased MMD needs at least 2 per set (it divides "
                f"by n (n - 1)): compare a larger set"
            )
    wa, wb = _describe(str(a), ma, na), _describe(str(b), mb, nb)
    _check_same(pa, pb, arch_a, arch_b, wa, wb)
    n_shared = _check_overlap(got_a, got_b, wa, wb, allow_duplicates)
    spec = None
    if any(s != "raw" for s in syms):  # the symmetries of A's architecture (B's has the same tensors)
        if got_a.recipe is None:
            raise _unknown(ma, str(a))
        origin = "--input-shape" if input_shape is not None else f"recorded for {a}"
        spec = recipes.spec(got_a.recipe, device=device, origin=origin, scalings=scalings, vocab=vocab)
    res = mmd.table(pa, {"b": pb}, spec, syms, n_permutations=n_permutations, n_bootstrap=n_bootstrap,
                    seed=seed, progress=progress)
    return Comparison(str(a), str(b), na, nb, arch_a, {s: res[("b", s)] for s in syms}, n_permutations,
                      n_bootstrap, seed, level, (wa, wb), n_shared)


def _check_overlap(got_a: Any, got_b: Any, wa: str, wb: str, allow: bool) -> int:
    """The networks two read sets share (:func:`symlib.ckpt.loader.shared`); refused unless ``allow``."""
    from symlib.ckpt import CheckpointError, loader

    n, paths = loader.shared(got_a, got_b)
    if n and not allow:
        why = (f"both read {paths[0]}" + (f" and {len(paths) - 1} more" if len(paths) > 1 else "") if paths
               else "the same weights are in both")
        raise CheckpointError(
            f"cannot compare {wa} with {wb}: the sets share {n} network{'s' if n > 1 else ''} ({why}); the "
            f"MMD's two-sample test assumes two independent sets, and shared networks bias the estimate, "
            f"its intervals and p-values: compare sets without common networks, or pass "
            f"allow_duplicates=True (--allow-duplicates) to compare them anyway, with a warning"
        )
    return n


def check_json(path: str | os.PathLike) -> None:
    """Check, before any work, that :func:`write_json` may write ``path``: a new file in a writable
    folder, or the JSON of an earlier comparison (replaced); never a folder or any other file (a
    manifest, a table), which would be lost.

    Raises:
        symlib.store.StoreError: naming the path, the problem and the fix.
    """
    if str(path) == "-":
        return
    path = Path(path)
    if path.is_dir():
        raise store.StoreError(f"{path}: is a folder; --json takes a file path, e.g. {path / 'compare.json'}")
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            old = None
        if not (isinstance(old, dict) and {"a", "b", "statistic", "rows"} <= set(old)):
            raise store.StoreError(
                f"{path}: exists and is not the JSON of an earlier `symlib compare`; --json never overwrites "
                f"another file (it is left as it is): choose another path"
            )
    store.check_folder(path.parent, "comparison", "--json path")


def write_json(comparison: Comparison, path: str | os.PathLike) -> None:
    """Write :meth:`Comparison.to_dict` as JSON to ``path`` (``"-"``: standard output), atomically, after
    :func:`check_json`."""
    text = json.dumps(comparison.to_dict(), indent=1)
    if str(path) == "-":
        print(text)
        return
    check_json(path)
    with store.no_space(Path(path).parent, "the comparison was not saved (an earlier file at this path, if "
                        "any, is unchanged): free some space and rerun, or pass another --json path"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        store.atomic_write_bytes(path, (text + "\n").encode())
