"""The scripts' tests import them as their files run: with ``scripts/`` on ``sys.path``, where
``benchkit`` and the ``bench_*`` modules are found (a script run as a file has its folder there)."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = str(Path(__file__).resolve().parents[2] / "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
