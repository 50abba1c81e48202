"""A YAML or JSON document read from a file, a failure told in the reader's own terms
(docs/architecture.md, section 10): the gateway's config file, a model's tokenizer files and
chat templates, the API-key and agent-token files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

_PARSERS: dict[str, tuple[Callable[[str], Any], type[Exception]]] = {
    "YAML": (yaml.safe_load, yaml.YAMLError),
    "JSON": (json.loads, json.JSONDecodeError),
}


def read_text(path: Path, fail: Callable[[str], Exception]) -> str:
    """The text of the file at ``path``; raises ``fail("cannot read: <why>")`` when it cannot be
    read and ``fail("not UTF-8 text: <where>")`` when its bytes are not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise fail(f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise fail(f"not UTF-8 text: byte {exc.start} ({exc.reason})") from None


def read_document(path: Path, kind: Literal["YAML", "JSON"], fail: Callable[[str], Exception]) -> Any:
    """The document at ``path``; raises as ``read_text`` does when the file cannot be read as text
    and ``fail("invalid <kind>: <where>")`` when it does not parse (nothing else is caught)."""
    parse, invalid = _PARSERS[kind]
    text = read_text(path, fail)
    try:
        return parse(text)
    except invalid as exc:
        raise fail(f"invalid {kind}: {exc}") from None
