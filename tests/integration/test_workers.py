"""``kvgate serve --workers 2`` on real processes (docs/architecture.md, "Workers"): two HTTP
workers on one port (SO_REUSEPORT), fed one index by the parent. Each answer names its worker
(``x-kvgate-worker``), so a test drives requests until both workers have answered."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate_tools.stream_agent import StreamAgent
from proto.kvgate.v1 import inventory_pb2 as pb
from tests.integration.gateway_harness import ADMIN_TOKEN, AGENT_TOKEN, Gateway, Procs, base_config, http
from tests.integration.test_gateway_observability import _keys_for
from tests.polling import wait_until

JSON = {"content-type": "application/json"}
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
BODY = {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 4}
WORKERS = {"workers": 2}
MAX_TRIES = 200  # connections land on a worker by the kernel's hash of the client port

pytestmark = pytest.mark.timeout(120)

Answer = tuple[int, dict[str, str], bytes]


def post(gw: Gateway, body: dict[str, Any]) -> Answer:
    return http("POST", gw.url + "/v1/completions", json.dumps(body).encode(), JSON)


def from_each_worker(ask: Callable[[], Answer], workers: int = 2) -> dict[str, Answer]:
    """``ask()`` until every worker has answered; the first answer of each worker."""
    seen: dict[str, Answer] = {}
    for _ in range(MAX_TRIES):
        answer = ask()
        seen.setdefault(answer[1]["x-kvgate-worker"], answer)
        if len(seen) == workers:
            return seen
    raise AssertionError(f"only workers {sorted(seen)} answered in {MAX_TRIES} requests")


def worker_pids(gw: Gateway) -> dict[int, int]:
    """Worker number -> pid, from the parent's children's command lines (Linux /proc)."""
    out = {}
    pid = gw.proc.pid
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            if "--worker-index" in cmd:
                out[int(cmd[cmd.index("--worker-index") + 1])] = int(child)
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def registered(gw: Gateway, check: Callable[[dict[str, Any]], bool]) -> bool:
    """Both workers' ``/admin/replicas`` satisfy ``check``."""
    answers = from_each_worker(lambda: http("GET", gw.url + "/admin/replicas", headers=ADMIN))
    return all(check({r["id"]: r for r in json.loads(a[2])["replicas"]}) for a in answers.values())


def connect_agent(gw: Gateway, url: str, keys: list[int], block: int) -> StreamAgent:
    agent = StreamAgent(gw.inventory_port, AGENT_TOKEN)
    agent.send(hello=pb.Hello(replica_id="r1", url=url, models=["m"], block_size=block, engine="fake",
                              protocol_version=1))  # fmt: skip
    agent.send(snapshot=pb.SnapshotChunk(snapshot_id=1, keys=keys, medium="GPU", last=True))
    wait_until(
        lambda: registered(gw, lambda reps: reps.get("r1", {}).get("agent_connected") is True),
        what="r1 registered in both workers",
    )
    return agent


def test_agent_blocks_route_the_prefix_to_one_replica_from_both_workers(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    cfg = base_config(r0, policy={"name": "kv_aware"}, server=WORKERS)
    gw = procs.gateway(cfg)
    keys, block = _keys_for(cfg, BODY)
    agent = connect_agent(gw, r1.url, keys[:3], cfg["models"][0].get("block_size", 16))
    try:
        answers = from_each_worker(lambda: post(gw, BODY))
        for worker, (status, headers, _) in answers.items():
            assert status == 200, worker
            assert headers["x-kvgate-replica"] == "r1", (worker, headers)
            assert int(headers["x-kvgate-matched-tokens"]) >= 3 * block, (worker, headers)
        # /metrics sees the whole gateway: both workers' requests and the parent's inventory
        metrics = http("GET", gw.url + "/metrics")[2].decode()
        for worker in ("0", "1"):
            assert f'replica="r1",status="200",worker="{worker}"}}' in metrics
        assert 'kvgate_inventory_snapshots_applied_total{worker="parent"} 1.0' in metrics
        assert 'kvgate_workers{worker="parent"} 2.0' in metrics
    finally:
        agent.close()


def test_a_speculative_entry_made_by_one_worker_is_seen_by_the_other(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    gw = procs.gateway(base_config(r0, r1, policy={"name": "kv_aware"}, server=WORKERS))
    wait_until(lambda: registered(gw, lambda reps: all(r["healthy"] for r in reps.values())), what="healthy")
    body = {**BODY, "prompt": "speculative " * 40}
    status, first, _ = post(gw, body)
    assert status == 200 and first["x-kvgate-matched-tokens"] == "0"
    # relayed through the parent within moments (a request the other worker takes sooner can
    # miss them: the answer may come back faster than the relay)
    raw = json.dumps(body).encode()

    def matched_in_both() -> bool:
        answers = from_each_worker(lambda: http("POST", gw.url + "/admin/explain", raw, {**JSON, **ADMIN}))
        docs = [json.loads(a[2]) for a in answers.values()]
        return all(
            r["matched_blocks"] > 0
            for d in docs
            for r in d["replicas"]
            if r["id"] == first["x-kvgate-replica"]
        )

    wait_until(matched_in_both, 5.0, "the first worker's speculative entries in both")
    for _ in range(MAX_TRIES):
        status, headers, _ = post(gw, body)
        if headers["x-kvgate-worker"] != first["x-kvgate-worker"]:
            break  # the other worker's first answer for this prompt
    else:
        raise AssertionError("the other worker never answered")
    assert status == 200
    assert headers["x-kvgate-replica"] == first["x-kvgate-replica"]
    assert int(headers["x-kvgate-matched-tokens"]) > 0  # the first worker's speculative entries


def test_a_killed_worker_is_restarted_and_resynced(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    cfg = base_config(r0, policy={"name": "kv_aware"}, server=WORKERS)
    gw = procs.gateway(cfg)
    body = {**BODY, "prompt": "Blocks the agent reports while a worker is down. " * 4}
    keys, block = _keys_for(cfg, body)
    agent = connect_agent(gw, r1.url, [], cfg["models"][0].get("block_size", 16))
    try:
        before = worker_pids(gw)
        assert sorted(before) == [0, 1]
        os.kill(before[0], signal.SIGKILL)
        # the agent's blocks arrive while worker 0 is gone: it learns them from the resync
        agent.send(events=pb.Events(events=[pb.Event(stored=pb.Stored(keys=keys[:3]))]))
        wait_until(lambda: worker_pids(gw).get(0, before[0]) != before[0], what="worker 0 restarted")
        answers = wait_until(lambda: _both_route_to_r1(gw, body, 3 * block), 30, "both workers route to r1")
        assert set(answers) == {"0", "1"}
        metrics = wait_until(
            lambda: (
                (m := http("GET", gw.url + "/metrics")[2].decode())
                and 'kvgate_workers{worker="parent"} 2.0' in m
                and m
            ),
            what="both workers listening again",
        )
        assert 'kvgate_worker_restarts_total{worker="parent"} 1.0' in metrics
    finally:
        agent.close()


def _both_route_to_r1(gw: Gateway, body: dict[str, Any], tokens: int) -> dict[str, Answer] | None:
    try:
        answers = from_each_worker(lambda: post(gw, body))
    except AssertionError:
        return None  # the restarted worker does not listen yet
    ok = all(
        h["x-kvgate-replica"] == "r1" and int(h["x-kvgate-matched-tokens"]) >= tokens
        for _, h, _ in answers.values()
    )
    return answers if ok else None


def test_sigterm_drains_every_worker(procs: Procs) -> None:
    r0 = procs.backend("r0")
    # both workers' readiness flips must be seen while the listener is open (drain_delay_s): 3 s
    # on a host that may be slow; the streams (16 chunks, 0.3 s each) are still going when it
    # closes
    server = {**WORKERS, "drain_delay_s": 3.0, "shutdown_grace_s": 15.0}
    gw = procs.gateway(base_config(r0, server=server))
    wait_until(lambda: http("GET", gw.url + "/ready")[0] == 200, what="ready")
    pids = worker_pids(gw)
    slow = {"model": "m", "prompt": "slow", "max_tokens": 16, "stream": True}
    results: list[Answer] = []
    threads = [threading.Thread(target=lambda: results.append(post(gw, slow))) for _ in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: r0.stats()["active"] == 6, what="the six streams under way")
    os.kill(gw.proc.pid, signal.SIGTERM)
    drained = wait_until(
        lambda: _every_worker_draining(gw), 3.0, "/ready 503 from both workers", interval_s=0.01
    )
    assert drained
    for t in threads:
        t.join(30)
    assert [a[0] for a in results] == [200] * 6
    assert {a[1]["x-kvgate-worker"] for a in results} <= {"0", "1"}
    assert gw.proc.wait(30) == 0
    assert sorted(pids) == [0, 1] and not any(alive(p) for p in pids.values())


def _every_worker_draining(gw: Gateway) -> bool:
    answers = from_each_worker(lambda: http("GET", gw.url + "/ready", timeout=2))
    return all(status == 503 and b"draining" in raw for status, _, raw in answers.values())


def _policies(gw: Gateway) -> set[str]:
    """The policy each worker routes with."""
    explain = json.dumps(BODY).encode()
    answers = from_each_worker(lambda: http("POST", gw.url + "/admin/explain", explain, {**JSON, **ADMIN}))
    return {json.loads(raw)["policy"] for _, _, raw in answers.values()}


def test_reload_reaches_every_worker(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    cfg = base_config(r0, r1, server=WORKERS)
    gw = procs.gateway(cfg)
    assert _policies(gw) == {"round_robin"}
    # POST /admin/reload lands on one worker: it, the parent and the other worker reload
    gw.config_path.write_text(
        yaml.safe_dump({**base_config(r1, server=WORKERS), "policy": {"name": "least_loaded"}})
    )
    status, _, raw = http("POST", gw.url + "/admin/reload", headers=ADMIN)
    assert status == 200 and json.loads(raw)["policy"] == "least_loaded"
    wait_until(lambda: _policies(gw) == {"least_loaded"}, what="every worker reloaded")
    assert registered(gw, lambda reps: set(reps) == {"r1"})
    # SIGHUP to the parent: relayed to every worker
    gw.config_path.write_text(yaml.safe_dump({**cfg, "policy": {"name": "consistent_hash"}}))
    gw.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: _policies(gw) == {"consistent_hash"}, what="SIGHUP relayed")
    wait_until(lambda: registered(gw, lambda reps: set(reps) == {"r0", "r1"}), what="r0 back in both")
    metrics = http("GET", gw.url + "/metrics")[2].decode()
    for worker in ("0", "1", "parent"):
        assert f'kvgate_config_reloads_total{{result="applied",worker="{worker}"}} 2.0' in metrics


def test_in_flight_load_is_seen_by_every_worker(procs: Procs) -> None:
    r0 = procs.backend("r0")
    gw = procs.gateway(base_config(r0, server=WORKERS))
    wait_until(lambda: registered(gw, lambda reps: reps["r0"]["healthy"]), what="healthy")
    hang = {"model": "m", "prompt": "hang-forever", "max_tokens": 4}
    threads = [threading.Thread(target=_hang, args=(gw, hang)) for _ in range(3)]
    for t in threads:
        t.start()

    def total(reps: dict[str, Any]) -> bool:
        # each worker: its own requests plus the others' (relayed by the parent) make the three
        r = reps["r0"]
        return bool(r["in_flight_requests"] + r["remote_in_flight_requests"] == 3)

    wait_until(lambda: registered(gw, total), what="every worker counts the three requests")
    for t in threads:
        t.join(30)
    wait_until(
        lambda: registered(gw, lambda reps: reps["r0"]["remote_in_flight_requests"] == 0),
        what="the load gone with its requests",
    )


def _hang(gw: Gateway, body: dict[str, Any], timeout: float = 3.0) -> None:
    """A request the backend never answers; the client gives up after ``timeout`` seconds."""
    with contextlib.suppress(OSError):
        http("POST", gw.url + "/v1/completions", json.dumps(body).encode(), JSON, timeout=timeout)


def test_every_worker_sees_the_queue_of_the_others_flights(procs: Procs) -> None:
    """The TTFT model's queue figures in each worker's snapshot (``/admin/explain``) are those of
    the whole gateway: the pending age of the oldest request (wherever it waits) and the cached
    tokens shared by flights of both workers, each block counted pinned once."""
    r0 = procs.backend("r0")
    gw = procs.gateway(base_config(r0, policy={"name": "kv_aware"}, server=WORKERS))
    wait_until(lambda: registered(gw, lambda reps: reps["r0"]["healthy"]), what="healthy")
    hang = {"model": "m", "prompt": "hang-forever " + "a shared prefix of many blocks " * 20, "max_tokens": 4}
    threads = [threading.Thread(target=_hang, args=(gw, hang, 25.0))]
    threads[0].start()
    first = time.monotonic()
    # the first flight's speculative entries reach both workers: the next flights predict them cached
    cached = wait_until(lambda: _cached_in_both(gw, hang), what="the prefix predicted cached in both")
    time.sleep(1.0)  # the oldest request is the first one by a margin
    while not _both_hold_flights(gw):  # later flights land on either worker, by the client's port
        assert len(threads) < 40, "the flights never landed on both workers"
        threads.append(threading.Thread(target=_hang, args=(gw, hang, 25.0)))
        threads[-1].start()
        time.sleep(0.05)
    n = len(threads)

    def whole(r: dict[str, Any]) -> bool:
        # as one process would count: n - 1 flights each hold the prefix's blocks: pinned once
        return bool(
            r["in_flight_requests"] == n
            and r["in_flight_shared_tokens"] == (n - 2) * cached
            and r["pending_age_ms"] >= (time.monotonic() - first - 0.5) * 1000
        )

    wait_until(lambda: all(whole(r) for r in _explained(gw, hang).values()), what="both see the whole queue")
    for t in threads:
        t.join(30)
    wait_until(
        lambda: all(r["pending_age_ms"] == 0 for r in _explained(gw, hang).values()), what="the queue gone"
    )


def _explained(gw: Gateway, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Worker -> r0 as its snapshot shows it."""
    raw = json.dumps(body).encode()
    answers = from_each_worker(lambda: http("POST", gw.url + "/admin/explain", raw, {**JSON, **ADMIN}))
    return {w: json.loads(a[2])["replicas"][0] for w, a in answers.items()}


def _cached_in_both(gw: Gateway, body: dict[str, Any]) -> int | None:
    raw = json.dumps(body).encode()
    answers = from_each_worker(lambda: http("POST", gw.url + "/admin/explain", raw, {**JSON, **ADMIN}))
    cached = {json.loads(a[2])["decision"]["predicted_cached_tokens"] for a in answers.values()}
    return cached.pop() if len(cached) == 1 and min(cached) > 0 else None


def _both_hold_flights(gw: Gateway) -> bool:
    """Each worker has flights of its own beyond the first (which held no cached block)."""
    answers = from_each_worker(lambda: http("GET", gw.url + "/admin/replicas", headers=ADMIN))
    return all(
        {r["id"]: r for r in json.loads(a[2])["replicas"]}["r0"]["in_flight_requests"] >= 2
        for a in answers.values()
    )


def test_every_worker_routes_on_one_ttft_fit_of_every_first_token(procs: Procs) -> None:
    """The parent fits each replica's TTFT model on the first tokens of both workers' requests and
    publishes it: both workers hold the same fit, which counts every first token."""
    r0 = procs.backend("r0")
    gw = procs.gateway(base_config(r0, policy={"name": "kv_aware"}, server=WORKERS))
    wait_until(lambda: registered(gw, lambda reps: reps["r0"]["healthy"]), what="healthy")
    workers: dict[str, int] = {}
    while len(workers) < 2 or sum(workers.values()) < 12:
        status, headers, _ = post(gw, BODY)
        assert status == 200
        workers[headers["x-kvgate-worker"]] = workers.get(headers["x-kvgate-worker"], 0) + 1
        assert sum(workers.values()) < MAX_TRIES
    total = sum(workers.values())

    def models() -> list[dict[str, Any]] | None:
        answers = from_each_worker(lambda: http("GET", gw.url + "/admin/replicas", headers=ADMIN))
        fits = [json.loads(a[2])["replicas"][0]["ttft_audit"]["model"] for a in answers.values()]
        return fits if all(f is not None and f["observations"] == total for f in fits) else None

    fits = wait_until(models, what="both workers' fits count every first token")
    assert fits[0] == fits[1]
