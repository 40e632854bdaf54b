"""The options that say how to read checkpoint files and rebuild their network, shared by ``symlib import``,
``symlib canonicalize``, ``symlib count`` and ``symlib compare`` (:mod:`symlib.ckpt`)."""

from __future__ import annotations

import argparse
import json

EXAMPLE = """'{"width": 8}'"""


def json_object(text: str) -> dict:
    """``--model-args``: a JSON object of keyword arguments."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--model-args takes a JSON object such as {EXAMPLE} ({e})") \
            from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--model-args takes a JSON object such as {EXAMPLE}, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser, files: bool = True) -> None:
    """Add ``--model``, ``--model-args``, ``--input-shape``, ``--vocab``, ``--scalings`` and, with ``files``,
    ``--prefix``, ``--key``, ``--trust-pickle`` and ``--allow-duplicates`` to ``p``."""
    g = p.add_argument_group(
        "architecture",
        "The network the checkpoints belong to, when the folders do not say (a symlib folder records it; a "
        "Hugging Face or timm config.json beside the weights names it).",
    )
    g.add_argument("--model", default=None, metavar="MODULE:CALLABLE",
                   help="an importable callable that returns the nn.Module: package.module:Factory or "
                        "path/to/file.py:Factory (timm: timm:create_model with --model-args "
                        "'{\"model_name\": ...}'), or the name of a network of symlib's registry (optunet, "
                        "resnet18, resnet20, or one added with symlib.models.register)")
    g.add_argument("--model-args", type=json_object, default=None, metavar="JSON",
                   help="keyword arguments of --model, as a JSON object")
    g.add_argument("--input-shape", default=None, metavar="C,H,W",
                   help="shape of one input without the batch axis, e.g. 1,28,28, or TOKENS for a text "
                        "model (to trace the symmetries)")
    g.add_argument("--vocab", type=int, default=None, metavar="N",
                   help="the vocabulary size of a network that reads token ids (read from a Hugging Face "
                        "config.json's vocab_size when not given)")
    g.add_argument("--scalings", choices=("all", "partial", "none"), default="all",
                   help="the scaling symmetries to trace: all that the layers allow (default), partial "
                        "(only the layers where they hold, when some activation is not positively "
                        "homogeneous, e.g. GELU or LayerNorm networks), none (permutations only)")
    if not files:
        return
    f = p.add_argument_group("checkpoint files")
    f.add_argument("--prefix", default=None,
                   help="prefix to remove from the tensor names (e.g. 'model.' of a Lightning module; found "
                        "when not given)")
    f.add_argument("--key", default=None,
                   help="where the state dict is inside the files (e.g. 'state_dict', 'model'; found when "
                        "not given)")
    f.add_argument("--trust-pickle", action="store_true",
                   help="read files that need code to be unpickled with torch.load(weights_only=False): it "
                        "runs the code the file names, so only for files you trust")
    f.add_argument("--allow-duplicates", action="store_true",
                   help="keep networks that repeat, refused by default: a file named twice (links resolved), "
                        "files holding the same weights (a Lightning last.ckpt, a .safetensors copy of a "
                        ".pt) and, for compare, networks in both sets (the result then warns that the sets "
                        "overlap)")


def trace_options(args) -> dict:
    """The keyword arguments ``scalings`` and ``vocab`` of :func:`symlib.ckpt.recipe.spec` that the options
    ask for."""
    return {"scalings": args.scalings, "vocab": args.vocab}


def options(args) -> dict:
    """The keyword arguments of :func:`symlib.ckpt.loader.read` that the options ask for."""
    out = {"model": args.model, "model_args": args.model_args, "input_shape": args.input_shape}
    if hasattr(args, "prefix"):
        out.update(prefix=args.prefix, key=args.key, trust_pickle=args.trust_pickle,
                   allow_duplicates=args.allow_duplicates)
    return out
