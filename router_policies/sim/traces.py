"""Request traces in the Mooncake JSONL format (../shared/traces/README.md), read and written.

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

* ``timestamp``: arrival in milliseconds from the trace start (a non-negative number, lines in
  non-decreasing order);
* ``input_length`` / ``output_length``: prompt and generated tokens (positive / non-negative
  integers; an output of 0 is simulated as one token, the least an engine produces);
* ``hash_ids``: one integer per ``block_size``-token prompt block, in order, chained (the same id at
  position i means the same first i + 1 blocks). At least ``input_length // block_size`` ids (every
  full block); a trailing id for the partial last block is allowed and never cached.

Optional fields, absent from the Mooncake files and accepted everywhere: ``block_size`` (tokens per
block, default 512, equal on every line), ``session_id`` (a string). Unknown fields are ignored.

Every error names the file, the line and the field: ``trace.jsonl:17: input_length: expected a
positive integer`` (a ``UserInputError``: exit code 2 in the CLI, no traceback).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router_policies.errors import UserInputError

MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    block_size: int
    requests: tuple[TraceRequest, ...]

    def full_block_ids(self, r: TraceRequest) -> Sequence[int]:
        """The ids of the request's full blocks (what a prefix cache can hold)."""
        return r.hash_ids[: r.input_length // self.block_size]


class TraceError(UserInputError):
    pass


def _int(v: Any) -> int | None:
    """``v`` when it is a JSON integer (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_line(obj: Any, where: str, block_size: int) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    ts = obj.get("timestamp")
    if not (isinstance(ts, int | float) and not isinstance(ts, bool)) or ts < 0 or ts != ts:
        raise TraceError(f"{where}: timestamp: expected a non-negative number of milliseconds")
    inp = _int(obj.get("input_length"))
    if inp is None or inp <= 0:
        raise TraceError(f"{where}: input_length: expected a positive integer")
    out = _int(obj.get("output_length"))
    if out is None or out < 0:
        raise TraceError(f"{where}: output_length: expected a non-negative integer")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(_int(x) is not None for x in ids):
        raise TraceError(f"{where}: hash_ids: expected a list of integers")
    full = inp // block_size
    if len(ids) < full:
        raise TraceError(
            f"{where}: hash_ids: {len(ids)} ids for {inp} tokens; block size {block_size} needs at "
            f"least {full} (one per full block)"
        )
    if len(ids) > -(-inp // block_size):
        raise TraceError(
            f"{where}: hash_ids: {len(ids)} ids for {inp} tokens; block size {block_size} allows at "
            f"most {-(-inp // block_size)}"
        )
    sid = obj.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise TraceError(f"{where}: session_id: expected a string")
    return TraceRequest(float(ts), inp, out, tuple(ids), sid)


def load_trace(path: str | Path) -> Trace:
    p = Path(path)
    name = str(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{name}: cannot read trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{name}: not a UTF-8 text file") from None
    block_size: int | None = None
    requests: list[TraceRequest] = []
    last_ts = 0.0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if isinstance(obj, dict) and "block_size" in obj:
            bs = _int(obj["block_size"])
            if bs is None or bs <= 0:
                raise TraceError(f"{where}: block_size: expected a positive integer")
            if block_size is None and not requests:
                block_size = bs
            elif bs != (block_size or MOONCAKE_BLOCK_SIZE):
                raise TraceError(
                    f"{where}: block_size: {bs} differs from the {block_size or MOONCAKE_BLOCK_SIZE} "
                    "of the lines before"
                )
        bs_now = block_size or MOONCAKE_BLOCK_SIZE
        req = parse_line(obj, where, bs_now)
        if req.timestamp_ms < last_ts:
            raise TraceError(
                f"{where}: timestamp: {req.timestamp_ms:g} is earlier than the line before ({last_ts:g}); "
                "lines must be in arrival order"
            )
        last_ts = req.timestamp_ms
        requests.append(req)
    if not requests:
        raise TraceError(f"{name}: the trace holds no requests")
    return Trace(name=p.name, block_size=block_size or MOONCAKE_BLOCK_SIZE, requests=tuple(requests))


def write_trace(path: str | Path, requests: Iterable[TraceRequest], block_size: int) -> int:
    """Write requests as JSONL (with ``block_size`` and, when set, ``session_id`` on every line)."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            ts: float | int = int(r.timestamp_ms) if float(r.timestamp_ms).is_integer() else r.timestamp_ms
            obj: dict[str, Any] = {
                "timestamp": ts,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
                "block_size": block_size,
            }
            if r.session_id is not None:
                obj["session_id"] = r.session_id
            f.write(json.dumps(obj, separators=(", ", ": ")) + "\n")
            n += 1
    return n
