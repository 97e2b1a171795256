"""``python -m afore.bench.migration``: ``afore bench migration`` without the other commands' imports."""

import sys

from afore.bench.migration.cli import main

sys.exit(main())
