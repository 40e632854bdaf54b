r"""The dense curvature of the negative log likelihood over all weights (book: chapter "Table 1").

:func:`full_curvature` sums the GGN (or the exact Hessian) of the cross-entropy over the training set for
every stacked mode: by hand for OptuNet (:mod:`symlib.posteriors.laplace.optunet`), through
``torch.func`` for other small networks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from symlib import progress as _progress
from symlib import threads
from symlib.params import Params
from symlib.posteriors.laplace import optunet as _optunet
from symlib.posteriors.laplace.evidence import Fits, log_marginal_likelihood
from symlib.training.optunet import OPTUNET_SHAPES

__all__ = ["HESSIANS", "full_curvature"]

HESSIANS = ("ggn", "full")


def check_finite(h: torch.Tensor, what: str, mode: int) -> None:
    if not torch.isfinite(h).all():
        raise FloatingPointError(
            f"the {what} of mode {mode} is not finite (NaN or inf): the base model's logits overflow or its "
            f"weights are not finite; check the base models and the data"
        )


def flat_names(make_model: Callable[[], nn.Module]) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        model = make_model()
    return [(k, tuple(v.shape)) for k, v in model.named_parameters()]


def _logits_at(model: nn.Module, state: Params, names, vec: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """Logits of ``model`` with the state ``state`` whose parameters are replaced by the flat ``vec``."""
    params, start = {}, 0
    for k, shape in names:
        n = math.prod(shape)
        params[k] = vec[start : start + n].view(shape)
        start += n
    return torch.func.functional_call(model, {**state, **params}, (xb,))


def full_curvature(
    make_model: Callable[[], nn.Module],
    base: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    arch: str = "",
    hessian: str = "ggn",
    chunk_size: int = 500,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Curvature of the summed cross-entropy over all parameters of every stacked base model.

    .. math:: H = \sum_n J_n^\top (\mathrm{diag}(p_n) - p_n p_n^\top) J_n \quad (\texttt{"ggn"}), \qquad
              H = \nabla^2_\theta \sum_n -\log p(y_n \mid x_n, \theta) \quad (\texttt{"full"})

    in float64, the parameters flattened in ``named_parameters()`` order (laplace-torch's
    ``parameters_to_vector``), the models in eval mode (BatchNorm with its running statistics).

    Args:
        make_model: builds the architecture.
        base: stacked state dicts ``(M, ...)``.
        x, y: training images and labels (all of them: the GGN is a sum over the training set).
        arch: ``"optunet"`` selects the hand-written batched curvature; anything else ``torch.func``
            (per mode and image: small networks).
        hessian: ``"ggn"`` or ``"full"`` (the exact Hessian).
        chunk_size: images per chunk.
        progress: progress bar over chunks.

    Returns:
        ``(H (M, D, D), loss (M,))`` with ``loss`` the summed cross-entropy at the base models.
    """
    if hessian not in HESSIANS:
        raise ValueError(f"hessian must be one of {HESSIANS}, got {hessian!r}")
    m = next(iter(base.values())).shape[0]
    n = x.shape[0]
    dev = x.device
    bar = _progress.bar(total=n if arch == "optunet" else m * n, desc=f"laplace {hessian}", enabled=progress)
    if arch == "optunet":
        theta = {k: base[k].to(dev, torch.float64) for k in OPTUNET_SHAPES}
        acc: list[torch.Tensor] | None = None
        loss = torch.zeros(m, dtype=torch.float64, device=dev)
        step = max(1, chunk_size // m)
        for s in range(0, n, step):
            blocks, li = _optunet.ggn_chunk(
                theta, x[s : s + step].to(torch.float64), y[s : s + step], hessian
            )
            acc = blocks if acc is None else [u.add_(v) for u, v in zip(acc, blocks, strict=True)]
            loss += li
            bar.update(min(step, n - s))
        bar.close()
        return _optunet.assemble(*acc), loss
    model = make_model().to(dev).double().eval()
    names = flat_names(make_model)
    d = sum(math.prod(s) for _, s in names)
    h = torch.zeros(m, d, d, dtype=torch.float64, device=dev)
    loss = torch.zeros(m, dtype=torch.float64, device=dev)
    for i in range(m):
        state = {
            k: v[i].to(dev, torch.float64 if v.is_floating_point() else v.dtype) for k, v in base.items()
        }
        vec = torch.cat([state[k].reshape(-1) for k, _ in names])

        def logits_of(v, xb, state=state):
            return _logits_at(model, state, names, v, xb)

        for s in range(0, n, chunk_size):
            xb, yb = x[s : s + chunk_size].to(torch.float64), y[s : s + chunk_size]
            out = logits_of(vec, xb)
            loss[i] += F.cross_entropy(out, yb, reduction="sum").detach()
            if hessian == "ggn":
                jac = torch.func.vmap(
                    torch.func.jacrev(lambda v, xi: logits_of(v, xi[None])[0]), in_dims=(None, 0)
                )(vec, xb)  # (B, C, D)
                p = torch.softmax(out.detach(), -1)
                pj = torch.einsum("bc,bcd->bd", p, jac)
                h[i] += torch.einsum("bc,bcd,bce->de", p, jac, jac) - pj.T @ pj
            else:
                h[i] += torch.func.hessian(
                    lambda v, xb=xb, yb=yb: F.cross_entropy(logits_of(v, xb), yb, reduction="sum")
                )(vec)
            bar.update(min(chunk_size, n - s))
    bar.close()
    return h, loss


def sample_full(
    setup,
    base: Params,
    n_per_mode: int,
    gen: torch.Generator,
    out: Params,
    fits: Fits,
    *,
    hessian: str,
    lam_of: Callable[[torch.Tensor, float], float],
    chunk_size: int | None,
    progress: bool,
) -> None:
    r"""Draw ``n_per_mode`` samples around every base model from :math:`\mathcal N(\theta^*, (H +
    \lambda I)^{-1})` with the dense curvature :math:`H` (:func:`full_curvature`) into ``out`` (the base
    models repeated, mode-major), and record each mode's fit in ``fits``. ``lam_of(eigenvalues,
    |theta*|^2)`` gives the prior precision of a mode."""
    n_modes = next(iter(base.values())).shape[0]
    s_tot = n_modes * n_per_mode
    dev = setup.device
    h, loss = full_curvature(
        setup.make_model,
        base,
        setup.x,
        setup.y,
        arch=setup.arch,
        hessian=hessian,
        chunk_size=chunk_size or (2000 if setup.arch == "optunet" else 256),
        progress=progress,
    )
    names = flat_names(setup.make_model)
    d = h.shape[-1]
    z = torch.randn(n_modes, d, n_per_mode, generator=gen, dtype=torch.float64).to(dev)
    flat = []
    for i in range(n_modes):
        check_finite(h[i], "GGN" if hessian == "ggn" else "Hessian", i)
        hs = 0.5 * (h[i] + h[i].T)
        with threads.single():  # small dense LAPACK: 10-30x slower threaded on a busy CPU
            eigs, vecs = torch.linalg.eigh(hs)
        mean = torch.cat([base[k][i].reshape(-1).to(torch.float64) for k, _ in names])
        sq = float(mean @ mean)
        lam = lam_of(eigs, sq)
        with threads.single():  # small dense LAPACK: 10-30x slower threaded on a busy CPU
            chol, info = torch.linalg.cholesky_ex(hs + lam * torch.eye(d, dtype=hs.dtype, device=dev))
        if int(info):
            raise torch.linalg.LinAlgError(
                f"the posterior precision H + lambda I of mode {i} is not positive definite (smallest "
                f"curvature eigenvalue {float(eigs[0]):.3g}, lambda {lam:.3g}): the exact Hessian is "
                f"indefinite away from a minimum; use hessian='ggn' or a larger prior_precision"
            )
        dz = torch.linalg.solve_triangular(chol.T, z[i], upper=True)  # L^{-T} z, (D, S)
        flat.append(mean[:, None] + dz)
        logz = float(log_marginal_likelihood(eigs, sq, -float(loss[i]), lam))
        train_loss = float(loss[i]) / setup.n_train
        min_eig = float(eigs[0])
        cov_diag = (vecs.square() / (eigs + lam)).sum(1)  # diag of V diag(1 / (h + lambda)) V^T
        fits.add(lam, logz, train_loss, min_eig, float(cov_diag.sqrt().mean()))
    flat = torch.stack(flat).permute(0, 2, 1).reshape(s_tot, d)
    start = 0
    for k, shape in names:
        n = math.prod(shape)
        out[k] = flat[:, start : start + n].reshape(s_tot, *shape).to(out[k].dtype)
        start += n
