"""Event and engine faults on the shared live fleet (docs/faults.md): KV event batches dropped,
duplicated, reordered (the sim-engine's ``/debug/faults``) and corrupted (a ZMQ relay between
an engine and its agent that garbles payloads); an engine hung (SIGSTOP), slow, answering 5xx.

Must hold: 0 lost and the index exact again <= 2 s for events; for a sick engine no request waits
longer than the first-byte timeout (plus the answer of the replica it is retried on), and the
replica is ejected and restored.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import zmq

from kvgate_tools.faults.common import (
    Background,
    Result,
    Tally,
    engine_keys,
    index_keys,
    metric_sum,
    replica_healthy,
    wait_exact,
    wait_until,
)
from kvgate_tools.faults.fleet_faults import (
    FIRST_BYTE_TIMEOUT_S,
    PINNED_WORKERS,
    FleetCtx,
    busiest,
    clean,
)
from kvgate_tools.procs import free_port

RETRY_SERVICE_S = 2.0  # the retried attempt's own answer, on top of the first-byte timeout
Sickness = tuple[Callable[[], object], Callable[[], object]]  # (make sick, heal)


def post_faults(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url + "/debug/faults", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def faults_pending(url: str) -> int:
    with urllib.request.urlopen(url + "/debug/faults", timeout=5) as resp:
        doc = json.loads(resp.read())
    return int(doc["drop"]) + int(doc["duplicate"]) + int(doc["reorder"])


def event_fault(ctx: FleetCtx, name: str, faults: dict[str, Any]) -> Result:
    """``faults`` on every engine's next batches under load (the gateway's, and some straight to
    each engine, since kv_aware may route it nothing) until every engine has applied them, then 1 s
    more (a batch held back for reordering goes out after the next one); exact again <= 2 s."""
    f = ctx.fleet
    with ctx.sampler() as s, ctx.load() as load, contextlib.ExitStack() as direct:
        for e in f.engines:
            direct.enter_context(ctx.load(base_url=e.url, workers=1))
        time.sleep(1.0)
        for e in f.engines:
            post_faults(e.url, faults)
        applied = wait_until(lambda: all(faults_pending(e.url) == 0 for e in f.engines), 20.0)
        time.sleep(1.0)
    rec = wait_exact(f, ctx.all_replicas(), 10.0)
    ok = clean(load.tally) and applied is not None and rec is not None and rec <= 2.0
    return Result(
        name, load.tally, rec, s.peak_rss_mb, ok, f"faults applied on every engine: {applied is not None}"
    )


def events_dropped(ctx: FleetCtx) -> Result:
    return event_fault(ctx, "events_dropped", {"drop": 3})


def events_duplicated(ctx: FleetCtx) -> Result:
    return event_fault(ctx, "events_duplicated", {"duplicate": 3})


def events_reordered(ctx: FleetCtx) -> Result:
    return event_fault(ctx, "events_reordered", {"reorder": 3})


class CorruptingRelay(Background):
    """SUB to an engine's PUB, PUB to its agent: every frame passes, except that the payloads of
    the next ``corrupt`` batches are replaced by bytes that are not msgpack (seq kept)."""

    def __init__(self, upstream: str) -> None:
        super().__init__()
        self.port = free_port()
        self.upstream = upstream
        self.corrupt = 0
        self.corrupted = 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def arm(self, n: int) -> None:
        with self._lock:
            self.corrupt = n

    def _garble(self, frames: list[bytes]) -> list[bytes]:
        with self._lock:
            if self.corrupt <= 0 or len(frames) != 3:
                return frames
            self.corrupt -= 1
            self.corrupted += 1
        return [frames[0], frames[1], b"\xc1\xc1 not msgpack " + frames[2][:8]]

    def _run(self) -> None:
        zctx = zmq.Context()
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.upstream)
        pub = zctx.socket(zmq.PUB)
        pub.bind(self.url)
        try:
            while not self._stop.is_set():
                if sub.poll(100):
                    pub.send_multipart(self._garble(sub.recv_multipart()))
        finally:
            sub.close(0)
            pub.close(0)
            zctx.term()


def events_corrupted(ctx: FleetCtx) -> Result:
    """r2's agent is moved behind a relay that garbles 3 payloads under load; then it is moved back."""
    f = ctx.fleet
    i = 2
    e = f.engines[i]
    with CorruptingRelay(f"tcp://127.0.0.1:{e.events_port}") as relay:
        f.stop_process(f.agent_proc(i))
        f.start_agent(i, events_url=relay.url)
        f.wait_agents_connected(30.0)
        wait_exact(f, [i], 10.0)
        # kv_aware keeps each prompt family on the replica holding it: r2 gets its traffic directly
        with ctx.sampler() as s, ctx.load(base_url=e.url) as load:
            time.sleep(1.0)
            relay.arm(3)
            time.sleep(3.0)
        rec = wait_exact(f, [i], 10.0)
        corrupted = relay.corrupted
        short = len(engine_keys(f, i) or []) - len(index_keys(f, e.replica_id) or [])
        f.stop_process(f.agent_proc(i))
    f.start_agent(i)
    f.wait_agents_connected(30.0)
    ok = clean(load.tally) and rec is not None and rec <= 2.0 and corrupted > 0
    return Result(
        "events_corrupted",
        load.tally,
        rec,
        s.peak_rss_mb,
        ok,
        f"{corrupted} payloads garbled; index short of engine by {short} keys",
    )


def sick_engine(ctx: FleetCtx, name: str, sick: Callable[[int], Sickness]) -> Result:
    """Load while the busiest replica is sick for 6 s: ejected (seen unhealthy), restored after it
    heals (healthy again within 10 s), every request answered within the first-byte bound.

    kv_aware routes by what replicas hold, so the fleet's load alone may send the sick replica
    nothing in its 6 s. Beside it, ``PINNED_WORKERS`` clients send prompts of system prompts that
    only the sick replica holds (``FleetCtx.pin``): they go to it until it fails them, so every
    run has requests waiting on the sick engine, which must be failed over and eject it."""
    f = ctx.fleet
    i = busiest(ctx)
    rid = f.engines[i].replica_id
    pinned_load, pinned = ctx.pinned_load(i, name, Tally())
    make_sick, heal = sick(i)
    ejected = False
    retries = metric_sum(f, "kvgate_retries_total")
    with ctx.sampler() as s, ctx.load(tally=pinned_load.tally) as load, pinned_load:
        time.sleep(1.0)
        make_sick()
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            ejected = ejected or replica_healthy(f, rid) is False
            time.sleep(0.05)
        heal()
        restored = wait_until(lambda: replica_healthy(f, rid) is True, 10.0)
        time.sleep(1.0)
    t: Tally = load.tally
    bound = FIRST_BYTE_TIMEOUT_S + RETRY_SERVICE_S
    ok = clean(t) and pinned and ejected and restored is not None and t.max_latency_s <= bound
    retried = metric_sum(f, "kvgate_retries_total") - retries
    notes = (
        f"{rid} sick (the one holder of {PINNED_WORKERS} pinned system prompts: {pinned}; "
        f"{t.served[rid]} answers from it); ejected={ejected}; healthy again after "
        f"{restored if restored is None else round(restored, 2)} s; {retried:.0f} attempts retried elsewhere; "
        f"max latency {t.max_latency_s:.2f} s (bound {bound})"
    )
    return Result(name, t, restored, s.peak_rss_mb, ok, notes)


def engine_hung(ctx: FleetCtx) -> Result:
    def sick(i: int) -> Sickness:
        pid = ctx.fleet.engine_proc(i).pid
        return lambda: ctx.kill(pid, signal.SIGSTOP), lambda: ctx.kill(pid, signal.SIGCONT)

    return sick_engine(ctx, "engine_hung_sigstop", sick)


def request_faults(ctx: FleetCtx, on: dict[str, Any], off: dict[str, Any]) -> Callable[[int], Sickness]:
    def sick(i: int) -> Sickness:
        url = ctx.fleet.engines[i].url
        return lambda: post_faults(url, on), lambda: post_faults(url, off)

    return sick


def engine_slow(ctx: FleetCtx) -> Result:
    slow = {"slow": 100_000, "slow_ms": int(FIRST_BYTE_TIMEOUT_S * 1000 + 2000)}
    return sick_engine(ctx, "engine_slow", request_faults(ctx, slow, {"slow": 0}))


def engine_5xx(ctx: FleetCtx) -> Result:
    err = {"error": 100_000, "error_status": 500}
    return sick_engine(ctx, "engine_5xx", request_faults(ctx, err, {"error": 0}))
