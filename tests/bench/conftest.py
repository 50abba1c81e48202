"""The benchmarks live in ``bench/`` at the repository root, which is not an installed package
(it should not land in users' site-packages): put the root on ``sys.path`` for these tests."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
