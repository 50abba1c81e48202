"""The stages of each request's first token in a live replay (bench/live.py), for any router
alike: the hop in (client send -> engine handler), the engine's parse queue (its tokenizer
thread), the engine itself (parsed -> first token written) and the hop out (first token written
-> the client's first data); and how many of the requests the engines served with prompt tokens
from their prefix caches (``hit_requests``): on a trace of little reuse the engine-counted hit
rate is made by a few requests, and this says how many.

The client notes when it sent each prompt and when it read its first data (``time.monotonic``);
each ``kvgate sim-engine`` of the fleet logs when each request reached its handler, when its
parse ended and when it wrote the first token (``--request-log``,
replica_agent/sim_engine/request_log.py), on the same host clock. A send is matched to an
arrival by the prompt's key (``prompt_key``); a prompt sent more than once matches its arrivals
in order, each send the first arrival not before it (a router that retried a request elsewhere
leaves a second arrival, which matches nothing). A send no engine logged (it failed before
reaching one) has no stages; one with no first token on either side has no engine or hop-out
figure.

Why: on the Mooncake slice kvgate's engines answer first (engine-side TTFT p50 below the
peers'), yet its client p50 was above theirs; the engines' histograms could not say whether the
difference was the gateway or the engines' queue before scheduling, nor which way through the
gateway. This says so per request (docs/performance.md, "The inbound hop, per request", and
"Both hops, per request").
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from replica_agent.sim_engine.request_log import prompt_key

# an engine's logged request: (arrived, parsed, first token written or None, cached prompt
# tokens or None: its prefill never scheduled, the engine's place in the logs read)
Logged = tuple[float, float, float | None, int | None, int]
# each request's record in a run's requests.jsonl (``request_records``)
REQUESTS_FILE = "requests.jsonl"
# a client's request: (sent, prompt key, first data read or None)
Sent = tuple[float, int, float | None]


def send_key(prompt: str) -> int:
    """The key the engines log for a completion of ``prompt``."""
    key = prompt_key({"prompt": prompt})
    assert key is not None
    return key


def read_logs(paths: Sequence[Path]) -> dict[int, list[Logged]]:
    """Per prompt key, its logged requests over the engines' logs, earliest arrival first; a
    missing log (an engine that logged nothing) counts as empty."""
    by_key: dict[int, list[Logged]] = defaultdict(list)
    for engine, path in enumerate(paths):
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            first, cached = rec.get("first"), rec.get("cached")
            by_key[int(rec["key"])].append(
                (
                    float(rec["arrived"]),
                    float(rec["parsed"]),
                    None if first is None else float(first),
                    None if cached is None else int(cached),
                    engine,
                )
            )
    for arrivals in by_key.values():
        arrivals.sort(key=lambda a: a[0])
    return by_key


@dataclass
class Stages:
    """Milliseconds of each matched request's stages, a list a stage (``NAMES``), named as the
    live rows name them (``<name>_p50_ms``); a request without a first token on both sides has
    no ``engine_first_token`` or ``outbound`` figure. ``hit_requests``: the matched requests
    whose engine served any prompt token from its cache."""

    NAMES: ClassVar[tuple[str, ...]] = ("inbound", "engine_parse", "engine_first_token", "outbound")

    inbound: list[float] = field(default_factory=list)
    engine_parse: list[float] = field(default_factory=list)
    engine_first_token: list[float] = field(default_factory=list)
    outbound: list[float] = field(default_factory=list)
    hit_requests: int = 0


def matched(sends: Sequence[Sent], arrivals: dict[int, list[Logged]]) -> list[Logged | None]:
    """Each send's logged request, in the order of ``sends`` (None: no engine logged it): the
    sends of a key, in the order they were sent, each matched to the first arrival of that key
    not before it and not matched yet (an arrival before a send is another request's: not this
    one's)."""
    by_key: dict[int, list[int]] = defaultdict(list)
    for n, s in enumerate(sends):
        by_key[s[1]].append(n)
    out: list[Logged | None] = [None] * len(sends)
    for key, mine in by_key.items():
        seen = arrivals.get(key, [])
        i = 0
        for n in sorted(mine, key=lambda m: sends[m][0]):
            while i < len(seen) and seen[i][0] < sends[n][0]:
                i += 1
            if i == len(seen):
                break
            out[n] = seen[i]
            i += 1
    return out


def request_records(sends: Sequence[Sent], arrivals: dict[int, list[Logged]]) -> list[dict[str, Any]]:
    """One record a send, in the order of ``sends`` (the replay's order of requests, so that the
    same request can be found in another router's run: ``bench.live_requests``): its client
    TTFT, the engine that served it, its cached prompt tokens and its stages in ms (None where
    not known)."""

    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round((b - a) * 1e3, 3)

    out = []
    for i, ((at, key, read), logged) in enumerate(zip(sends, matched(sends, arrivals), strict=True)):
        arrived, parsed, first, cached, engine = logged or (None, None, None, None, None)
        out.append(
            {
                "i": i,
                "key": key,
                "ttft_ms": ms(at, read),
                "engine": engine,
                "cached": cached,
                "inbound_ms": ms(at, arrived),
                "engine_parse_ms": ms(arrived, parsed),
                "engine_first_token_ms": ms(parsed, first),
                "outbound_ms": ms(first, read),
            }
        )
    return out


def stages(records: Sequence[dict[str, Any]]) -> Stages:
    """The stages of the requests an engine logged, from their records (``request_records``,
    the one place sends meet the engines' logs)."""
    out = Stages()
    for r in records:
        if r["engine"] is None:
            continue
        out.hit_requests += bool(r["cached"])
        out.inbound.append(r["inbound_ms"])
        out.engine_parse.append(r["engine_parse_ms"])
        if r["engine_first_token_ms"] is not None and r["outbound_ms"] is not None:
            out.engine_first_token.append(r["engine_first_token_ms"])
            out.outbound.append(r["outbound_ms"])
    return out


def write_requests(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """``records`` as JSON lines (a run's ``REQUESTS_FILE``)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
