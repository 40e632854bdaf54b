"""``python -m symlib.paper.truth``: :func:`symlib.paper.truth.main`."""

import sys

from symlib.paper.truth import main

sys.exit(main())
