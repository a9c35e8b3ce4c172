"""``python -m pgbroker.cli``: the same as ``pgbroker`` and ``python -m pgbroker``."""

import sys

from . import main

sys.exit(main())
