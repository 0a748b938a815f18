"""``python -m pipelines.cli``: the same program as ``bcg-generate``."""

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
