"""``python -m ampkit``: the same as the ``ampkit`` command (and ``python -m ampkit.cli``)."""

import sys

from .cli import main

sys.exit(main())
