"""Min-mass: our solver against the cvxpy formulation (book: chapter "Min-mass").

Prints, side by side in one run:

* one OptuNet: our solver, cvxpy's geometric program (``gp=True``, the paper's formulation) and the
  log-sum-exp form;
* an MLP 784-512-512-512-10: our solver and cvxpy's log-sum-exp form (the geometric-program mode
  builds one monomial per weight, 930k of them, and does not finish compiling in minutes);
* our solver alone on ResNet-18 (BatchNorm folded, 11M parameters) and on 1,000 OptuNets at once;
* torchvision's ResNet-18 and ResNet-50 (random initialisation with random BatchNorm statistics,
  BatchNorm folded; 11.7M and 25.5M weights): ours against our former method on the large network
  (plain Gauss-Seidel sweeps, ``coarse=False, anderson=0``), iterations, seconds and the ratio.

Networks are randomly initialised and moved to a random point of their scaling orbit (log-uniform
scales in [1/4, 4]) so the solvers have work to do. Times are wall-clock seconds on the threads
torch is given (``--threads``, 2 by default); the function check is timed apart. The last line is
``speedup: <x>x``, our solver over cvxpy on the MLP, at equal optimum (the masses agree to 1e-6 relative
or the script fails).
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import torch

from symlib import models
from symlib.symmetry import check, minmass, ops, trace
from symlib.symmetry.spec import mlp_spec


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _orbit_point(theta, spec, seed):
    g = ops.random_element(spec, "scale", batch=spec.batch_shape(theta), log_range=math.log(4.0),
                           generator=torch.Generator().manual_seed(seed))
    return ops.scale(theta, spec, g.scales)


def _timed(fn, repeat=1):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _row(what, seconds, mass, ref=None, extra=""):
    rel = "" if ref is None else f"  |mass/ours - 1| = {abs(mass / ref - 1):.1e}"
    print(f"  {what:<28s} {seconds:9.3f} s   mass {mass:.10g}{rel}{extra}", flush=True)


def _torchvision_row(name, baseline):
    """torchvision's ``name``, folded, at a random point of its scaling orbit: ours (and the former
    method, plain sweeps) with iterations and seconds."""
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.get_model(name, weights=None).double().eval()
    models.randomize_batchnorm(net, torch.Generator().manual_seed(0))
    folded = minmass.fold_batchnorm(_params(net), net, input_shape=(3, 64, 64), check=False)
    spec = trace.spec_of(folded.model, (3, 64, 64))
    theta = _orbit_point(folded.theta, spec, 2)
    n = sum(v.numel() for k, v in theta.items() if k in spec.weights)
    scales = sum(spec.scales.values())
    print(f"== torchvision {name} (BatchNorm folded, {n / 1e6:.1f}M weights, {scales} scales)")
    t, r = _timed(lambda: minmass.minmass(theta, spec, check=False), repeat=2)
    _row("ours", t, float(r.mass_after), extra=f"  ({r.iterations} iterations)")
    if baseline:
        t0, r0 = _timed(lambda: minmass.minmass(theta, spec, check=False, coarse=False, anderson=0))
        _row("plain sweeps (former)", t0, float(r0.mass_after), float(r.mass_after),
             extra=f"  ({r0.iterations} iterations; ours {t0 / t:.1f}x faster)")
    err = float(check.function_error(spec, theta, r.theta).max())
    print(f"  function check                           relative output error {err:.1e}")


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--many", type=int, default=1000, help="number of OptuNets solved at once")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the former method on ResNet-50 (plain sweeps, about 45 s on 2 cores)")
    ap.add_argument("--only", choices=["all", "torchvision"], default="all",
                    help="torchvision: only the torchvision ResNet-18 / ResNet-50 rows (no cvxpy)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Solution may be inaccurate")
    torch.manual_seed(0)
    if args.only == "torchvision":
        for name in ("resnet18", "resnet50"):
            _torchvision_row(name, baseline=name == "resnet50" and not args.no_baseline)
        return float("nan")

    print("== OptuNet (392 parameters, one network)")
    net = models.OptuNet().double()
    spec = trace.spec_of(net, (1, 28, 28))
    theta = _orbit_point(_params(net), spec, 0)
    t, r = _timed(lambda: minmass.minmass(theta, spec, check=False, tol=1e-12), repeat=5)
    ours = float(r.mass_after)
    _row("ours", t, ours, extra=f"  ({r.iterations} iterations)")
    for mode in ("gp", "lse"):
        t, (_, v) = _timed(lambda mode=mode: minmass.reference(theta, spec, mode=mode))
        _row(f"cvxpy {mode}", t, v, ours)

    print("== MLP 784-512-512-512-10 (one network)")
    mlp = models.MLP([784, 512, 512, 512, 10]).double()
    spec = mlp_spec(mlp)
    theta = _orbit_point(_params(mlp), spec, 1)
    t_ours, r = _timed(lambda: minmass.minmass(theta, spec, check=False, tol=1e-12), repeat=3)
    ours = float(r.mass_after)
    _row("ours", t_ours, ours, extra=f"  ({r.iterations} iterations)")
    t_cvx, (_, v) = _timed(lambda: minmass.reference(theta, spec, mode="lse", accurate=False))
    _row("cvxpy lse (clarabel)", t_cvx, v, ours)
    print("  cvxpy gp: not run (one monomial per weight; compiling alone takes many minutes)")
    if abs(v / ours - 1) > 1e-6:
        raise SystemExit(f"the optima differ: {v} vs {ours}")

    print("== ResNet-18 (CIFAR-100, BatchNorm folded, one network)")
    net = models.ResNet18().double().eval()
    theta = _params(net)
    t_fold, folded = _timed(lambda: minmass.fold_batchnorm(theta, net, input_shape=(3, 32, 32), check=False))
    spec = trace.spec_of(folded.model, (3, 32, 32))
    theta = _orbit_point(folded.theta, spec, 2)
    n = sum(v.numel() for k, v in theta.items() if k in spec.weights)
    t, r = _timed(lambda: minmass.minmass(theta, spec, check=False), repeat=2)
    _row(f"ours ({n / 1e6:.1f}M weights)", t, float(r.mass_after),
         extra=f"  ({r.iterations} iterations, {sum(spec.scales.values())} scales; fold {t_fold:.2f} s)")
    t_chk, err = _timed(lambda: check.function_error(spec, theta, r.theta))
    print(f"  function check               {t_chk:9.3f} s   relative output error {float(err.max()):.1e}")

    for name in ("resnet18", "resnet50"):
        _torchvision_row(name, baseline=name == "resnet50" and not args.no_baseline)

    print(f"== {args.many} OptuNets at once")
    net = models.OptuNet()
    spec = trace.spec_of(net, (1, 28, 28))
    nets = [_params(models.OptuNet()) for _ in range(args.many)]
    theta = _orbit_point({k: torch.stack([p[k] for p in nets]) for k in nets[0]}, spec, 3)
    t, r = _timed(lambda: minmass.minmass(theta, spec, check=False), repeat=2)
    print(f"  ours                         {t:9.3f} s   {int(r.converged.sum())}/{args.many} converged, "
          f"mean saving {float(r.relative_saving.mean()):.1%} ({r.iterations} iterations)")

    speedup = t_cvx / t_ours
    print(f"speedup: {speedup:.0f}x")
    return speedup


if __name__ == "__main__":
    main()
