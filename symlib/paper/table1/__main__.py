"""``python -m symlib.paper.table1``: :func:`symlib.paper.table1.committed.main`."""

import sys

from symlib.paper.table1.committed import main

sys.exit(main())
