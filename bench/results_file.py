"""Where a benchmark leaves its result: one JSON document in a file (bench/results/*.json by
default), read by bench/report.py (docs/architecture.md, "Measuring ourselves")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(path: Path, doc: Any) -> None:
    """Write ``doc`` to ``path`` as indented JSON ending in a newline, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
