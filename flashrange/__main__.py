"""``python -m flashrange``: the same command line as the ``flashrange`` script (:mod:`flashrange.cli`)."""

import sys

from .cli import main

sys.exit(main())
