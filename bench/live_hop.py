"""The inbound hop of each request of a live replay (bench/live.py): the time from the client's
send to the engine's HTTP handler, told apart from the engine's parse queue (its tokenizer
thread) that follows it, for any router alike.

The client notes when it sent each prompt (``time.monotonic``); each ``kvgate sim-engine`` of
the fleet logs when each request reached its handler and when its parse ended
(``--request-log``, replica_agent/sim_engine/request_log.py), on the same host clock. A send is
matched to an arrival by the prompt's key (``prompt_key``); a prompt sent more than once matches
its arrivals in order, each send the first arrival not before it (a router that retried a
request elsewhere leaves a second arrival, which matches nothing). A send no engine logged
(it failed before reaching one) has no hop.

Why: on the Mooncake slice kvgate's engines answer first (engine-side TTFT p50 below the
peers'), yet its client p50 was above theirs; the engines' histograms could not say whether the
difference was the gateway or the engines' queue before scheduling. This says so per request
(docs/performance.md, "The inbound hop, per request").
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from replica_agent.sim_engine.request_log import prompt_key


def send_key(prompt: str) -> int:
    """The key the engines log for a completion of ``prompt``."""
    key = prompt_key({"prompt": prompt})
    assert key is not None
    return key


def read_logs(paths: Sequence[Path]) -> dict[int, list[tuple[float, float]]]:
    """Per prompt key, its (arrived, parsed) times over the engines' logs, earliest first; a
    missing log (an engine that logged nothing) counts as empty."""
    by_key: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            by_key[int(rec["key"])].append((float(rec["arrived"]), float(rec["parsed"])))
    for arrivals in by_key.values():
        arrivals.sort()
    return by_key


def inbound_ms(
    sends: Sequence[tuple[float, int]], arrivals: dict[int, list[tuple[float, float]]]
) -> tuple[list[float], list[float]]:
    """(inbound hop ms, engine parse ms) of each send (``(sent, key)``) that an engine logged:
    the sends of a key, in order, each matched to the first arrival of that key not before it
    and not matched yet (an arrival before a send is another request's: not this one's)."""
    sent_by_key: dict[int, list[float]] = defaultdict(list)
    for sent, key in sends:
        sent_by_key[key].append(sent)
    hop: list[float] = []
    parse: list[float] = []
    for key, times in sent_by_key.items():
        seen = arrivals.get(key, [])
        i = 0
        for sent in sorted(times):
            while i < len(seen) and seen[i][0] < sent:
                i += 1
            if i == len(seen):
                break
            arrived, parsed = seen[i]
            i += 1
            hop.append((arrived - sent) * 1e3)
            parse.append((parsed - arrived) * 1e3)
    return hop, parse
