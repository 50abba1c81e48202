"""Recovery without replay on real processes (issue 13, finding 2; docs/agent.md, "Recovery
without replay"): ``kvgate sim-engine --replay-buffer 100``, ``kvgate agent``, ``kvgate serve``.

The engine caches a few hot system prompts under 200 requests; the agent is SIGKILLed and
restarted, so the replay buffer no longer reaches back and every new block's parent is a system
prompt block the new agent never saw. Requests through the gateway then carry the engine's
``cached_tokens`` back to the gateway, whose held-prefix hints let the agent adopt those blocks:
the index must equal the engine's ``/debug/blocks`` within 200 requests, every request answered.
The same after an unrecoverable event gap (``/debug/faults`` drop with ``from_replay``).
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate_tools.procs import stop_group
from tests.integration.gateway_harness import http
from tests.integration.test_inventory_e2e import MODEL, Fleet, post_json

REQUEST_BOUND = 200  # the bound when replay cannot reach back
# about the engine (984 keys held after 200 requests): blocks nobody touches after the
# fault are unknowable until evicted, so the bound holds for caches that turn over within it
CACHE_BLOCKS = 1024
SETTLE_S = 1.0  # events in flight settle within this after a request (checked every 10 requests)

pytestmark = pytest.mark.timeout(600)

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "river", "stone"]


class Traffic:
    """Requests over three hot system prompts (fixed for the whole test) with varied tails."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.systems = [" ".join(self.rng.choice(WORDS) for _ in range(60)) for _ in range(3)]
        self.sent = 0
        self.answered = 0

    def prompt(self) -> str:
        tail = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(10, 60)))
        i = self.sent
        self.sent += 1
        return f"{self.systems[i % 3]} | request {i} {tail}"

    def send(self, url: str) -> None:
        doc = {"model": MODEL, "prompt": self.prompt(), "max_tokens": 4}
        status, _, body = http(
            "POST",
            url + "/v1/completions",
            json.dumps(doc).encode(),
            {"content-type": "application/json"},
            timeout=60,
        )
        assert status == 200, (status, body[:300])
        self.answered += 1


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    f.engine_flags = ["--replay-buffer", "100"]
    f.cache_blocks = CACHE_BLOCKS
    with f.group:  # stops every child on the way out
        yield f


def wait_healthy(fleet: Fleet) -> None:
    deadline = time.monotonic() + 20
    while not fleet.replica().get("healthy"):
        assert time.monotonic() < deadline, "r0 never became healthy at the gateway"
        time.sleep(0.05)


def equal_within(fleet: Fleet, bound_s: float) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        if fleet.index_keys() == fleet.engine_keys():
            return True
        time.sleep(0.05)
    return False


def requests_until_equal(fleet: Fleet, traffic: Traffic) -> int:
    """Send requests through the gateway until the index equals the engine; how many it took."""
    for n in range(1, REQUEST_BOUND + 1):
        traffic.send(fleet.gateway_url)
        if n % 10 == 0:
            if equal_within(fleet, SETTLE_S):
                return n
            # meanwhile the index only misses blocks: it never holds one the engine does not
            fleet.subset(f"{n} requests into recovery")
    engine, index = set(fleet.engine_keys()), set(fleet.index_keys() or [])
    raise AssertionError(
        f"index != engine after {REQUEST_BOUND} requests: {len(engine)} engine blocks, "
        f"{len(engine - index)} missing, {len(index - engine)} extra"
    )


def warm_engine(fleet: Fleet, traffic: Traffic) -> None:
    for _ in range(200):
        post_json(
            fleet.engine_url + "/v1/completions",
            {"model": MODEL, "prompt": traffic.prompt(), "max_tokens": 4},
        )
        traffic.answered += 1


def test_agent_killed_beside_a_warm_engine_reconverges_under_traffic(fleet: Fleet) -> None:
    fleet.start_engine()
    fleet.start_gateway()
    fleet.start_agent()
    traffic = Traffic(11)
    warm_engine(fleet, traffic)
    assert fleet.agent is not None
    stop_group(fleet.agent, signal.SIGKILL)
    fleet.start_agent()  # replays from seq 0: the buffer (100 batches) no longer reaches back
    deadline = time.monotonic() + 10
    while not fleet.replica().get("index_degraded") or fleet.index_keys() is None:
        assert time.monotonic() < deadline, "the restarted agent never reported its inventory degraded"
        time.sleep(0.05)
    assert len(fleet.engine_keys()) > 100 and len(fleet.index_keys() or []) == 0
    n = requests_until_equal(fleet, traffic)
    print(f"agent restart without replay: index == engine after {n} requests")
    assert traffic.answered == traffic.sent  # 0 lost
    for _ in range(20):  # and it stays equal under more traffic
        traffic.send(fleet.gateway_url)
    assert equal_within(fleet, 2.0)


def test_unrecoverable_gap_reconverges_under_traffic(fleet: Fleet) -> None:
    fleet.start_engine()
    fleet.start_gateway()
    fleet.start_agent()
    wait_healthy(fleet)
    traffic = Traffic(12)
    for _ in range(30):
        traffic.send(fleet.gateway_url)
    assert equal_within(fleet, 2.0)
    fleet.faults(drop=2, from_replay=True)  # gone from the replay buffer too: the agent clears
    deadline = time.monotonic() + 10
    while not fleet.replica().get("index_degraded"):
        traffic.send(fleet.gateway_url)
        assert time.monotonic() < deadline, "the gateway never saw the replica degraded"
    n = requests_until_equal(fleet, traffic)
    print(f"unrecoverable gap: index == engine after {n} requests")
    assert traffic.answered == traffic.sent
