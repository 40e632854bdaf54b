"""How many of symlib's modules two user-facing calls cross: ``symlib compare`` on two folders of
checkpoint files (``torch.save`` state dicts of a small CNN, with ``--model`` and ``--input-shape``) and
``symlib.spec_of`` on a transformer (a pre-norm block with ``nn.MultiheadAttention``).

A module is crossed when one of its functions runs during the call (``sys.setprofile``); imports done
before the call do not count. The command is counted whole (argparse assembles every group's parser) and
from its parsed arguments on (the compare command's own path). The fewer modules a call crosses, the
fewer files a reader opens to follow it. Run: ``python tools/call_paths.py`` (seconds; prints the
counts and the modules).
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import ckpt_nets  # noqa: E402
import transformer_nets  # noqa: E402

import symlib  # noqa: E402
from symlib import cli  # noqa: E402


def crossed(call) -> list[str]:
    """The symlib modules whose functions run during ``call()``, sorted."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            mod = frame.f_globals.get("__name__", "")
            if mod == "symlib" or mod.startswith("symlib."):
                seen.add(mod)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def compare_files() -> tuple[list[str], list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, seeds in (("a", range(3)), ("b", range(3, 6))):
            (root / name).mkdir()
            for s in seeds:
                torch.save(ckpt_nets.trained(s), root / name / f"seed{s}.pt")
        argv = ["compare", str(root / "a"), str(root / "b"), "--model", f"{ckpt_nets.__file__}:SmallNet",
                "--input-shape", "1,8,8", "--symmetries", "raw,ns", "--permutations", "10",
                "--bootstrap", "0", "--seed", "0", "--json", str(root / "out.json")]
        cli.main(argv)  # warm: imports and lazy attributes resolve outside the measured call
        args = cli.parser().parse_args(argv)
        command = importlib.import_module("symlib.cli.compare")
        return crossed(lambda: cli.main(argv)), crossed(lambda: command.run(args))


def spec_transformer() -> list[str]:
    model, shape, _ = transformer_nets.build("mha", 0)
    symlib.spec_of(model, shape)
    return crossed(lambda: symlib.spec_of(model, shape))


def main() -> None:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        a, run = compare_files()
    b = spec_transformer()
    for title, mods in (("symlib compare on checkpoint files", a),
                        ("  the same without assembling the command's parser", run),
                        ("spec_of on a transformer", b)):
        print(f"{title}: {len(mods)} modules")
        for m in mods:
            print(f"  {m}")


if __name__ == "__main__":
    main()
