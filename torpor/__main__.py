"""``python -m torpor``: the same command as ``torpor``."""

import sys

from torpor.cli import main

sys.exit(main())
