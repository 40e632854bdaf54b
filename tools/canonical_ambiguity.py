"""Does ``AmbiguousCanonicalForm`` name every label whose canonical order rounding flips, and how often does
it name one that never flips? (page "Architectures", section "Canonical forms in float32").

Each torchvision model is built as ``tests/symmetry/test_torchvision.py`` builds it: random initialisation
(``weights=None``, ``torch.manual_seed(0)``), random BatchNorm statistics and affine parameters
(:func:`symlib.models.randomize_batchnorm`), its spec traced on 64 x 64 inputs (partial scalings where an
activation is not positively homogeneous). For each of ``--elements`` random group elements ``g``
(permutations and scalings, ``torch.Generator().manual_seed(s)``), ``theta`` and ``act(g, theta)`` are
canonicalised (scaling ``"normalize"``, ``--key``) in ``--dtype`` (the action computed in that dtype, as a
user's would be) and in float64:

* a flip of a label: its canonical order (which neuron of ``theta`` comes where) differs between ``theta``
  and ``act(g, theta)`` in ``--dtype``;
* the float64 canonical forms are the ground truth of orders that rounding does not decide: a label that
  also "flips" in float64 ties exactly (duplicates) and is left out of the counts (reported apart);
* a flip is warned when the canonicalisation of ``theta`` and that of ``act(g, theta)`` both name the
  label (:func:`symlib.symmetry.canonical.ambiguity` below 1, the labels the warning names);
* a false positive: a label named by a warning of any of these calls that never flipped over the elements
  run; the false-positive rate is their share of the labels warned.

Per model it prints one row: labels, elements run, flip events (label x element), labels that flipped,
flip events warned by both calls (by one), labels warned, false positives, their rate, the largest
gap-over-bound ratio at which a flip happened, and the float64 flips and warnings (both should be 0). With
``--json PATH`` every row and every flip is written there too. The last line is ``missed: <n>`` (flip
events that neither call warned).

    python tools/canonical_ambiguity.py --models resnet50 vgg11 --elements 10 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings

import torch
import torchvision

from symlib import models
from symlib.symmetry import canonical, ops
from symlib.symmetry.trace import spec_of

MODELS = ("resnet50", "vgg11", "resnext50_32x4d", "efficientnet_b0")


def build(name: str):
    """``(spec, theta)``: the model at random initialisation with random BatchNorm, traced on 64 x 64."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torchvision.models.get_model(name, weights=None).eval()
    models.randomize_batchnorm(model, torch.Generator().manual_seed(0))
    spec = spec_of(model, (3, 64, 64))
    if spec.no_scaling:  # e.g. SiLU: scalings only where the activation allows them
        spec = spec.with_partial_scalings()
    return spec, {k: v.detach().clone() for k, v in model.state_dict().items()}


def order(theta, spec, key):
    """The canonical permutations and :func:`canonical.ambiguity` ratios per label (one pass)."""
    perms, _, report = canonical._report(theta, spec, 2.0, key, "incoming", "normalize")
    return perms, {label: float(g.ratio.min()) for label, g in report.items()}


def flips(g, base, moved, spec):
    """Labels whose order of ``act(g, theta)``, taken back to ``theta``'s neurons, is not ``theta``'s."""
    return {label for label in spec.perms if not torch.equal(g.perms[label][moved[label]], base[label])}


def run(name: str, elements: int, dtype: torch.dtype, key: str, log) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    spec, theta = build(name)
    low = {k: v.to(dtype) if v.is_floating_point() else v for k, v in theta.items()}
    high = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in low.items()}
    base, base_ratio = order(low, spec, key)
    base64, base64_ratio = order(high, spec, key)
    warned_labels = {label for label, r in base_ratio.items() if r < 1}
    warned64 = {label for label, r in base64_ratio.items() if r < 1}
    events, exact, flipped64 = [], set(), set()
    times = []
    for s in range(elements):
        t = time.perf_counter()
        g = ops.random_element(spec, "both", generator=torch.Generator().manual_seed(s))
        moved, ratio = order(ops.act(g, low, spec), spec, key)
        moved64, ratio64 = order(ops.act(g, high, spec), spec, key)
        f64 = flips(g, base64, moved64, spec)
        flipped64 |= f64
        exact |= f64
        warned_labels |= {label for label, r in ratio.items() if r < 1}
        warned64 |= {label for label, r in ratio64.items() if r < 1}
        for label in sorted(flips(g, base, moved, spec) - f64):
            events.append({"element": s, "label": label, "n": spec.perms[label],
                           "ratio_theta": base_ratio[label], "ratio_moved": ratio[label],
                           "margin_ratio": min(base_ratio[label], ratio[label])})
        times.append(time.perf_counter() - t)
        log(f"{name} element {s}: {time.perf_counter() - t:.1f} s, flips "
            f"{[e['label'] for e in events if e['element'] == s]}")
    both = sum(e["ratio_theta"] < 1 and e["ratio_moved"] < 1 for e in events)
    one = sum((e["ratio_theta"] < 1) != (e["ratio_moved"] < 1) for e in events)
    flipped = {e["label"] for e in events}
    fp = sorted((warned_labels - exact) - flipped)
    considered = warned_labels - exact
    return {
        "model": name, "labels": len(spec.perms), "elements": elements, "dtype": str(dtype)[6:], "key": key,
        "flip_events": len(events), "flipped_labels": len(flipped), "warned_both": both, "warned_one": one,
        "missed": len(events) - both - one, "labels_warned": len(considered), "false_positives": len(fp),
        "fp_rate": len(fp) / len(considered) if considered else 0.0,
        "worst_flip_ratio": max((e["margin_ratio"] for e in events), default=None),
        "exact_ties": sorted(exact), "float64_flips": len(flipped64 - exact), "float64_warned": len(warned64),
        "seconds_per_element": sum(times) / max(len(times), 1), "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,
        "false_positive_labels": fp, "flips": events,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="torchvision model names")
    ap.add_argument("--elements", type=int, default=100, help="random group elements per model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    ap.add_argument("--key", default="max", choices=list(canonical.KEYS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the rows and every flip here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows = []
    for name in args.models:
        rows.append(run(name, args.elements, dtype, args.key, log))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                                      f"{torch.get_num_threads()} thread(s), torch {torch.__version__}",
                           "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    head = ("model", "labels", "elements", "flips", "flipped labels", "warned", "warned by one",
            "labels warned", "false positives", "rate", "worst flip ratio", "float64 flips / warned", "s/elt",
            "CPU s")
    print(" | ".join(head))
    for r in rows:
        worst = "-" if r["worst_flip_ratio"] is None else f"{r['worst_flip_ratio']:.2f}"
        print(" | ".join(map(str, (
            r["model"], r["labels"], r["elements"], r["flip_events"], r["flipped_labels"], r["warned_both"],
            r["warned_one"], r["labels_warned"], r["false_positives"], f"{r['fp_rate']:.0%}", worst,
            f"{r['float64_flips']} / {r['float64_warned']}", f"{r['seconds_per_element']:.1f}",
            f"{r['cpu_seconds']:.0f}"))))
    print(f"missed: {sum(r['missed'] for r in rows)}")


if __name__ == "__main__":
    main()
