"""``python -m symlib.paper.frontier``: :func:`symlib.paper.frontier.main`."""

import sys

from symlib.paper.frontier import main

sys.exit(main())
