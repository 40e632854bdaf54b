r"""Exact moves along the scaling orbits of a network (book: chapter "Table 1"; Liu & Sabatti 2000).

Beyond the paper and every MCMC library we know. The likelihood of a ReLU network is constant on each
scaling orbit (a hidden neuron's incoming weights times :math:`a > 0`, its outgoing weights divided by
:math:`a`), so along an orbit the posterior only sees the prior and the orbit's volume. For neuron
:math:`u` with log-scale :math:`t` acting on entries :math:`j` with powers :math:`p_j` (+1 incoming, -1
outgoing), the *generalised Gibbs* step of Liu & Sabatti (2000) draws :math:`t` from

.. math:: f_u(t) \propto \exp\Big(-\frac{\lambda}{2} \sum_j e^{2 p_j t} \theta_j^2
          + t \sum_j p_j\Big)

(the Gaussian prior of precision :math:`\lambda` along the orbit; :math:`e^{t \sum_j p_j}` is the
Jacobian of the scaling, the Haar measure of the multiplicative group is :math:`dt`) and moves
:math:`\theta_j \leftarrow e^{p_j t} \theta_j`. This leaves the posterior invariant exactly.
:math:`\log f_u` is concave, so it is drawn by a few independence Metropolis-Hastings steps from a
Gaussian at its mode (found by Newton's method) with 1.2 times its Laplace width; the Gaussian's tails
are heavier than :math:`f_u`'s, so the acceptance stays high. Neurons of one label touch disjoint
entries and move together; labels move one after the other (:func:`symlib.symmetry.canonical.scale_order`).

Why it matters (measured on OptuNet, Table 1): at a mode of the posterior the scales are balanced
(incoming and outgoing norms equal after weighting), but the orbit's volume pulls the posterior's mass
elsewhere (:math:`\sum_j p_j = 16 - 125` for a first-layer channel of OptuNet: its incoming norm falls
from about 5.5 at the polished mode to about 3 under the posterior). HMC creeps along the orbits, and
its chains drift for thousands of gradients; one :class:`ScalingMoves` call puts every neuron at an
exact draw of its scale.
"""

from __future__ import annotations

import math

import torch

from symlib.symmetry import ops
from symlib.symmetry.canonical import scale_order
from symlib.symmetry.spec import Spec, SymmetryError

__all__ = ["ScalingMoves", "SoftmaxShift"]


class ScalingMoves:
    """Exact Gibbs moves along the scaling orbits of ``spec`` on flat stacked weights ``(C, D)``.

    Args:
        spec: the architecture's symmetries (:func:`symlib.symmetry.trace.spec_of`); every hidden layer
            with a scaling label must be positively homogeneous (``spec.require_scaling``, or a
            ``with_partial_scalings`` spec, whose labels are exactly the layers where scalings hold).
        shapes: ``name -> shape`` of the flat vector's tensors, in order (the sampler's layout); every
            tensor a scaling acts on must be among them.
        prior_precision: :math:`\\lambda` of the isotropic Gaussian prior of the sampled posterior.
        n_mh: independence Metropolis-Hastings steps per label and call.

    Raises:
        SymmetryError: the spec has no scaling labels, a scaling acts on a tensor outside ``shapes``,
            or on a BatchNorm running variance (an offset: not a linear map of the sampled weights).
    """

    def __init__(self, spec: Spec, shapes: dict[str, tuple[int, ...]], prior_precision: float,
                 n_mh: int = 3):
        spec.require_scaling()
        if not spec.scales:
            raise SymmetryError("this spec has no scaling symmetries: there are no orbits to move along")
        if not (prior_precision > 0 and math.isfinite(prior_precision)):
            raise ValueError(f"prior_precision must be positive and finite, got {prior_precision!r}")
        for a in spec.actions:
            if a.scale is None or a.power == 0:
                continue
            if a.param not in shapes:
                raise SymmetryError(
                    f"the scaling {a.scale!r} acts on {a.param!r}, which the sampled weights do not hold "
                    f"({sorted(shapes)}): sample every parameter the scalings touch, or use a "
                    "permutation-only spec (spec.without_scalings())"
                )
            if a.offset:
                raise SymmetryError(
                    f"the scaling {a.scale!r} acts on {a.param!r} with an offset (a BatchNorm running "
                    "variance): fold the BatchNorms into the convolutions before sampling"
                )
        self.lam, self.n_mh = float(prior_precision), int(n_mh)
        self.labels: list[tuple[str, torch.Tensor]] = []
        ones = {k: torch.ones(s, dtype=torch.float64) for k, s in shapes.items()}
        for label in scale_order(spec):
            n = spec.scales[label]
            rows = []
            for i in range(n):  # the log of the factor each entry gets when neuron i is scaled by e
                lam = torch.ones(n, dtype=torch.float64)
                lam[i] = math.e
                moved = ops.scale(ones, spec, {label: lam})
                rows.append(torch.cat([moved[k].log().flatten() for k in shapes]))
            self.labels.append((label, torch.stack(rows)))  # (n, D): p_j of every neuron
        self.powers = torch.cat([p for _, p in self.labels])  # (K, D): every neuron's exponents

    def _log_f(self, t, sq, powers, kappa):
        # -lam/2 sum_j exp(2 p_j t) theta_j^2 + kappa t, for t (C, n); sq (C, D); powers (n, D)
        e = torch.exp(2 * t[..., None] * powers)  # (C, n, D)
        return -0.5 * self.lam * (e * sq[:, None, :] * (powers != 0)).sum(-1) + kappa * t

    def _mode(self, sq, powers, kappa):
        """Newton's method on the concave :math:`\\log f` (steps clipped to 1 in :math:`t`)."""
        t = torch.zeros(sq.shape[0], powers.shape[0], dtype=torch.float64)
        mask = powers != 0
        for _ in range(50):
            e = torch.exp(2 * t[..., None] * powers) * sq[:, None, :] * mask
            d1 = -self.lam * (e * powers).sum(-1) + kappa
            d2 = -2 * self.lam * (e * powers**2).sum(-1)
            step = (d1 / d2).clamp(-1.0, 1.0)
            t = t - step
            if float(step.abs().max()) < 1e-12:
                break
        e = torch.exp(2 * t[..., None] * powers) * sq[:, None, :] * mask
        return t, (2 * self.lam * (e * powers**2).sum(-1)).rsqrt()

    def __call__(self, theta: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One move of every neuron of every scaling label, for stacked chains ``theta (C, D)``.

        Returns ``(theta', accept)``: the moved weights (``theta``'s dtype and device) and the mean
        Metropolis-Hastings acceptance rate of each chain ``(C,)``.
        """
        dtype, device = theta.dtype, theta.device
        th = theta.detach().to("cpu", torch.float64)
        acc = torch.zeros(th.shape[0], dtype=torch.float64)
        n_steps = 0
        for _, powers in self.labels:
            kappa = powers.sum(-1)
            sq = th**2
            mode, width = self._mode(sq, powers, kappa)
            sd = 1.2 * width
            t = torch.zeros_like(mode)  # the current state is t = 0

            def log_q(s, mode=mode, sd=sd):
                return -0.5 * ((s - mode) / sd) ** 2

            log_w = self._log_f(t, sq, powers, kappa) - log_q(t)
            for _ in range(self.n_mh):
                prop = mode + sd * torch.randn(mode.shape, generator=gen, dtype=torch.float64)
                log_w_prop = self._log_f(prop, sq, powers, kappa) - log_q(prop)
                take = torch.rand(mode.shape, generator=gen, dtype=torch.float64).log() < log_w_prop - log_w
                t = torch.where(take, prop, t)
                log_w = torch.where(take, log_w_prop, log_w)
                acc += take.double().mean(-1)
                n_steps += 1
            th = th * torch.exp(t @ powers)
        return th.to(device, dtype), acc / max(n_steps, 1)


class SoftmaxShift:
    r"""Exact moves along the softmax shift of a classifier's last layer, on flat stacked weights ``(C, D)``
    (book: chapter "Against the true posterior").

    Adding :math:`c + a^\top h` to every logit leaves the softmax unchanged, so the likelihood is constant
    along the directions that add :math:`a_j` to every row of column :math:`j` of the last weight matrix
    :math:`W` (``(classes, width)``) and :math:`c` to every entry of its bias: an :math:`r = \mathrm{width}
    + 1` dimensional subspace :math:`V` with orthonormal basis :math:`U` (``(D, r)``, entries
    :math:`1 / \sqrt{\mathrm{classes}}`). Under an isotropic Gaussian prior :math:`\mathcal N(0,
    \lambda^{-1} I)` the posterior (and every tempered one) factorises into the component
    :math:`U^\top \theta` in :math:`V`, distributed as :math:`\mathcal N(0, \lambda^{-1} I_r)`, and the
    rest, so redrawing the component from that law is an exact Gibbs step that costs nothing and leaves
    the likelihood unchanged.

    Args:
        shapes: ``name -> shape`` of the flat vector's tensors, in order.
        prior_precision: :math:`\lambda`.
        weight, bias: the last layer's tensors (default ``"fc.weight"``, ``"fc.bias"``).
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], prior_precision: float, weight: str = "fc.weight",
                 bias: str = "fc.bias"):
        if weight not in shapes or bias not in shapes:
            raise ValueError(f"no last layer {weight!r} / {bias!r} among {sorted(shapes)}")
        if not (prior_precision > 0 and math.isfinite(prior_precision)):
            raise ValueError(f"prior_precision must be positive and finite, got {prior_precision!r}")
        offsets, start = {}, 0
        for k, sh in shapes.items():
            offsets[k] = start
            start += math.prod(sh)
        k_out, width = shapes[weight]
        if tuple(shapes[bias]) != (k_out,):
            raise ValueError(f"{bias!r} has shape {shapes[bias]}, expected ({k_out},)")
        basis = torch.zeros(start, width + 1, dtype=torch.float64)
        rows = torch.arange(k_out)
        for j in range(width):
            basis[offsets[weight] + rows * width + j, j] = 1.0 / math.sqrt(k_out)
        basis[offsets[bias] + rows, width] = 1.0 / math.sqrt(k_out)
        self.basis, self.lam = basis, float(prior_precision)

    def project_out(self, theta: torch.Tensor) -> torch.Tensor:
        """``theta`` without its component in the shift subspace (any leading axes)."""
        u = self.basis.to(theta.dtype)
        return theta - (theta @ u) @ u.T

    def __call__(self, theta: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The component of every chain's ``theta (C, D)`` in the shift subspace redrawn from the prior;
        returns ``(theta', acceptance)`` (always 1: an exact Gibbs step)."""
        fresh = torch.randn(theta.shape[0], self.basis.shape[1], generator=gen, dtype=torch.float64)
        u = self.basis.to(theta.dtype)
        out = self.project_out(theta) + (fresh.to(theta.dtype) / math.sqrt(self.lam)) @ u.T
        return out, torch.ones(theta.shape[0], dtype=torch.float64)
