"""``python -m pipelines.serve``: the same as ``bcg-serve``."""

import sys

from . import main

sys.exit(main())
