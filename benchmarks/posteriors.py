"""Posterior methods: time per sample set, and stacked training against one model after another.

1. For every method of ``symlib.posteriors.METHODS`` (those not importable yet print "not available"):
   the time to produce its one-mode set (1 x 100 samples) and its multi-mode set (10 x 10) on
   MNIST-OptuNet at ``--scale`` (``cpu``: the book's recipe, 4,000 digits, 10 epochs). The base models
   (1 and 10, trained once, stacked) are timed separately and given to the methods that start from them.
2. The multi-mode training workload, stacked (symlib: the 10 models in one set of batched tensors)
   against the same models one after another in a plain PyTorch loop (``nn.Module`` + ``torch.optim.SGD``,
   the same batches and crops): the 10 base models (:func:`symlib.training.plain.train_plain`) and SWAG's
   continued training with its 20 snapshots (:func:`symlib.posteriors.swag.fit`, nn.Module path), and
   mean-field VI (:func:`symlib.posteriors.vi.fit`: the 10 posteriors x 3 Monte-Carlo samples stacked,
   against one posterior at a time in the plain loop of BLiTZ's ``sample_elbo``: an ``nn.Module``, one
   forward and loss per Monte-Carlo sample, autograd and ``torch.optim.SGD``, the same batches, KL and
   schedule (:func:`_vi_plain`); symlib's own one-posterior-at-a-time path, which vectorises the three
   samples with ``torch.vmap``, is printed beside it; timed over ``--vi-epochs`` epochs and scaled to the
   recipe's, all being linear in the epochs). The plain loop trains ``--plain-modes`` of the 10
   models and its time is scaled to 10 (it is linear in the number of models: they run one after
   another); both are timed interleaved, at 1 thread and at ``--threads``, best of ``--repeats``.

The last line is ``speedup: <x>x`` (stacked vs one-by-one, whole multi-mode workload).

Usage: ``python benchmarks/posteriors.py [--scale cpu|tiny] [--methods swag,sghmc] [--plain-modes 2]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
import torch.nn.functional as F

from symlib import models
from symlib import training as T
from symlib.posteriors import METHODS, sampling, swag
from symlib.posteriors.seeds import base_seeds
from symlib.posteriors.sgd import train_models


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _vi_plain(setup, seeds, epochs: int) -> None:
    """Bayes by Backprop one posterior after another, written as BLiTZ's ``sample_elbo`` loop: for every
    batch, ``n_mc`` forward passes with freshly sampled weights, the mean loss plus beta times the closed-form
    KL, one backward pass and a ``torch.optim.SGD`` step (BLiTZ's initialisation, and the same batches, KL
    weight, optimiser and learning-rate schedule as :func:`symlib.posteriors.vi.fit`)."""
    from symlib.posteriors import vi

    cfg = vi.Config()
    rec = vi.vi_recipe(setup).scaled(epochs)
    beta = 1.0 / setup.n_train
    model = setup.make_model()
    for seed in seeds:
        mu0, rho0 = vi.init_variational(model, 1, torch.Generator().manual_seed(seed))
        mu = {n: v[0].clone().requires_grad_() for n, v in mu0.items()}
        rho = {n: v[0].clone().requires_grad_() for n, v in rho0.items()}
        opt = torch.optim.SGD([*mu.values(), *rho.values()], lr=rec.lr, momentum=rec.momentum)
        gen = torch.Generator().manual_seed(seed + 1)
        for b in T.minibatches([seed], setup.x, setup.y, rec, setup.fill):
            for group in opt.param_groups:
                group["lr"] = b.lr
            nll = 0.0
            for _ in range(cfg.n_mc):
                w = {n: mu[n] + F.softplus(rho[n]) * torch.randn(mu[n].shape, generator=gen) for n in mu}
                nll = nll + F.cross_entropy(torch.func.functional_call(model, w, (b.x[0],)), b.y[0])
            kl = vi.kl_divergence({n: v[None] for n, v in mu.items()}, {n: v[None] for n, v in rho.items()})
            kl = kl[0]
            opt.zero_grad(set_to_none=True)
            (nll / cfg.n_mc + beta * kl).backward()
            opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="cpu", choices=("tiny", "cpu"))
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods to time")
    ap.add_argument("--plain-modes", type=int, default=2, help="models the plain loop trains (scaled to 10)")
    ap.add_argument("--repeats", type=int, default=1, help="best of this many interleaved timings")
    ap.add_argument("--skip-methods", action="store_true", help="only the stacked vs one-by-one comparison")
    ap.add_argument("--vi-epochs", type=int, default=2, help="VI epochs timed (scaled to the recipe's)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TQDM_DISABLE", "1")
    setup = dataclasses.replace(sampling.setup_for("mnist-optunet", args.scale), name="")  # no cache
    n_modes = 10
    print(
        f"MNIST-OptuNet at scale {args.scale}: {setup.n_train} images, recipe {setup.recipe}; "
        f"threads {torch.get_num_threads()} (os.cpu_count() = {os.cpu_count()})"
    )

    # ------------------------------------------------------------------ 1. every method's sample sets
    if not args.skip_methods:
        (base1, _, _), t1 = _timed(lambda: sampling.base_models(setup, 1, 0, use_cache=False, progress=False))
        (base10, _, _), t10 = _timed(
            lambda: sampling.base_models(setup, n_modes, 0, use_cache=False, progress=False)
        )
        print(f"base models (stacked): 1 in {t1:.1f} s, {n_modes} in {t10:.1f} s (not counted below)")
        for method in args.methods.split(","):
            try:
                meth = sampling.method(method)
            except ValueError:
                print(f"{method:9s} not available")
                continue
            uses = meth.base in ("required", "optional")
            row = []
            for m, n, base in ((1, 100, base1), (n_modes, 10, base10)):
                kw = {"base": base} if uses else {}
                _, t = _timed(
                    lambda m=m, n=n, kw=kw, meth=meth: meth.sample(setup, m, n, 0, progress=False, **kw)
                )
                row.append(f"{m} x {n}: {t:7.1f} s")
            print(f"{method:9s} " + "   ".join(row))

    # ------------------------------------------------------------------ 2. stacked vs one by one
    seeds = base_seeds(n_modes, 0)
    k = max(1, min(args.plain_modes, n_modes))
    plain_setup = dataclasses.replace(setup, arch="optunet-plain")  # the nn.Module paths of symlib
    swag_kw = dict(lr=setup.recipe.lr, epochs=2 * setup.recipe.epochs, n_snapshots=20, rank=20)

    from symlib.posteriors import vi

    vi_scale = vi.vi_recipe(setup).epochs / args.vi_epochs
    vi_vmap: list[float] = []  # symlib's own one-at-a-time VI path (Monte-Carlo samples vectorised)

    def stacked():
        base, tb = _timed(lambda: train_models(setup, seeds, progress=False))
        _, ts = _timed(lambda: swag.fit(setup, base, seeds, progress=False, **swag_kw))
        _, tv = _timed(lambda: vi.fit(setup, n_modes, 0, progress=False, epochs=args.vi_epochs))
        return tb, ts, tv * vi_scale, base

    def plain(base):
        def train():
            for s in seeds[:k]:
                T.train_plain(T.init_model(models.OptuNet, s), s, setup.x, setup.y, setup.recipe, setup.fill)

        _, tb = _timed(train)
        sub = {name: v[:k] for name, v in base.items()}
        _, ts = _timed(lambda: swag.fit(plain_setup, sub, seeds[:k], progress=False, **swag_kw))
        _, tv = _timed(lambda: _vi_plain(setup, seeds[:k], args.vi_epochs))
        _, tvm = _timed(
            lambda: vi.fit(setup, k, 0, progress=False, epochs=args.vi_epochs, loss_fn=F.cross_entropy)
        )
        vi_vmap.append(tvm * vi_scale * n_modes / k)
        return tb * n_modes / k, ts * n_modes / k, tv * vi_scale * n_modes / k

    # Small operators can run slower on 2 threads than on 1 (synchronisation, a busy machine): each side is
    # timed at 1 thread and at --threads, interleaved, and keeps its best total.
    best_s, best_p = None, None
    for threads in sorted({1, args.threads}):
        torch.set_num_threads(threads)
        for _ in range(args.repeats):
            tb, ts, tv, base = stacked()
            pb, ps, pv = plain(base)
            print(
                f"  ({threads} thread(s): stacked {tb:.1f} + {ts:.1f} + {tv:.1f} s, "
                f"one by one {pb:.1f} + {ps:.1f} + {pv:.1f} s)"
            )
            best_s = (tb, ts, tv) if best_s is None or tb + ts + tv < sum(best_s) else best_s
            best_p = (pb, ps, pv) if best_p is None or pb + ps + pv < sum(best_p) else best_p
    print(f"multi-mode workload ({n_modes} models; plain loop timed on {k}, scaled to {n_modes}):")
    print(
        f"  base training: stacked {best_s[0]:.1f} s, one by one {best_p[0]:.1f} s "
        f"({best_p[0] / best_s[0]:.1f}x)"
    )
    print(
        f"  SWAG ({swag_kw['epochs']} epochs, 20 snapshots): stacked {best_s[1]:.1f} s, one by one "
        f"{best_p[1]:.1f} s ({best_p[1] / best_s[1]:.1f}x)"
    )
    print(
        f"  VI ({vi.vi_recipe(setup).epochs} epochs, 3 MC samples, timed on {args.vi_epochs} and scaled): "
        f"stacked {best_s[2]:.1f} s, one by one {best_p[2]:.1f} s ({best_p[2] / best_s[2]:.1f}x); "
        f"one by one with the samples vectorised (torch.vmap) {min(vi_vmap):.1f} s "
        f"({min(vi_vmap) / best_s[2]:.1f}x)"
    )
    print(f"speedup: {sum(best_p) / sum(best_s):.1f}x")


if __name__ == "__main__":
    main()
