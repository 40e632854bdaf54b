"""``symlib import SRC... --to OUT``: checkpoint files as a symlib folder (:mod:`symlib.ckpt.convert`)."""

from __future__ import annotations

from symlib.cli import sources


def add_parser(sub) -> None:
    """Add the ``import`` group to the subparsers ``sub`` of :func:`symlib.cli.parser`."""
    p = sub.add_parser(
        "import",
        help="convert checkpoint files (.pt, .ckpt, .safetensors, Hugging Face folders) into a symlib folder",
        description="Read checkpoints of one architecture (torch.save files, Lightning .ckpt, safetensors, "
        "Hugging Face model folders or hf://owner/name, timm; files, folders or globs) and write them as "
        "a symlib folder: safetensors chunks and a manifest with every source file's sha256 and the "
        "architecture, which symlib load, zoo info --check, zoo export, compare and canonicalize then use. "
        "Every file is checked first (the same tensors and shapes, finite weights); nothing is written if "
        "one fails.",
    )
    p.add_argument("src", nargs="+", help="checkpoint files, folders of them, or globs (quoted: 'runs/*.pt')")
    p.add_argument("--to", required=True, help="the folder to create (must not exist, or be empty)")
    sources.add_arguments(p)


def run(args) -> None:
    """Carry out a parsed ``symlib import ...`` command (:func:`symlib.cli.main` reports its errors)."""
    from symlib.ckpt import convert

    opts = sources.options(args)
    man = convert.import_checkpoints(args.src, args.to, opts.pop("model"), opts.pop("prefix"), **opts,
                                     **sources.trace_options(args))
    src = man["source"]
    print(f"{args.to}: {man['n_samples']} networks of {man['arch']} from {len(src['checkpoints'])} "
          f"checkpoints ({len(src['files'])} files, sha256 recorded)"
          + (f", prefix {src['prefix']!r} removed" if src["prefix"] else ""))
