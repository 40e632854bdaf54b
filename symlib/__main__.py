"""``python -m symlib ...``: the command-line interface (:mod:`symlib.cli`)."""

from symlib.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
