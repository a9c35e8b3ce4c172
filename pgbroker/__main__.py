"""``python -m pgbroker``: the ``pgbroker`` command line (see :mod:`pgbroker.cli`)."""

import sys

from .cli import main

sys.exit(main())
