"""The gateway's own traffic as a Mooncake-format trace (router_policies/sim/traces.py reads it
unchanged; docs/operators.md, "Recording traffic").

One JSON line per answered request, in arrival order::

    {"timestamp": 1234.5, "input_length": 812, "output_length": 64, "hash_ids": [...],
     "block_size": 16, "session_id": "9f3c...", "tenant": "acme", "model": "m"}

No text is written. ``hash_ids`` are the prompt's full-block keys (chained, like Mooncake's ids)
passed through a keyed 63-bit hash, so ids from different requests match exactly when their
prefixes do, and no id can be checked against a guessed prompt without the key; session ids are
hashed with the same key. Tenant and model are labels the operator chose.

Order: requests finish out of arrival order, so a line is held until it arrived more than
``reorder_window_s`` ago (or the held lines exceed ``max_pending_bytes``); a line that
arrives after a later one was written carries the latest written timestamp (counted as ``late``),
so the file's timestamps never decrease.

Bounds: the current file is rotated at ``max_bytes`` (``path`` -> ``path.1`` -> ... ->
``path.<keep_files>``, the oldest deleted), so the recording holds at most
``(keep_files + 1) * (max_bytes + one line)`` bytes on disk and ``max_pending_bytes`` in memory.
Single writer: called on the event loop only (``OperatorView``).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from gateway.operator_config import TraceConfig
from gateway.request_outcome import Outcome

_ID_MASK = (1 << 63) - 1


@dataclass(slots=True)
class TraceStats:
    lines: int = 0
    bytes: int = 0  # in the current file
    rotations: int = 0
    late: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


class BlockIdHasher:
    """Block keys and session ids under a keyed hash (BLAKE2b, 8 bytes)."""

    __slots__ = ("_key",)

    def __init__(self, salt: str | None) -> None:
        self._key = salt.encode()[:64] if salt else os.urandom(16)

    def block_id(self, key: int) -> int:
        h = hashlib.blake2b((key & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"), key=self._key, digest_size=8)
        return int.from_bytes(h.digest(), "little") & _ID_MASK

    def session(self, sid: str) -> str:
        return hashlib.blake2b(sid.encode(), key=self._key, digest_size=8).hexdigest()


class TraceRecorder:
    def __init__(self, cfg: TraceConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._cfg = cfg
        self._clock = clock
        self._hasher = BlockIdHasher(cfg.salt)
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self._t0 = 0.0
        self._last_ms = 0.0
        self._seq = itertools.count()
        self._pending: list[tuple[float, int, bytes]] = []  # (arrival, seq, line after the timestamp)
        self._pending_bytes = 0
        self.stats = TraceStats()

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def start(self, path: str | None = None) -> None:
        """Record to ``path`` (the configured one by default). An existing file is rotated out first:
        a new recording starts at timestamp 0."""
        where = path or self._cfg.path
        if where is None:
            raise ValueError("no trace path configured (operator.trace.path)")
        self.stop()
        self._path = Path(where)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        if self._path.exists() and self._path.stat().st_size > 0:
            self._shift_files()
        self._file = self._path.open("wb")
        self._t0 = self._clock()
        self._last_ms = 0.0
        self.stats = TraceStats()

    def stop(self) -> None:
        """Write every held line and close the file."""
        if self._file is None:
            return
        self.flush(force=True)
        self._file.close()
        self._file = None

    def add(self, o: Outcome) -> None:
        if self._file is None:
            return
        bs = o.block_size
        if not o.block_keys:
            self._skip("approximate")
            return
        if len(o.block_keys) != o.gateway_prompt_tokens // bs or o.gateway_prompt_tokens <= 0:
            self._skip("inconsistent")
            return
        doc: dict[str, Any] = {
            "input_length": o.gateway_prompt_tokens,
            "output_length": o.completion_tokens,
            "hash_ids": [self._hasher.block_id(k) for k in o.block_keys],
            "block_size": bs,
        }
        if o.session_id is not None:
            doc["session_id"] = self._hasher.session(o.session_id)
        doc["tenant"] = o.tenant
        doc["model"] = o.model
        rest = orjson.dumps(doc)[1:]  # '"input_length":...}' : the timestamp goes in front
        heapq.heappush(self._pending, (o.arrival, next(self._seq), rest))
        self._pending_bytes += len(rest) + 32
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Write the held lines old enough to be in order (all of them when ``force``)."""
        if self._file is None:
            return
        horizon = self._clock() - self._cfg.reorder_window_s
        pending = self._pending
        while pending and (
            force or pending[0][0] <= horizon or self._pending_bytes > self._cfg.max_pending_bytes
        ):
            arrival, _, rest = heapq.heappop(pending)
            self._pending_bytes -= len(rest) + 32
            self._write(arrival, rest)
        self._file.flush()

    def _write(self, arrival: float, rest: bytes) -> None:
        assert self._file is not None
        ms = round((arrival - self._t0) * 1000, 3)
        if ms < self._last_ms:
            self.stats.late += 1
            ms = self._last_ms
        self._last_ms = ms
        line = b'{"timestamp":' + orjson.dumps(max(ms, 0.0)) + b"," + rest + b"\n"
        self._file.write(line)
        self.stats.lines += 1
        self.stats.bytes += len(line)
        if self.stats.bytes >= self._cfg.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        assert self._file is not None and self._path is not None
        self._file.close()
        self._shift_files()
        self._file = self._path.open("wb")
        self.stats.bytes = 0
        self.stats.rotations += 1

    def _shift_files(self) -> None:
        """``path`` -> ``path.1`` -> ... ; the file past ``keep_files`` is deleted."""
        assert self._path is not None
        keep = self._cfg.keep_files
        name = str(self._path)
        oldest = Path(f"{name}.{keep}") if keep else self._path
        oldest.unlink(missing_ok=True)
        for i in range(keep - 1, 0, -1):
            src = Path(f"{name}.{i}")
            if src.exists():
                src.rename(f"{name}.{i + 1}")
        if keep and self._path.exists():
            self._path.rename(f"{name}.1")

    def _skip(self, reason: str) -> None:
        self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {
            "enabled": self.enabled,
            "path": str(self._path) if self._path is not None else self._cfg.path,
            "lines": s.lines,
            "bytes_current_file": s.bytes,
            "rotations": s.rotations,
            "late": s.late,
            "held": len(self._pending),
            "skipped": dict(s.skipped),
            "max_bytes": self._cfg.max_bytes,
            "keep_files": self._cfg.keep_files,
        }
