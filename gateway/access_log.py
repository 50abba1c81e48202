"""Structured access log: one JSON object per proxied request on the ``kvgate.access`` logger.

Prompts (the request's ``prompt`` or ``messages``) are never written unless
``telemetry.log_prompts`` is set: they can hold anything a user typed.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

_LOGGER = "kvgate.access"


class AccessLog:
    def __init__(self) -> None:
        self._log = logging.getLogger(_LOGGER)

    def emit(self, entry: dict[str, Any], body: Any = None, log_prompts: bool = False) -> None:
        if not self._log.isEnabledFor(logging.INFO):
            return
        entry["ts"] = round(time.time(), 6)
        if log_prompts and isinstance(body, dict):
            for k in ("prompt", "messages"):
                if k in body:
                    entry[k] = body[k]
        self._log.info(orjson.dumps(entry, default=str).decode())


def configure_logging(level: str, access_log: bool) -> None:
    """Plain messages on stderr; the access logger writes bare JSON lines."""
    root = logging.getLogger()
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(h)
    root.setLevel(level)
    acc = logging.getLogger(_LOGGER)
    acc.propagate = False
    if not acc.handlers:
        ah = logging.StreamHandler(sys.stderr)
        ah.setFormatter(logging.Formatter("%(message)s"))
        acc.addHandler(ah)
    acc.setLevel(logging.INFO if access_log else logging.WARNING)
