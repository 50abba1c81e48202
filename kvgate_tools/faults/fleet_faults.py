"""Fault scenarios on a live fleet (docs/faults.md): 3 ``kvgate sim-engine``s, their agents and
``kvgate serve`` as real processes, under client load: agents killed and restarted (replay reaching
back, and not), an engine killed mid-stream and restarted on its ports.

The fleet is shared by the fleet, event and engine scenarios, run one after another; each leaves
every process running and healthy. Replica r1's engine keeps only ``SHORT_REPLAY`` event batches
(so a restarted agent's replay cannot reach back to its engine's start) and ``R1_CACHE_BLOCKS``
cache blocks.
A scenario aimed at one replica pins traffic on it (``FleetCtx.pinned_load``): kv_aware keeps
each prompt family where it is held, so the fleet's load alone may never reach that replica.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvgate_tools.faults.common import (
    JSON_HEADERS,
    KINDS,
    Call,
    Load,
    Result,
    Sampler,
    Tally,
    chat_body,
    metric_sum,
    replica_flag,
    send,
    wait_exact,
    wait_until,
)
from kvgate_tools.local_fleet import FleetOptions, LocalFleet
from kvgate_tools.procs import http_ok

FIRST_BYTE_TIMEOUT_S = 3.0
SHORT_REPLAY = 20  # r1's replay buffer, in event batches
# r1's engine cache, in blocks. Without replay, the blocks stored before the fault that no later
# request reaches are unknowable until the engine evicts them (docs/faults.md, "Recovery without
# replay: the turnover limit"), so the requests to reconverge grow with the cache: measured 90
# (1,024 blocks, about the engine), 260 (2,048), 550 (4,096). The bound, 200
# requests, is checked on a cache of the size.
R1_CACHE_BLOCKS = 1024
PINNED_WORKERS = 3  # clients sending prompts only the faulty replica holds
NO_REPLAY_BOUND = 200  # requests through the gateway, the bound
STREAM_TOKENS = 256  # streams of about 2 s on the sim-engine, so that a kill cuts some
CLIENT_BOUND_S = 30.0  # a request unanswered this long is lost
SYSTEMS = [f"You are assistant {k}. " + " ".join(f"rule{k}-{j}" for j in range(60)) for k in range(6)]
Prompts = Callable[[int], str]


def prompt(i: int) -> str:
    """A shared system prompt (6 families) and a distinct question: the traffic of a chat fleet."""
    return f"{SYSTEMS[i % len(SYSTEMS)]} Question {i}: " + " ".join(
        f"w{(i * 13 + j) % 97}" for j in range(20)
    )


def family_prompts(tag: str, families: int, seed: int = 0) -> Prompts:
    """Prompts over ``families`` system prompts of their own (named by ``tag``, shared with no other
    traffic) with distinct questions of 10-60 words (deterministic in ``i`` and ``seed``)."""
    systems = [
        f"You are the {tag} assistant {k}. " + " ".join(f"{tag}{k}-{j}" for j in range(60))
        for k in range(families)
    ]

    def make(i: int) -> str:
        rng = random.Random(seed * 1_000_003 + i)
        tail = " ".join(f"w{rng.randrange(97)}" for _ in range(rng.randint(10, 60)))
        return f"{systems[i % families]} Question {i}: {tail}"

    return make


def fleet_options(log_dir: Path) -> FleetOptions:
    """The shared fleet: short timeouts so faults resolve in seconds (first byte 3 s)."""
    return FleetOptions(
        replicas=3,
        cache_blocks=4096,
        policy="kv_aware",
        log_dir=log_dir,
        engine_args={"r1": ["--replay-buffer", str(SHORT_REPLAY), "--cache-blocks", str(R1_CACHE_BLOCKS)]},
        extra_config={
            "proxy": {
                "first_byte_timeout_s": FIRST_BYTE_TIMEOUT_S,
                "request_timeout_s": FIRST_BYTE_TIMEOUT_S,
                "stream_idle_timeout_s": 3.0,
                "connect_timeout_s": 1.0,
            },
            "health": {"interval_s": 0.5, "timeout_s": 0.5, "unhealthy_after": 2, "healthy_after": 2},
        },
    )


@dataclass
class FleetCtx:
    fleet: LocalFleet
    workers: int = 4

    def load(
        self,
        max_tokens: int = 8,
        base_url: str | None = None,
        workers: int | None = None,
        prompts: Prompts = prompt,
        tally: Tally | None = None,
    ) -> Load:
        """Chat traffic through the gateway (or straight to one engine), every other request streamed."""
        url = base_url or self.fleet.gateway_url

        def make(i: int) -> Call:
            body = chat_body(prompts(i), stream=i % 2 == 0, max_tokens=max_tokens)
            return Call(url, body, timeout_s=CLIENT_BOUND_S)

        return Load(make, workers or self.workers, tally)

    def pinned_load(self, i: int, tag: str, tally: Tally, max_tokens: int = 8) -> tuple[Load, bool]:
        """``PINNED_WORKERS`` clients sending prompts of system prompts only replica ``i`` holds
        (``pin``), so that requests reach it whatever kv_aware makes of the fleet's load; and
        whether the pinning was seen in the gateway's index."""
        prompts = family_prompts(tag, PINNED_WORKERS, seed=i)
        pinned = self.pin(i, prompts, PINNED_WORKERS)
        load = self.load(
            max_tokens, workers=PINNED_WORKERS, prompts=lambda n: prompts(PINNED_WORKERS + n), tally=tally
        )
        return load, pinned

    def pin(self, i: int, prompts: Prompts, families: int) -> bool:
        """Make replica ``i`` the one holder of ``prompts``' families: one request of each straight
        to its engine; True once the gateway's index equals that engine (it then routes them to i)."""
        url = self.fleet.engines[i].url
        for n in range(families):
            send(Call(url, chat_body(prompts(n), stream=False), timeout_s=CLIENT_BOUND_S), Tally())
        return wait_exact(self.fleet, [i], 10.0) is not None

    def sampler(self) -> Sampler:
        return Sampler(self.fleet.gateway_proc().pid)

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        os.killpg(pid, sig)

    def crash(self, proc: subprocess.Popen[bytes], down_s: float) -> None:
        """SIGKILL ``proc``'s group, reap it, and leave it down for ``down_s``."""
        self.kill(proc.pid)
        proc.wait()
        time.sleep(down_s)

    def all_replicas(self) -> list[int]:
        return list(range(len(self.fleet.engines)))


def busiest(ctx: FleetCtx, probes: int = 24) -> int:
    """The replica serving most of the load's prompts now (kv_aware keeps each prompt family on
    the replica holding it, so a faulty replica must be one that gets traffic)."""
    served: Counter[str] = Counter()
    for i in range(probes):
        req = urllib.request.Request(
            ctx.fleet.gateway_url + "/v1/chat/completions",
            json.dumps(chat_body(prompt(i), stream=False)).encode(),
            JSON_HEADERS,
        )
        with urllib.request.urlopen(req, timeout=CLIENT_BOUND_S) as resp:
            served[resp.headers.get("x-kvgate-replica", "")] += 1
    ids = [e.replica_id for e in ctx.fleet.engines]
    return ids.index(max(ids, key=lambda r: served[r]))


def clean(t: Tally) -> bool:
    return t.counts["lost"] == 0 and t.counts["broken"] == 0 and t.sent > 0


def agent_restart(ctx: FleetCtx, i: int) -> tuple[Tally, float | None, Sampler]:
    """SIGKILL replica ``i``'s agent under load, restart it 1 s later, keep the load 1 s more; the
    seconds from the restart until the index equals the engine (at rest)."""
    f = ctx.fleet
    # the gateway's load, and traffic straight to engine i so that its cache moves meanwhile
    # (kv_aware may route none of the gateway's prompts there); only the gateway's load is reported
    with ctx.sampler() as s, ctx.load() as load, ctx.load(base_url=f.engines[i].url, workers=1):
        time.sleep(3.0)
        ctx.crash(f.agent_proc(i), 1.0)
        f.start_agent(i)
        restarted = time.monotonic()
        time.sleep(1.0)
    left = wait_exact(f, [i], 10.0)
    return load.tally, (None if left is None else time.monotonic() - restarted), s


def agent_restart_replay(ctx: FleetCtx) -> Result:
    """r0's engine keeps 10,000 batches: the restarted agent's replay reaches back to seq 0."""
    tally, rec, s = agent_restart(ctx, 0)
    ok = clean(tally) and rec is not None and rec <= 5.0
    return Result("agent_restart_replay_reaches_back", tally, rec, s.peak_rss_mb, ok)


def agent_restart_no_replay(ctx: FleetCtx) -> Result:
    """r1's engine keeps 20 event batches. Its own traffic (3 system prompts only r1 holds, so that
    kv_aware routes them to r1) runs through the gateway past that window; its agent is SIGKILLed
    under that load while the engine keeps serving, and restarted once the load stops: the replay
    cannot reach back and the inventory restarts degraded. Then requests through the gateway, as
    production traffic comes, one at a time, checked every 10: the index must equal the engine
    within 200 (the gateway's held-prefix hints, docs/agent.md "Recovery without replay")."""
    f = ctx.fleet
    rid = f.engines[1].replica_id
    prompts = family_prompts("norep", 3, seed=13)
    pinned = ctx.pin(1, prompts, 3)
    tally = Tally()
    with ctx.sampler() as s:
        for n in range(3 * SHORT_REPLAY):  # the engine's history outgrows its replay buffer
            send(Call(f.gateway_url, chat_body(prompts(3 + n), stream=False)), tally)
        with ctx.load(prompts=lambda n: prompts(100_000 + n), tally=tally):
            time.sleep(2.0)
            ctx.crash(f.agent_proc(1), 2.0)  # the engine serves on without its agent
        before = tally.served[rid]
        f.start_agent(1)
        restarted = time.monotonic()
        degraded = wait_until(lambda: replica_flag(f, rid, "index_degraded") is True, 10.0) is not None
        recovery = Tally()
        needed: int | None = None
        for n in range(NO_REPLAY_BOUND):
            send(Call(f.gateway_url, chat_body(prompts(200_000 + n), stream=False)), recovery)
            if n % 10 == 9 and wait_exact(f, [1], 1.0) is not None:
                needed = n + 1
                break
        rec = None if needed is None else time.monotonic() - restarted
    for k in KINDS:
        tally.counts[k] += recovery.counts[k]
    tally.max_latency_s = max(tally.max_latency_s, recovery.max_latency_s)
    ok = clean(tally) and pinned and degraded and needed is not None
    notes = (
        f"{rid} the one holder of its 3 system prompts: {pinned}; {before} of the {tally.sent - recovery.sent} "
        f"requests before the restart served by {rid}; restarted degraded: {degraded}; index = engine after "
        f"{needed if needed is not None else f'not within {NO_REPLAY_BOUND}'} requests through the gateway "
        f"({recovery.served[rid]} of {recovery.sent} served by {rid}); engine cache {R1_CACHE_BLOCKS} blocks"
    )
    return Result("agent_restart_no_replay", tally, rec, s.peak_rss_mb, ok, notes)


def engine_kill_midstream(ctx: FleetCtx) -> Result:
    """SIGKILL the busiest engine while streams run on it, restart it on the same ports; streams end with a
    clear error, whole answers are retried; exact again <= 2 s after its /health answers. Beside the
    fleet's load, ``PINNED_WORKERS`` clients send prompts only that replica holds (``FleetCtx.pin``),
    so that requests are on it when it dies: the run must see some cut or retried."""
    f = ctx.fleet
    i = busiest(ctx)
    rid = f.engines[i].replica_id
    tally = Tally()
    pinned_load, pinned = ctx.pinned_load(i, "killed", tally, STREAM_TOKENS)
    retries = metric_sum(f, "kvgate_retries_total")
    with ctx.sampler() as s, ctx.load(max_tokens=STREAM_TOKENS, tally=tally) as load, pinned_load:
        time.sleep(3.0)
        ctx.crash(f.engine_proc(i), 1.5)
        f.start_engine(i)
        up = wait_until(lambda: http_ok(f.engines[i].url + "/health"), 60.0, 0.05)
    # from /health, or from the end of the requests still in flight then (whichever is later): an
    # index compared with an engine still serving requests races them
    rec = wait_exact(f, [i], 10.0)
    cut = load.tally.counts["clear_error"]
    retried = metric_sum(f, "kvgate_retries_total") - retries
    hit = cut + retried > 0  # requests were on the engine when it died
    ok = clean(load.tally) and pinned and hit and up is not None and rec is not None and rec <= 2.0
    notes = (
        f"{rid} killed (the one holder of {PINNED_WORKERS} pinned system prompts: {pinned}); {cut} streams "
        f"cut with an error event, {retried:.0f} attempts retried elsewhere; healthy "
        f"{up if up is None else round(up, 2)} s after its restart; reconverge_s counted from then or the "
        "end of the requests in flight then"
    )
    return Result("engine_killed_midstream_restarted", load.tally, rec, s.peak_rss_mb, ok, notes)
