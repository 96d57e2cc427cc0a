"""``python -m ampkit.cli``: the same as the ``ampkit`` command."""

import sys

from . import main

sys.exit(main())
