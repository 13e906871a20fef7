"""``python -m localspec`` is the ``localspec`` command."""

import sys

from .cli import main

sys.exit(main())
