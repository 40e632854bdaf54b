r"""Last-layer KFAC (Ritter et al. 2018), laplace-torch's ``subset_of_weights="last_layer",
hessian_structure="kron"`` (book: chapter "Table 1").

The network in eval mode is a fixed feature map :math:`a_n`; the last layer's GGN is approximated by
Kronecker factors :math:`G \otimes A` (:func:`kron_factors`), and the prior is added exactly to the
eigenvalues of the Kronecker product (:class:`KronPosterior`), as laplace-torch's ``KronDecomposed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from symlib import progress as _progress
from symlib import threads
from symlib.params import Params
from symlib.posteriors.laplace.curvature import check_finite
from symlib.posteriors.laplace.evidence import Fits, log_marginal_likelihood

__all__ = ["BIAS", "KronFactors", "KronPosterior", "kron_factors", "last_layer_name"]

BIAS = ("separate", "augmented")


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
            check_finite(g, "KFAC output factor G", i)
            check_finite(a, "KFAC input factor A", i)
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
        with threads.single():
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
        """The mode's last-layer parameters flattened as the precision orders them."""
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


def sample_kron(
    setup,
    base: Params,
    n_per_mode: int,
    gen: torch.Generator,
    out: Params,
    fits: Fits,
    *,
    lam_of: Callable[[torch.Tensor, float], float],
    last_layer: str | None,
    bias: str,
    chunk_size: int | None,
    progress: bool,
) -> str:
    r"""Draw ``n_per_mode`` samples of the last layer around every base model from its KFAC Laplace
    posterior into ``out`` (the base models repeated, mode-major), and record each mode's fit in ``fits``.
    Returns the name of the last layer."""
    dev = setup.device
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
        lam = lam_of(eigs, sq)
        post = KronPosterior(fac, lam)
        z = torch.randn(n_per_mode, mean.numel(), generator=gen, dtype=torch.float64).to(dev)
        w, b = post.sample(z)
        sl = slice(i * n_per_mode, (i + 1) * n_per_mode)
        out[f"{model_name}.weight"][sl] = w.to(out[f"{model_name}.weight"].dtype)
        if b is not None:
            out[f"{model_name}.bias"][sl] = b.to(out[f"{model_name}.bias"].dtype)
        logz = float(log_marginal_likelihood(eigs, sq, -fac.loss, lam))
        train_loss = fac.loss / fac.n
        min_eig = float(eigs.min())
        mean_std = float((1.0 / (eigs + lam)).sqrt().mean())  # exact in the eigenbasis
        fits.add(lam, logz, train_loss, min_eig, mean_std)
    return model_name
