"""End to end on real processes (issue 3 "Must show"): ``kvgate sim-engine`` publishing real vLLM
KV events, ``kvgate agent`` beside it, ``kvgate serve`` holding the index. After a mixed workload
with evictions, the gateway's ``GET /admin/index?replica=ID`` equals the engine's
``/debug/blocks`` key for key; and again within 2 s of the end of each fault: dropped, duplicated
and reordered events (recovered through replay), an engine restart (seq reset), an agent restart,
a gateway restart. An unrecoverable gap is reported as degraded and heals.

Ports: each process binds port 0 except where a restart must come back at the same address (the
engine's three sockets, the gateway's inventory port); those are checked free just before the
first start, below the ephemeral port range (see ``kvgate_tools.procs.low_free_port``).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate_tools.procs import ProcessGroup, low_free_port, read_line
from tests.integration.gateway_harness import ADMIN_TOKEN, AGENT_TOKEN, http

REPO = Path(__file__).resolve().parents[2]
KVGATE = [sys.executable, "-m", "gateway.cli"]
MODEL = "kvgate-sim"
BLOCK = 16
CACHE_BLOCKS = 96
CONVERGE_S = 2.0  # the bound: index == engine within 2 s of a fault ending
START_S = 60.0  # only bounds a hang while a process starts on a busy machine

pytestmark = pytest.mark.timeout(600)


def get_json(url: str, token: str | None = None) -> Any:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    status, _, body = http("GET", url, headers=headers)
    assert status == 200, (url, status, body[:300])
    return json.loads(body)


def post_json(url: str, doc: Any) -> Any:
    status, _, body = http(
        "POST", url, json.dumps(doc).encode(), {"content-type": "application/json"}, timeout=60
    )
    assert status == 200, (url, status, body[:300])
    return json.loads(body)


@dataclass
class Fleet:
    tmp: Path
    http_port: int = field(default_factory=low_free_port)
    events_port: int = field(default_factory=low_free_port)
    replay_port: int = field(default_factory=low_free_port)
    inventory_port: int = field(default_factory=low_free_port)
    engine: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    gateway: subprocess.Popen[bytes] | None = None
    gateway_url: str = ""
    agent_metrics: str = ""
    group: ProcessGroup = field(init=False)
    engine_flags: list[str] = field(default_factory=list)
    agent_flags: list[str] = field(default_factory=list)
    gateway_block: int = BLOCK
    cache_blocks: int = CACHE_BLOCKS
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    def __post_init__(self) -> None:
        # four independent picks can coincide (a gateway once found its inventory port taken by
        # the engine's HTTP listener): pick again until they are distinct
        taken: set[int] = set()
        for name in ("http_port", "events_port", "replay_port", "inventory_port"):
            while getattr(self, name) in taken:
                setattr(self, name, low_free_port())
            taken.add(getattr(self, name))
        self.group = ProcessGroup(self.tmp, cwd=REPO)

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _spawn(
        self, args: list[str], name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        return self.group.spawn(name, [*KVGATE, *args], env=full_env, extra_env=env, stdout_pipe=True)

    def start_engine(self) -> None:
        self.engine = self._spawn(
            [
                "sim-engine", "--port", str(self.http_port), "--events-port", str(self.events_port),
                "--replay-port", str(self.replay_port), "--model", MODEL, "--block-size", str(BLOCK),
                "--cache-blocks", str(self.cache_blocks), "--time-scale", "0.01", "--seed", "1",
                *self.engine_flags,
            ],
            "engine",
        )  # fmt: skip
        read_line(self.engine, r"sim-engine ready", START_S)

    def start_agent(self) -> None:
        self.agent = self._spawn(
            [
                "agent", "--replica-id", "r0", "--engine-url", self.engine_url,
                "--events", f"tcp://127.0.0.1:{self.events_port}",
                "--replay", f"tcp://127.0.0.1:{self.replay_port}",
                "--gateway", f"127.0.0.1:{self.inventory_port}", "--reconnect-max", "0.5", "--log-level", "DEBUG",
                *self.agent_flags,
            ],
            "agent",
            {"KVGATE_AGENT_TOKEN": AGENT_TOKEN},
        )  # fmt: skip
        m = read_line(self.agent, r"kvgate agent ready .* metrics=(\S+)", START_S)
        self.agent_metrics = m.group(1)

    def start_gateway(self) -> None:
        config = {
            "models": [
                {
                    "name": MODEL,
                    "tokenizer": str(REPO / "assets/tokenizers/kvgate-tiny"),
                    "block_size": self.gateway_block,
                }
            ],
            "policy": {"name": "round_robin"},
            "index": {"max_blocks_per_replica": 10_000},
        }
        path = self.tmp / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        self.gateway = self._spawn(
            [
                "serve",
                "--config",
                str(path),
                "--listen",
                "127.0.0.1:0",
                "--inventory",
                f"127.0.0.1:{self.inventory_port}",
            ],
            "gateway",
            {"KVGATE_AGENT_TOKEN": AGENT_TOKEN, "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN},
        )
        m = read_line(self.gateway, r"kvgate serve: http=\S+:(\d+)", START_S)
        self.gateway_url = f"http://127.0.0.1:{m.group(1)}"

    def stop(self, proc: subprocess.Popen[bytes] | None) -> int:
        assert proc is not None
        return self.group.stop(proc, grace_s=10.0)

    # ---------------------------------------------------------------- observations
    def engine_keys(self) -> list[int]:
        doc = get_json(self.engine_url + "/debug/blocks")
        assert doc["block_size"] == BLOCK
        return sorted(doc["keys"])

    def index_keys(self) -> list[int] | None:
        status, _, body = http(
            "GET",
            self.gateway_url + "/admin/index?replica=r0",
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        if status == 404:
            return None  # the agent has not said hello yet
        assert status == 200, body
        doc = json.loads(body)
        assert doc["replica"] == "r0"
        return sorted(doc["keys"])

    def replica(self) -> dict[str, Any]:
        doc = get_json(self.gateway_url + "/admin/replicas", ADMIN_TOKEN)
        by_id: dict[str, dict[str, Any]] = {r["id"]: r for r in doc["replicas"]}
        return by_id.get("r0", {})

    def converge(self, what: str, bound_s: float = CONVERGE_S) -> float:
        """Seconds until the gateway's index of r0 equals the engine's blocks; fails past bound_s."""
        t0 = time.monotonic()
        while True:
            engine, index = self.engine_keys(), self.index_keys()
            if index == engine:
                return time.monotonic() - t0
            if time.monotonic() - t0 > bound_s:
                missing = len(set(engine) - set(index or []))
                extra = len(set(index or []) - set(engine))
                raise AssertionError(
                    f"{what}: index != engine after {bound_s}s ({len(engine)} engine blocks, "
                    f"{missing} missing, {extra} extra in the index)"
                )
            time.sleep(0.02)

    def subset(self, what: str, bound_s: float = CONVERGE_S) -> None:
        """Wait until every key the index holds for r0 is one the engine holds (in-flight events
        settle); fails past bound_s."""
        t0 = time.monotonic()
        while not set(self.index_keys() or []) <= set(self.engine_keys()):
            assert time.monotonic() - t0 < bound_s, f"{what}: the index holds blocks the engine does not"
            time.sleep(0.02)

    # ---------------------------------------------------------------- workload
    def workload(self, n: int) -> None:
        """Completions over a few shared system prompts with varied tails: shared prefixes, and more
        blocks than the cache holds, so the engine evicts."""
        words = [
            "alpha",
            "beta",
            "gamma",
            "delta",
            "epsilon",
            "zeta",
            "theta",
            "kappa",
            "lambda",
            "sigma",
            "omega",
            "river",
            "stone",
            "cloud",
        ]
        systems = [" ".join(self.rng.choice(words) for _ in range(60)) for _ in range(3)]
        for i in range(n):
            tail = " ".join(self.rng.choice(words) for _ in range(self.rng.randint(10, 80)))
            prompt = f"{systems[i % len(systems)]} | request {i} {tail}"
            post_json(
                self.engine_url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}
            )

    def faults(self, **counts: Any) -> None:
        post_json(self.engine_url + "/debug/faults", counts)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    with f.group:  # stops every child on the way out
        yield f


def test_index_equals_engine_through_faults(fleet: Fleet) -> None:
    fleet.start_engine()
    fleet.start_gateway()
    fleet.start_agent()
    timings: dict[str, float] = {}

    # a mixed workload with evictions
    fleet.workload(40)
    timings["workload"] = fleet.converge("after the workload")
    assert len(fleet.engine_keys()) > CACHE_BLOCKS // 2
    assert fleet.replica()["agent_connected"] is True

    # dropped, duplicated and reordered events, recovered through replay
    fleet.faults(drop=3)
    fleet.workload(8)
    timings["dropped events"] = fleet.converge("after dropped events")
    fleet.faults(duplicate=3, reorder=3)
    fleet.workload(8)
    timings["duplicated+reordered events"] = fleet.converge("after duplicated and reordered events")
    # the last batches lost with nothing after them: no later seq shows the gap, the agent asks
    # replay once its engine's stream has been quiet
    fleet.faults(drop=100)
    fleet.workload(2)
    fleet.faults(drop=0)
    timings["dropped last batches"] = fleet.converge("after dropped last batches")

    # engine restart: seq starts again at 0 and the cache is empty
    assert fleet.stop(fleet.engine) is not None
    fleet.start_engine()
    timings["engine restart (empty)"] = fleet.converge("after the engine restart")
    fleet.workload(12)
    timings["engine restart + workload"] = fleet.converge("after the restarted engine's workload")

    # agent restart: the new agent replays the engine's buffer from 0 and sends a snapshot
    assert fleet.stop(fleet.agent) == 0  # clean exit on SIGTERM
    fleet.workload(6)  # events nobody listens to
    fleet.start_agent()
    timings["agent restart"] = fleet.converge("after the agent restart")

    # gateway restart: a new, empty index; the agent reconnects and sends its snapshot
    fleet.stop(fleet.gateway)
    fleet.workload(6)  # the agent keeps following its engine while the gateway is down
    fleet.start_gateway()
    timings["gateway restart"] = fleet.converge("after the gateway restart")
    fleet.workload(6)
    timings["gateway restart + workload"] = fleet.converge("after the gateway restart and more work")
    assert fleet.replica()["index_degraded"] is False
    print("convergence (s):", {k: round(v, 3) for k, v in timings.items()})


def test_unrecoverable_gap_degrades_then_heals(fleet: Fleet) -> None:
    fleet.start_engine()
    fleet.start_gateway()
    fleet.start_agent()
    fleet.workload(10)
    fleet.converge("after the first workload")
    fleet.faults(drop=2, from_replay=True)  # the dropped batches are gone from replay too
    fleet.workload(4)
    deadline = time.monotonic() + 10
    while not fleet.replica().get("index_degraded"):
        assert time.monotonic() < deadline, "the gateway never saw the replica degraded"
        time.sleep(0.05)
    fleet.subset("while degraded")  # the index may miss blocks, never invent them
    # fresh events rebuild it: enough eviction turnover with every parent known
    fleet.workload(60)
    deadline = time.monotonic() + 20
    while fleet.replica().get("index_degraded"):
        assert time.monotonic() < deadline, "the replica stayed degraded"
        fleet.workload(4)
    fleet.subset("after healing")


def test_tagged_arrays_and_digest_hashes(fleet: Fleet) -> None:
    """The older tagged-array encoding with 32-byte digest hashes, end to end."""
    fleet.engine_flags = ["--event-encoding", "array", "--hash-format", "bytes"]
    fleet.agent_flags = ["--metrics-port", "0"]
    fleet.start_engine()
    fleet.start_gateway()
    fleet.start_agent()
    fleet.workload(30)
    fleet.converge("after the workload")
    assert len(fleet.engine_keys()) > CACHE_BLOCKS // 2
    fleet.faults(drop=2)
    fleet.workload(6)
    fleet.converge("after dropped events")
    # the agent's own metrics
    status, _, body = http("GET", f"http://{fleet.agent_metrics}/metrics")
    text = body.decode()
    assert status == 200

    def sample(pattern: str) -> float:
        m = re.search(pattern + r" (\S+)", text)
        assert m is not None, pattern
        return float(m.group(1))

    assert sample(r'kvgate_agent_engine_gaps_total\{outcome="recovered"\}') >= 1
    assert sample(r'kvgate_agent_engine_gaps_total\{outcome="unrecovered"\}') == 0
    assert sample(r'kvgate_agent_engine_batches_total\{outcome="applied"\}') > 0
    assert sample("kvgate_agent_gateway_connected") == 1


def test_gateway_block_size_a_multiple_of_the_engines(fleet: Fleet) -> None:
    """Gateway blocks of 32 tokens over engine blocks of 16 (--key-block-size 32): the index holds
    the gateway's own keys of every cached prompt (a cache large enough that nothing is evicted)."""
    from router_policies.block_keys import block_keys

    fleet.gateway_block = 2 * BLOCK
    fleet.cache_blocks = 4096
    fleet.agent_flags = ["--key-block-size", str(2 * BLOCK)]
    fleet.start_engine()
    fleet.start_gateway()
    fleet.start_agent()
    prompts = [f"shared preamble {'lorem ipsum ' * 40} question {i} {'x y ' * (5 * i)}" for i in range(5)]
    for p in prompts:
        post_json(fleet.engine_url + "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 4})
    expected: set[int] = set()
    for p in prompts:
        tokens = post_json(fleet.engine_url + "/tokenize", {"model": MODEL, "prompt": p})["tokens"]
        expected |= set(block_keys(tokens, 2 * BLOCK, MODEL))
    assert len(expected) > 10
    t0 = time.monotonic()
    while not expected <= set(fleet.index_keys() or []):
        assert time.monotonic() - t0 < CONVERGE_S, "the index lacks the gateway's keys of the prompts"
        time.sleep(0.02)
    assert fleet.replica()["block_size"] == 2 * BLOCK
