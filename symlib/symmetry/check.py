"""Functional-equivalence checks and input validation (paper App. A.2: every removal is checked).

A symmetry changes the weights but not the function. :func:`assert_same_function`
evaluates two parameter sets on the same random inputs and raises
:class:`FunctionalMismatch` when their outputs differ; every symmetry removal in
:mod:`symlib.symmetry.canonical` calls it.
"""

from __future__ import annotations

import math
import warnings

import torch

from symlib.symmetry.spec import Params, Spec, SymmetryError


class FunctionalMismatch(AssertionError):
    """Two parameter sets that should compute the same function do not."""


def default_tol(dtype: torch.dtype) -> float:
    """Relative tolerance of the functional check: 1e-4 in float32 (the paper's), 1e-9 in float64."""
    return 1e-9 if dtype == torch.float64 else 1e-4


def validate(theta: Params, spec: Spec) -> tuple[int, ...]:
    """Check shapes against the spec and that every weight is finite; return the batch shape."""
    batch = spec.batch_shape(theta)
    for name in spec.shapes:
        t = theta[name]
        # amax/amin propagate NaN and reach +-inf: two reductions, no boolean copy of the tensor
        finite = not t.is_floating_point() or not t.numel() or bool(
            torch.isfinite(t.amax()) & torch.isfinite(t.amin()))
        if not finite:
            bad = (~torch.isfinite(t)).sum().item()
            raise SymmetryError(
                f"parameter {name!r} has {bad} NaN or infinite entries: the checkpoint is corrupt "
                "or training diverged; drop it before removing symmetries"
            )
    return batch


def outputs(spec: Spec, theta: Params, x: torch.Tensor) -> torch.Tensor:
    """Evaluate every network of a (possibly batched) ``theta`` on inputs ``x``.

    Args:
        spec: with ``forward`` set (e.g. from :func:`symlib.symmetry.spec.mlp_spec`).
        theta: parameters with batch shape ``B``.
        x: inputs ``(n, *input_shape)``, shared by all networks.

    Returns:
        Outputs ``(*B, n, *out_shape)``.
    """
    if spec.forward is None:
        raise SymmetryError("this spec has no forward function; build it from a model")
    batch = spec.batch_shape(theta)
    if not batch:
        return spec.forward(theta, x)
    flat = {k: theta[k].reshape(-1, *spec.shapes[k]) for k in spec.shapes}
    with warnings.catch_warnings():  # nn.MultiheadAttention's fused kernel runs unbatched under vmap
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
        out = torch.func.vmap(spec.forward, in_dims=(0, None))(flat, x)
    return out.reshape(*batch, *out.shape[1:])


def random_inputs(spec: Spec, n: int = 32, dtype=torch.float64, device=None, seed: int = 0
                  ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.vocab is not None:  # token ids
        return torch.randint(0, spec.vocab, (n, *spec.input_shape), generator=g).to(device)
    return torch.randn(n, *spec.input_shape, generator=g, dtype=dtype).to(device)


def function_error(
    spec: Spec, theta_a: Params, theta_b: Params, x: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-network relative output error ``max|f_a - f_b| / max(1, max|f_a|)`` on inputs ``x``."""
    dtype = next(iter(theta_a.values())).dtype
    device = next(iter(theta_a.values())).device
    if x is None:
        x = random_inputs(spec, dtype=dtype, device=device)
    fa = outputs(spec, theta_a, x)
    fb = outputs(spec, theta_b, x)
    nb = len(spec.batch_shape(theta_a))
    dims = tuple(range(nb, fa.ndim))
    diff = (fa - fb).abs().amax(dim=dims)
    size = fa.abs().amax(dim=dims).clamp_min(1.0)
    return diff / size


def assert_same_function(
    spec: Spec, theta_a: Params, theta_b: Params, tol: float | None = None, what: str = "transformation"
) -> float:
    """Raise :class:`FunctionalMismatch` unless both parameter sets compute the same function.

    Returns:
        The largest relative output error over all networks of the batch.
    """
    err = function_error(spec, theta_a, theta_b)
    dtype = next(iter(theta_a.values())).dtype
    tol = default_tol(dtype) if tol is None else tol
    worst = float(err.max()) if err.numel() else 0.0
    if not math.isfinite(worst) or worst > tol:
        n_bad = int((~(err <= tol)).sum())
        raise FunctionalMismatch(
            f"{what} changed the network's function: relative output error {worst:.3g} > {tol:.1g} "
            f"in {n_bad} of {err.numel()} network(s). The spec does not match the model, or the "
            "network is degenerate (dead or exploding neurons)."
        )
    return worst
