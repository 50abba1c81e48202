"""Options objects from parsed command-line flags: a flag ``--block-size`` fills the field
``block_size`` (argparse's own naming), so a CLI does not restate each field (docs/architecture.md,
"Layout"). Pure: argparse and dataclasses only.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def options_from_flags(
    cls: type[T], args: argparse.Namespace, names: Iterable[str] | None = None, **given: Any
) -> T:
    """The dataclass ``cls`` with ``given`` and, from ``args``, the flags of the same names: the
    fields ``names`` lists, or (``names`` None) every other field of ``cls``, each of which must
    then be a flag (a missing one raises ``AttributeError``: nothing is filled silently)."""
    if names is None:
        names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in given]  # type: ignore[arg-type]
    return cls(**{name: getattr(args, name) for name in names}, **given)
