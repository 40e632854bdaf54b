r"""The Laplace approximation as a posterior sample set (book: chapter "Table 1"; paper §4, App. B).

Around a trained network :math:`\theta^*` (a *mode*), the Laplace approximation is the Gaussian
:math:`\mathcal N(\theta^*, P^{-1})` whose precision is the curvature of the negative log posterior,

.. math:: P = \sum_{n=1}^N J_n^\top \Lambda_n J_n + \lambda I, \qquad
          \Lambda_n = \mathrm{diag}(p_n) - p_n p_n^\top,

with :math:`J_n = \partial \ell(x_n; \theta) / \partial \theta` the Jacobian of the logits and
:math:`p_n = \mathrm{softmax}(\ell_n)`: the generalised Gauss-Newton matrix (GGN) of the cross-entropy,
which for a softmax likelihood is also its Fisher. As in laplace-torch (Daxberger et al. 2021), whose
log posterior is :math:`\sum_n \log p(y_n \mid x_n, \theta) + \log p(\theta)`, the curvature is *summed*
over the training set, not averaged, and the prior is :math:`\mathcal N(0, \lambda^{-1} I)`.

Two structures, as in the paper (App. B.2-B.3; NOTES "Methods of Table 1"):

* ``structure="full"`` (OptuNet): the dense :math:`392 \times 392` GGN over all parameters, what
  laplace-torch's ``Laplace(model, "classification", subset_of_weights="all",
  hessian_structure="full")`` computes (its backends return the GGN for that call: the paper's "full
  Hessian" is most likely this full GGN, our default). ``hessian="full"`` gives the exact Hessian of the
  summed cross-entropy instead (:func:`full_curvature`); it is indefinite away from an exact minimum, so
  it can fail where the GGN cannot. For OptuNet both are assembled from per-example feature Jacobians
  (and, for the Hessian, the features' only non-vanishing second derivatives) written by hand
  (:func:`_optunet_ggn_chunk`, exact, float64, batched over the modes): seconds for 10 modes on 4,000
  digits. Other small networks use ``torch.func`` (``vmap`` of ``jacrev``, or ``hessian``).
* ``structure="kron"`` (ResNet-18): last-layer KFAC (Ritter et al. 2018), laplace-torch's
  ``subset_of_weights="last_layer", hessian_structure="kron"``: the network in eval mode is a fixed
  feature map :math:`a_n`, and the last layer's GGN is approximated by Kronecker factors
  :math:`G \otimes A` with :math:`G = \sum_n \Lambda_n` and :math:`A = \tfrac1N \sum_n a_n a_n^\top`
  (weights flattened row-major, :math:`W_{oi} \mapsto o \cdot d_{in} + i`). laplace-torch (curvlinops
  backend, ``separate_weight_and_bias=True``) gives the bias its own block :math:`G` (``bias="separate"``,
  our default); ``bias="augmented"`` uses one factor :math:`G \otimes \bar A` on :math:`[W \mid b]`
  with :math:`\bar a_n = (a_n, 1)`. The prior is added *exactly* to the eigenvalues of the Kronecker
  product, as laplace-torch's ``KronDecomposed`` does: :math:`P = (Q_G \otimes Q_A)\,
  (\mathrm{diag}(g \otimes a) + \lambda)\,(Q_G \otimes Q_A)^\top`. Samples perturb only the last layer;
  the rest of the state dict (BatchNorm buffers included) is the base model's.

**Prior precision.** Default (``prior_precision=None``): :math:`\lambda = N \cdot wd` from the recipe's
weight decay (:attr:`~symlib.posteriors.base.Setup.prior_precision`), the prior SGD with weight decay
finds the mode of. (laplace-torch's own default is :math:`\lambda = 1`.) ``tune="marglik"`` instead
maximises the Laplace evidence over a scalar :math:`\lambda` per mode (:func:`tune_prior_precision`).

The GGN is singular: the network's function does not change along its symmetries' orbits (OptuNet's
positive rescalings across ReLU / max-pool, the softmax's shift of all logits), so those directions have
zero curvature and posterior variance :math:`1 / \lambda`, the prior's: the prior alone sets how far
the samples spread along the symmetries.

**Samples.** :math:`\theta = \theta^* + L^{-\top} z` with :math:`P = L L^\top` (Cholesky) and
:math:`z \sim \mathcal N(0, I)`, so :math:`\mathrm{Cov}\,\theta = P^{-1}`; KFAC samples in the
eigenbasis, :math:`P^{-1/2} z`. Every sample is a full state dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from symlib import progress as _progress
from symlib import scales as _scales
from symlib import train as _train
from symlib.posteriors import sampling
from symlib.posteriors.base import Params, SampleSet, Setup

STRUCTURES = ("full", "kron")
HESSIANS = ("ggn", "full")
BIAS = ("separate", "augmented")
DEFAULT_STRUCTURE = {"optunet": "full", "mlp": "full", "resnet18": "kron", "resnet20": "kron"}
_LAPLACE_TORCH = {"full": ("all", "full"), "kron": ("last_layer", "kron")}


# ----------------------------------------------------------------------------- checks


def check_prior_precision(lam: Any) -> float:
    """Return ``lam`` as a float if it is a finite positive number, else raise a clear error."""
    if isinstance(lam, bool) or not isinstance(lam, (int, float, np.floating, np.integer)):
        raise TypeError(f"prior_precision must be a positive number, got {type(lam).__name__} {lam!r}")
    if not math.isfinite(lam) or lam <= 0:
        raise ValueError(
            f"prior_precision must be a finite positive number (the precision of the Gaussian prior "
            f"N(0, 1/lambda)), got {lam!r}; with prior_precision=None it comes from the weight decay "
            f"(N * wd), which needs a recipe with weight_decay > 0"
        )
    return float(lam)


def _check_finite(h: torch.Tensor, what: str, mode: int) -> None:
    if not torch.isfinite(h).all():
        raise FloatingPointError(
            f"the {what} of mode {mode} is not finite (NaN or inf): the base model's logits overflow or its "
            f"weights are not finite; check the base models and the data"
        )


@contextlib.contextmanager
def _one_thread():
    """Run small dense LAPACK calls (eigh, Cholesky of a few hundred rows) on one CPU thread: threads
    gain nothing at this size, and multithreaded LAPACK slows down by 10-30x on an oversubscribed CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# ----------------------------------------------------------------------------- full curvature


@torch.no_grad()
def _optunet_feature_jacobian(
    theta: Params, x: torch.Tensor, second: bool = False
) -> tuple[torch.Tensor, ...]:
    r"""Features of ``M`` stacked OptuNets on shared images and their exact per-example Jacobians.

    OptuNet's feature :math:`f_j`, :math:`j = 5c + o`, depends only on conv 1's channel :math:`c`
    (16 weights) and on conv 2's kernel :math:`j` (25 weights, group :math:`c`), so its Jacobian is
    stored compactly as 41 numbers: with the pooled maps :math:`a_c = \mathrm{relu}(\max_{3\times3} z_c)`,
    the conv-2 pre-activations :math:`u` and their patches :math:`P`,

    .. math:: \frac{\partial f_j}{\partial w^{(2)}_j} = \tfrac1{16} \sum_{pq} 1[u_{j,pq} > 0]\, P_{c,pq},
              \qquad
              \frac{\partial f_j}{\partial w^{(1)}_c} = \sum_{rs} \frac{\partial f_j}{\partial a_{c,rs}}\,
              1[a_{c,rs} > 0]\, X_{\arg\max(rs)},

    where :math:`X_{\arg\max(rs)}` is the 4x4 input patch under the maximum of pooling window
    :math:`rs` (the first maximum in row-major order, PyTorch's rule).

    Args:
        theta: stacked OptuNet parameters ``(M, ...)``.
        x: images ``(B, 1, 28, 28)``, shared by the models.

    With ``second=True`` it also returns the only second derivatives of the features that are not zero
    almost everywhere (OptuNet is piecewise linear in each layer's weights), the cross terms
    :math:`\partial^2 f_j / \partial w^{(2)}_{j,k} \partial w^{(1)}_c = \tfrac1{16} \sum_{pq}
    1[u_{j,pq} > 0]\, 1[a_{c,(pq)+k} > 0]\, X_{\arg\max((pq)+k)}`, as ``d2 (M, 10, B, 16, 25)``.

    Returns:
        ``(f (M, B, 10), jf (M, 10, B, 41), logits (M, B, 10)[, d2])``; ``jf[:, j, :, :16]`` is
        :math:`\partial f_j / \partial w^{(1)}_{c}`, ``jf[:, j, :, 16:]`` :math:`\partial f_j / \partial
        w^{(2)}_j`.
    """
    w1, w2, fw, fb = (theta[k] for k in _train.OPTUNET_SHAPES)
    m, b = w1.shape[0], x.shape[0]
    # conv-1 patches ordered (image, pooling window (r, s), window entry (di, dj)): (B, 64, 9, 16)
    x1 = x[:, 0].unfold(1, 4, 1).unfold(2, 4, 1)[:, :24, :24].reshape(b, 8, 3, 8, 3, 16)
    x1 = x1.permute(0, 1, 3, 2, 4, 5).reshape(b, 64, 9, 16)
    z = (w1.reshape(m * 2, 16) @ x1.reshape(b * 576, 16).T).view(m, 2, b, 64, 9)
    zmax, arg = z.max(-1)  # first maximum (CPU and CUDA)
    a = zmax.clamp_min(0)  # (m, c, b, 64)
    # conv 2: patches of a_c, (m, c, b, 16 positions pq, 25 kernel entries)
    p2 = a.view(m, 2, b, 8, 8).unfold(3, 5, 1).unfold(4, 5, 1).reshape(m * 2, b * 16, 25)
    w2g = w2.reshape(m * 2, 5, 25)
    u = torch.bmm(p2, w2g.transpose(1, 2)).view(m * 2, b, 16, 5)
    mask = (u > 0).to(x.dtype).div_(16)
    f = u.clamp_min(0).sum(2).div_(16).view(m, 2, b, 5).permute(0, 2, 1, 3).reshape(m, b, 10)
    mask_t = mask.permute(0, 3, 1, 2)  # (m c, o, b, pq)
    p2b = p2.view(m * 2, b, 16, 25)
    jw2 = torch.einsum("nobp,nbpk->nobk", mask_t, p2b)  # (m c, o, b, 25)
    t2 = F.pad(w2g, (0, 1))[..., _conv2_index(str(x.device))]  # (m c, o, pq, rs): d u_pq / d a_rs
    dfa = torch.bmm(mask_t.reshape(m * 10, b, 16), t2.reshape(m * 10, 16, 64)).view(m * 2, 5, b, 64)
    dfa = dfa * (zmax > 0).to(x.dtype).view(m * 2, 1, b, 64)
    # sum over windows of dfa times the conv-1 patch under each window's maximum
    rows = arg + torch.arange(b, device=x.device).view(b, 1) * 576 + torch.arange(0, 576, 9, device=x.device)
    xsel = x1.reshape(b * 576, 16).index_select(0, rows.reshape(-1)).view(m * 2 * b, 64, 16)
    jw1 = torch.bmm(dfa.transpose(1, 2).reshape(m * 2 * b, 5, 64), xsel).view(m * 2, b, 5, 16).transpose(1, 2)
    jf = torch.cat([jw1, jw2], -1).view(m, 10, b, 41)
    logits = torch.baddbmm(fb[:, None, :], f, fw.transpose(1, 2))
    if not second:
        return f, jf, logits
    gate = xsel.view(m * 2, b, 8, 8, 16) * (zmax > 0).to(x.dtype).view(m * 2, b, 8, 8, 1)
    gp = gate.unfold(2, 5, 1).unfold(3, 5, 1).reshape(m * 2 * b, 16, 400)  # (pq, (w1 entry, w2 entry))
    d2 = torch.bmm(mask.transpose(2, 3).reshape(m * 2 * b, 5, 16), gp).view(m * 2, b, 5, 16, 25)
    return f, jf, logits, d2.transpose(1, 2).reshape(m, 10, b, 16, 25)


_CONV2_INDEX: dict[str, torch.Tensor] = {}


def _conv2_index(device: str) -> torch.Tensor:
    """``(16, 64)``: entry of a 5x5 kernel (or 25: zero) linking conv-2 output ``pq`` to input ``rs``."""
    if device not in _CONV2_INDEX:
        p, q = torch.arange(4).view(4, 1, 1, 1), torch.arange(4).view(1, 4, 1, 1)
        r, s = torch.arange(8).view(1, 1, 8, 1), torch.arange(8).view(1, 1, 1, 8)
        di, dj = r - p, s - q
        inside = (di >= 0) & (di < 5) & (dj >= 0) & (dj < 5)
        idx = torch.where(inside, di.clamp(0, 4) * 5 + dj.clamp(0, 4), 25).reshape(16, 64)
        _CONV2_INDEX[device] = idx.to(device)
    return _CONV2_INDEX[device]


def _optunet_compact_map(device: torch.device) -> torch.Tensor:
    """``(520, 392)`` 0/1 matrix from the compact coordinates of :func:`_optunet_ggn_chunk` (10 features
    x 41, then the last layer's 10 x 11 ``[W | b]``) to OptuNet's flat parameter vector."""
    rows = []
    for j in range(10):
        c = j // 5
        rows += [c * 16 + q for q in range(16)] + [32 + j * 25 + q for q in range(25)]
    rows += [282 + k * 10 + i if i < 10 else 382 + k for k in range(10) for i in range(11)]
    p = torch.zeros(520, 392, dtype=torch.float64, device=device)
    p[torch.arange(520), torch.tensor(rows)] = 1.0
    return p


def _optunet_ggn_chunk(
    theta: Params, x: torch.Tensor, y: torch.Tensor, hessian: str = "ggn"
) -> tuple[list[torch.Tensor], torch.Tensor]:
    r"""GGN of ``M`` stacked OptuNets on one chunk of images, in compact coordinates, and the summed loss.

    With :math:`\ell = W f + b`, :math:`\Lambda = \mathrm{diag}(p) - p p^\top` and the compact feature
    Jacobians :math:`F_n` (:func:`_optunet_feature_jacobian`), the GGN blocks are
    :math:`\sum_n F_n^\top (W^\top \Lambda_n W) F_n` (convolutions),
    :math:`\sum_n F_n^\top W^\top \Lambda_n (I \otimes \bar f_n^\top)` (convolutions x last layer) and
    :math:`\sum_n \Lambda_n \otimes \bar f_n \bar f_n^\top` (last layer, :math:`\bar f = (f, 1)`), each
    one batched product over the chunk.

    ``hessian="full"`` adds the exact Hessian's remaining term :math:`\sum_n \sum_k r_{nk} \nabla^2
    \ell_{nk}` (:math:`r_n = p_n - e_{y_n}`): :math:`\partial^2 \ell_k / \partial W_{kj} \partial
    \theta_{conv} = \partial f_j / \partial \theta_{conv}` and :math:`\sum_j (W^\top r_n)_j\,
    \partial^2 f_j / \partial w^{(1)} \partial w^{(2)}` (the other second derivatives vanish a.e.).

    Returns:
        ``([cc (M, 410, 410), cf (M, 410, 110), ff (M, 110, 110), dd (M, 10, 11, 11)], loss (M,))``: the
        last-layer block is ``blockdiag(dd) - ff``; :func:`_assemble_optunet` maps them to OptuNet's
        coordinates.
    """
    f, jf, logits, *d2 = _optunet_feature_jacobian(theta, x, second=hessian == "full")
    m, b = f.shape[:2]
    fw = theta["fc.weight"]
    logp = torch.log_softmax(logits, -1)
    loss = -logp.gather(2, y.expand(m, b)[..., None]).squeeze(-1).sum(1)
    p = logp.exp()  # (m, b, 10)
    wp = torch.bmm(p, fw)  # W^T p, (m, b, 10 features)
    ww = (fw[:, :, :, None] * fw[:, :, None, :]).reshape(m, 10, 100)
    kk = (torch.bmm(p, ww).view(m, b, 10, 10) - wp[..., :, None] * wp[..., None, :]).transpose(1, 2)
    wl = p[:, :, None, :] * (fw.transpose(1, 2)[:, None] - wp[..., :, None])  # W^T Lambda, (m, b, j, l)
    jf_t = jf.reshape(m * 10, b, 41).transpose(1, 2)
    t = torch.mul(
        kk[..., None], jf.transpose(1, 2)[:, None], out=x.new_empty(m, 10, b, 10, 41)
    )  # (m j b k r)
    cc = torch.bmm(jf_t, t.view(m * 10, b, 410)).view(m, 410, 410)
    fbar = torch.cat([f, torch.ones_like(f[..., :1])], -1)  # (m, b, 11)
    r = torch.mul(wl.transpose(1, 2)[..., None], fbar[:, None, :, None, :], out=x.new_empty(m, 10, b, 10, 11))
    cf = torch.bmm(jf_t, r.view(m * 10, b, 110)).view(m, 410, 110)
    pf = (p[..., None] * fbar[:, :, None, :]).view(m, b, 110)
    ff = torch.bmm(pf.transpose(1, 2), pf)
    dd = torch.bmm(pf.transpose(1, 2), fbar).view(m, 10, 11, 11)
    if hessian == "full":
        r = p.scatter_add(2, y.expand(m, b)[..., None], -torch.ones_like(p[..., :1]))  # p - e_y
        u = torch.bmm(r, fw)  # (m, b, 10 features)
        rw = torch.einsum("mjbfk,mbj->mjfk", d2[0], u)  # (m, j, w1 entry, w2 entry)
        jj = torch.arange(10, device=x.device)
        cc5 = cc.view(m, 10, 41, 10, 41)
        cc5[:, jj, :16, jj, 16:] += rw.transpose(0, 1)
        cc5[:, jj, 16:, jj, :16] += rw.transpose(0, 1).transpose(2, 3)
        e = torch.bmm(jf_t, r[:, None].expand(m, 10, b, 10).reshape(m * 10, b, 10)).view(m, 10, 41, 10)
        cf.view(m, 10, 41, 10, 11)[:, jj, :, :, jj] += e.transpose(0, 1)
    return [cc, cf, ff, dd], loss


def _assemble_optunet(cc: torch.Tensor, cf: torch.Tensor, ff: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
    """The GGN ``(M, 392, 392)`` in OptuNet's flat coordinates from the compact blocks."""
    last = _block_diag(dd) - ff
    c = torch.cat([torch.cat([cc, cf], 2), torch.cat([cf.transpose(1, 2), last], 2)], 1)
    p = _optunet_compact_map(c.device)
    return p.T @ c @ p


def _block_diag(d: torch.Tensor) -> torch.Tensor:
    """``(M, K, n, n)`` -> ``(M, K n, K n)`` block-diagonal matrices."""
    m, k, n, _ = d.shape
    out = torch.zeros(m, k, n, k, n, dtype=d.dtype, device=d.device)
    idx = torch.arange(k, device=d.device)
    out[:, idx, :, idx, :] = d.transpose(0, 1)
    return out.reshape(m, k * n, k * n)


def _flat_names(make_model: Callable[[], nn.Module]) -> list[tuple[str, tuple[int, ...]]]:
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
        theta = {k: base[k].to(dev, torch.float64) for k in _train.OPTUNET_SHAPES}
        acc: list[torch.Tensor] | None = None
        loss = torch.zeros(m, dtype=torch.float64, device=dev)
        step = max(1, chunk_size // m)
        for s in range(0, n, step):
            blocks, li = _optunet_ggn_chunk(
                theta, x[s : s + step].to(torch.float64), y[s : s + step], hessian
            )
            acc = blocks if acc is None else [u.add_(v) for u, v in zip(acc, blocks, strict=True)]
            loss += li
            bar.update(min(step, n - s))
        bar.close()
        return _assemble_optunet(*acc), loss
    model = make_model().to(dev).double().eval()
    names = _flat_names(make_model)
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


# ----------------------------------------------------------------------------- last-layer KFAC


def last_layer_name(model: nn.Module, name: str | None = None) -> str:
    """The name of the network's last ``nn.Linear`` (the last one in ``named_modules()`` order), or
    ``name`` after checking that it is a ``nn.Linear``."""
    mods = dict(model.named_modules())
    if name is not None:
        if not isinstance(mods.get(name), nn.Linear):
            raise ValueError(
                f"last_layer={name!r} is not an nn.Linear of {type(model).__name__} "
                f"(linear layers: {[k for k, v in mods.items() if isinstance(v, nn.Linear)]})"
            )
        return name
    linear = [k for k, v in mods.items() if isinstance(v, nn.Linear)]
    if not linear:
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear layer: last-layer KFAC needs a linear head"
        )
    return linear[-1]


@dataclasses.dataclass
class KronFactors:
    r"""Kronecker factors of one mode's last layer: :math:`G = \sum_n \Lambda_n` (outputs),
    :math:`A = \tfrac1N \sum_n a_n a_n^\top` (inputs, with a trailing 1 when ``bias="augmented"``), the
    layer's weights and bias at the mode, the summed training loss and :math:`N`."""

    g: torch.Tensor
    a: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    loss: float
    n: int
    augmented: bool


@torch.no_grad()
def kron_factors(
    make_model: Callable[[], nn.Module],
    base: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    last_layer: str | None = None,
    bias: str = "separate",
    chunk_size: int = 256,
    progress: bool = False,
) -> list[KronFactors]:
    r"""Last-layer KFAC factors of every stacked base model (laplace-torch's conventions, see module doc).

    The network runs in eval mode (BatchNorm with its running statistics) on the un-augmented training
    set; the features :math:`a_n` are the inputs of the last ``nn.Linear``; the factors accumulate in
    float64.
    """
    if bias not in BIAS:
        raise ValueError(f"bias must be one of {BIAS}, got {bias!r}")
    dev = x.device
    model = make_model().to(dev).eval()
    name = last_layer_name(model, last_layer)
    layer = dict(model.named_modules())[name]
    dtype = next(iter(v for v in base.values() if v.is_floating_point())).dtype
    model = model.to(dtype)
    captured: list[torch.Tensor] = []
    hook = layer.register_forward_hook(lambda mod, inp, out: captured.append(inp[0]))
    m, n = next(iter(base.values())).shape[0], x.shape[0]
    out: list[KronFactors] = []
    bar = _progress.bar(total=m * n, desc="laplace last-layer KFAC", enabled=progress)
    try:
        for i in range(m):
            state = {k: v[i] for k, v in base.items()}
            w, b = state[f"{name}.weight"], state.get(f"{name}.bias")
            aug = bias == "augmented" and b is not None
            d_in = w.shape[1] + int(aug)
            g = torch.zeros(w.shape[0], w.shape[0], dtype=torch.float64, device=dev)
            a = torch.zeros(d_in, d_in, dtype=torch.float64, device=dev)
            loss = 0.0
            for s in range(0, n, chunk_size):
                captured.clear()
                logits = torch.func.functional_call(model, state, (x[s : s + chunk_size].to(dtype),))
                feats = captured[0].reshape(logits.shape[0], -1).to(torch.float64)
                if aug:
                    feats = torch.cat([feats, torch.ones_like(feats[:, :1])], 1)
                logp = torch.log_softmax(logits.to(torch.float64), -1)
                p = logp.exp()
                g += torch.diag(p.sum(0)) - p.T @ p
                a += feats.T @ feats
                loss -= float(logp.gather(1, y[s : s + chunk_size, None]).sum())
                bar.update(logits.shape[0])
            a /= n
            _check_finite(g, "KFAC output factor G", i)
            _check_finite(a, "KFAC input factor A", i)
            out.append(
                KronFactors(
                    g, a, w.to(torch.float64), None if b is None else b.to(torch.float64), loss, n, aug
                )
            )
    finally:
        hook.remove()
        bar.close()
    return out


@dataclasses.dataclass
class KronPosterior:
    r"""Last-layer KFAC Laplace posterior of one mode: the eigendecompositions :math:`G = Q_G\,
    \mathrm{diag}(g)\, Q_G^\top`, :math:`A = Q_A\, \mathrm{diag}(a)\, Q_A^\top` and the prior precision
    :math:`\lambda`; precision :math:`(Q_G \otimes Q_A)(\mathrm{diag}(g \otimes a) + \lambda)(Q_G \otimes
    Q_A)^\top` on the flattened weights (and :math:`Q_G (\mathrm{diag}(g) + \lambda) Q_G^\top` on a
    separate bias)."""

    factors: KronFactors
    prior_precision: float

    def __post_init__(self):
        with _one_thread():
            self.g_eig, self.qg = torch.linalg.eigh(self.factors.g)
            self.a_eig, self.qa = torch.linalg.eigh(self.factors.a)

    @property
    def separate_bias(self) -> bool:
        return self.factors.bias is not None and not self.factors.augmented

    def curvature_eigenvalues(self) -> torch.Tensor:
        """Eigenvalues of the likelihood curvature (without the prior), all last-layer parameters."""
        e = torch.outer(self.g_eig, self.a_eig).reshape(-1)
        return torch.cat([e, self.g_eig]) if self.separate_bias else e

    def mean(self) -> torch.Tensor:
        f = self.factors
        if f.bias is None:
            return f.weight.reshape(-1)
        if f.augmented:
            return torch.cat([f.weight, f.bias[:, None]], 1).reshape(-1)
        return torch.cat([f.weight.reshape(-1), f.bias])

    def precision(self) -> torch.Tensor:
        """The dense posterior precision over ``[vec(W), b]`` (``vec([W | b])`` when augmented; tests)."""
        q = torch.kron(self.qg, self.qa)
        blocks = [
            q @ torch.diag(torch.outer(self.g_eig, self.a_eig).reshape(-1) + self.prior_precision) @ q.T
        ]
        if self.separate_bias:
            blocks.append(self.qg @ torch.diag(self.g_eig + self.prior_precision) @ self.qg.T)
        return torch.block_diag(*blocks)

    def sample(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        r"""Weights and bias ``(S, out, in)``, ``(S, out)`` from standard normal ``z (S, D)``:
        :math:`\theta^* + P^{-1/2} z` in the Kronecker eigenbasis."""
        f, lam = self.factors, self.prior_precision
        o, i = f.g.shape[0], f.a.shape[0]
        zw = z[:, : o * i].reshape(-1, o, i)
        scale = (torch.outer(self.g_eig, self.a_eig) + lam).rsqrt()
        dw = self.qg @ ((self.qg.T @ zw @ self.qa) * scale) @ self.qa.T
        if f.bias is None:
            return f.weight + dw, None
        if f.augmented:
            full = torch.cat([f.weight, f.bias[:, None]], 1) + dw
            return full[..., :-1], full[..., -1]
        zb = z[:, o * i :]
        db = ((zb @ self.qg) * (self.g_eig + lam).rsqrt()) @ self.qg.T
        return f.weight + dw, f.bias + db


# ----------------------------------------------------------------------------- marginal likelihood


def log_marginal_likelihood(
    eigs: torch.Tensor, sq_norm: float, log_lik: float, prior_precision: float | torch.Tensor
) -> torch.Tensor:
    r"""Laplace evidence for an isotropic prior :math:`\mathcal N(0, \lambda^{-1} I)` (laplace-torch's
    ``log_marginal_likelihood``):

    .. math:: \log Z(\lambda) = \log p(D \mid \theta^*) - \tfrac12 \Big[ \sum_i \log(h_i + \lambda)
              - D \log \lambda + \lambda \lVert \theta^* \rVert^2 \Big],

    with :math:`h_i` the eigenvalues of the likelihood curvature (so :math:`\log\det P` in closed form
    for every :math:`\lambda`). ``prior_precision`` may be a tensor of values.
    """
    lam = torch.as_tensor(prior_precision, dtype=torch.float64, device=eigs.device)
    lead = lam.shape
    lam = lam.reshape(-1, 1)
    logdet = torch.log(eigs[None, :] + lam).sum(1) - eigs.numel() * torch.log(lam[:, 0])
    return (log_lik - 0.5 * (logdet + lam[:, 0] * sq_norm)).reshape(lead)


def tune_prior_precision(
    eigs: torch.Tensor, sq_norm: float, search_range: tuple[float, float] = (1e-6, 1e8), n_grid: int = 141
) -> float:
    r"""The prior precision that maximises :func:`log_marginal_likelihood`.

    A log-spaced grid locates the maximum, then Brent's method solves the stationarity condition
    :math:`\partial_\lambda \log Z = 0`, i.e. MacKay's :math:`\gamma(\lambda) = \sum_i \frac{h_i}{h_i +
    \lambda} = \lambda \lVert \theta^* \rVert^2` (for PSD curvature the root is unique).

    Raises:
        ValueError: the maximum sits on the edge of ``search_range`` (widen it).
    """
    from scipy.optimize import brentq

    lo, hi = search_range
    check_prior_precision(lo), check_prior_precision(hi)
    floor = float(-eigs.min()) if float(eigs.min()) < 0 else 0.0
    grid = torch.logspace(
        math.log10(max(lo, floor * (1 + 1e-9) + 1e-300)), math.log10(hi), n_grid, dtype=torch.float64
    )
    vals = log_marginal_likelihood(eigs, sq_norm, 0.0, grid)
    k = int(torch.nan_to_num(vals, nan=-math.inf).argmax())
    if k in (0, n_grid - 1):
        raise ValueError(
            f"the Laplace marginal likelihood is largest at the edge of the search range "
            f"({float(grid[k]):.3g}); widen marglik_range={search_range}"
        )
    e = eigs.double().cpu().numpy()

    def deriv(log_lam: float) -> float:  # 2 lambda d log Z / d lambda
        lam = math.exp(log_lam)
        return float(e.size - np.sum(lam / (e + lam)) - lam * sq_norm)

    a, b = math.log(float(grid[k - 1])), math.log(float(grid[k + 1]))
    if deriv(a) * deriv(b) > 0:
        return float(grid[k])
    return math.exp(brentq(deriv, a, b, xtol=1e-12, rtol=1e-12))


# ----------------------------------------------------------------------------- sampling


def _seed_of(seed: int) -> int:
    _scales.check_int("seed", seed, 0)
    return int(
        np.random.SeedSequence([int(seed), zlib.crc32(b"laplace")]).generate_state(1, np.uint64)[0] >> 1
    )


def sample(
    setup: Setup,
    n_modes: int,
    n_per_mode: int,
    seed: int = 0,
    *,
    base: Params | None = None,
    progress: bool = True,
    structure: str | None = None,
    hessian: str = "ggn",
    prior_precision: float | None = None,
    tune: str | None = None,
    marglik_range: tuple[float, float] = (1e-6, 1e8),
    bias: str = "separate",
    last_layer: str | None = None,
    chunk_size: int | None = None,
    base_seeds: Sequence[int] | None = None,
) -> SampleSet:
    r"""Laplace approximations around ``n_modes`` trained base models, ``n_per_mode`` samples each.

    Args:
        setup: the training problem (its data is the data of the curvature).
        n_modes, n_per_mode: sizes (one-mode: 1; the paper's multi-mode: 10 x 10).
        seed: seed of the Gaussian draws.
        base: stacked trained base models ``(n_modes, ...)`` (required).
        progress: progress bars.
        structure: ``"full"`` (all weights, dense; default for OptuNet and MLPs) or ``"kron"`` (last-layer
            KFAC; default for the ResNets).
        hessian: ``"ggn"`` (default, laplace-torch's) or ``"full"`` (exact Hessian; ``structure="full"``).
        prior_precision: :math:`\lambda`; default ``setup.prior_precision`` (:math:`N \cdot wd`).
        tune: ``None`` (default: keep :math:`\lambda`) or ``"marglik"`` (maximise the Laplace evidence
            over a scalar :math:`\lambda`, per mode, within ``marglik_range``).
        bias: KFAC's bias: ``"separate"`` (laplace-torch) or ``"augmented"``.
        last_layer: name of the last ``nn.Linear`` (default: found).
        chunk_size: images per chunk of the curvature pass.
        base_seeds: the base models' seeds, recorded in the manifest.

    Returns:
        ``SampleSet(method="laplace")``; ``diagnostics`` holds per mode the prior precision used, the log
        marginal likelihood, the mean training loss, the smallest curvature eigenvalue and the mean
        marginal posterior standard deviation.

    Raises:
        ValueError: no or wrong base models, a non-positive prior precision, bad options.
        FloatingPointError: a non-finite curvature.
        torch.linalg.LinAlgError: a posterior precision that is not positive definite (``hessian="full"``
            at SGD-trained OptuNets: the exact Hessian has eigenvalues near -2e3 there).
    """
    _scales.check_int("n_modes", n_modes, 1)
    _scales.check_int("n_per_mode", n_per_mode, 1)
    structure = DEFAULT_STRUCTURE.get(setup.arch, "kron") if structure is None else structure
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    if hessian not in HESSIANS:
        raise ValueError(f"hessian must be one of {HESSIANS}, got {hessian!r}")
    if hessian == "full" and structure != "full":
        raise ValueError("hessian='full' (exact Hessian) needs structure='full'; last-layer KFAC is a GGN")
    if bias not in BIAS:
        raise ValueError(f"bias must be one of {BIAS}, got {bias!r}")
    if tune not in (None, "marglik"):
        raise ValueError(f"tune must be None or 'marglik', got {tune!r}")
    if prior_precision is None and tune is None:
        lam0, source = check_prior_precision(setup.prior_precision), "weight_decay"
    elif prior_precision is not None:
        lam0, source = check_prior_precision(prior_precision), "given"
    else:
        lam0, source = None, "marglik"
    if tune == "marglik":
        source = "marglik"
    base = sampling.check_base(setup, base, n_modes, "laplace")
    gen = torch.Generator().manual_seed(_seed_of(seed))
    dev = setup.device
    lams, logz, losses, min_eig, mean_std = [], [], [], [], []
    out = {k: v.repeat_interleave(n_per_mode, 0).clone() for k, v in base.items()}
    s_tot = n_modes * n_per_mode

    if structure == "full":
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
        names = _flat_names(setup.make_model)
        d = h.shape[-1]
        z = torch.randn(n_modes, d, n_per_mode, generator=gen, dtype=torch.float64).to(dev)
        flat = []
        for i in range(n_modes):
            _check_finite(h[i], "GGN" if hessian == "ggn" else "Hessian", i)
            hs = 0.5 * (h[i] + h[i].T)
            with _one_thread():
                eigs, vecs = torch.linalg.eigh(hs)
            mean = torch.cat([base[k][i].reshape(-1).to(torch.float64) for k, _ in names])
            sq = float(mean @ mean)
            lam = tune_prior_precision(eigs, sq, marglik_range) if tune else lam0
            with _one_thread():
                chol, info = torch.linalg.cholesky_ex(hs + lam * torch.eye(d, dtype=hs.dtype, device=dev))
            if int(info):
                raise torch.linalg.LinAlgError(
                    f"the posterior precision H + lambda I of mode {i} is not positive definite (smallest "
                    f"curvature eigenvalue {float(eigs[0]):.3g}, lambda {lam:.3g}): the exact Hessian is "
                    f"indefinite away from a minimum; use hessian='ggn' or a larger prior_precision"
                )
            dz = torch.linalg.solve_triangular(chol.T, z[i], upper=True)  # L^{-T} z, (D, S)
            flat.append(mean[:, None] + dz)
            lams.append(lam)
            logz.append(float(log_marginal_likelihood(eigs, sq, -float(loss[i]), lam)))
            losses.append(float(loss[i]) / setup.n_train)
            min_eig.append(float(eigs[0]))
            cov_diag = (vecs.square() / (eigs + lam)).sum(1)  # diag of V diag(1 / (h + lambda)) V^T
            mean_std.append(float(cov_diag.sqrt().mean()))
        flat = torch.stack(flat).permute(0, 2, 1).reshape(s_tot, d)
        start = 0
        for k, shape in names:
            n = math.prod(shape)
            out[k] = flat[:, start : start + n].reshape(s_tot, *shape).to(out[k].dtype)
            start += n
    else:
        facs = kron_factors(
            setup.make_model,
            base,
            setup.x,
            setup.y,
            last_layer=last_layer,
            bias=bias,
            chunk_size=chunk_size or 256,
            progress=progress,
        )
        with torch.device("meta"):
            model_name = last_layer_name(setup.make_model(), last_layer)
        for i, fac in enumerate(facs):
            post0 = KronPosterior(fac, 1.0)
            eigs = post0.curvature_eigenvalues()
            mean = post0.mean()
            sq = float(mean @ mean)
            lam = tune_prior_precision(eigs, sq, marglik_range) if tune else lam0
            post = KronPosterior(fac, lam)
            z = torch.randn(n_per_mode, mean.numel(), generator=gen, dtype=torch.float64).to(dev)
            w, b = post.sample(z)
            sl = slice(i * n_per_mode, (i + 1) * n_per_mode)
            out[f"{model_name}.weight"][sl] = w.to(out[f"{model_name}.weight"].dtype)
            if b is not None:
                out[f"{model_name}.bias"][sl] = b.to(out[f"{model_name}.bias"].dtype)
            lams.append(lam)
            logz.append(float(log_marginal_likelihood(eigs, sq, -fac.loss, lam)))
            losses.append(fac.loss / fac.n)
            min_eig.append(float(eigs.min()))
            mean_std.append(float((1.0 / (eigs + lam)).sqrt().mean()))  # exact in the eigenbasis
    subset, hstruct = _LAPLACE_TORCH[structure]
    hyper: dict[str, Any] = {
        "structure": structure,
        "subset_of_weights": subset,
        "hessian_structure": hstruct,
        "hessian": hessian,
        "prior_precision": lam0,
        "prior_source": source,
        "tune": tune,
        "marglik_range": list(marglik_range) if tune else None,
        "n_train": setup.n_train,
        "likelihood": "classification (softmax cross-entropy), curvature summed over the training set",
    }
    if structure == "kron":
        hyper.update(bias=bias, last_layer=model_name)
    return SampleSet(
        params=out,
        method="laplace",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper=hyper,
        base_seeds=[int(s) for s in base_seeds] if base_seeds is not None else [],
        diagnostics={
            "prior_precision": lams,
            "log_marginal_likelihood": logz,
            "train_loss": losses,
            "min_curvature_eigenvalue": min_eig,
            "mean_posterior_std": mean_std,
        },
    )
