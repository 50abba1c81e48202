"""The checks of ``make e2e-vllm`` on the Llama replicas (prediction and index, policy comparison,
restart); see e2e/run.py and docs/e2e-vllm.md. Split out of ``e2e/run.py``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from e2e import workload
from e2e.event_tap import Frame, decode_payload
from e2e.harness import SETTLE_QUIET_S, Harness, equal, exact

RECOVERY_DEADLINE_S = 60.0


def check_prediction_and_index(h: Harness, seed: int) -> None:
    rows = h.run_sequential("mixed", workload.mixed(seed))
    h.details["mixed"] = rows
    h.details["index_after_mixed"] = h.wait_index_equal()


def check_comparison(h: Harness, seed: int) -> dict[str, float]:
    ids = [r.rid for r in h.replicas]
    hit_tokens: dict[str, float] = {}
    for policy in ("kv_aware", "round_robin"):
        h.gateway.stop()
        h.reset_engine_caches()
        h.gateway.start(policy)
        h.gateway.wait_agents(ids)
        h.details[f"index_before_{policy}"] = h.wait_index_equal()
        before = h.hits()
        rows = h.run_sequential(f"agents-{policy}", workload.agent_sessions(seed))
        after = h.hits()
        hit_tokens[policy] = sum(after[k] - before[k] for k in after)
        h.details[f"agents_{policy}"] = rows
        h.details[f"audits_{policy}"] = h.gateway_audits()  # this gateway's, before its restart
        h.details[f"index_after_{policy}"] = h.wait_index_equal()
        h.details[f"hits_{policy}"] = {k: after[k] - before[k] for k in after}
    return hit_tokens


@dataclass
class ClientLoop:
    """A client sending requests one after another through the gateway until stopped; it owns its
    thread, which ``stop`` joins."""

    h: Harness
    seed: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="restart-client", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for req in workload.probes(self.seed, 100_000):
            if self._stop.is_set():
                return
            t = time.monotonic()
            try:
                row = self.h.send(req, timeout_s=60.0)
            except OSError as exc:  # no answer at all: a lost request
                row = {"tag": req.tag, "status": None, "error": None, "exception": repr(exc)}
            row["t"] = t
            self.rows.append(row)
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(90.0)


def check_restart(h: Harness, seed: int) -> tuple[float | None, int]:
    ids = [r.rid for r in h.replicas]
    h.gateway.stop()
    h.gateway.start("kv_aware")
    h.gateway.wait_agents(ids)
    h.wait_index_equal()
    victim = h.replicas[1]
    # Warm both replicas with the probes' prefixes so that the victim holds blocks the gateway
    # would keep routing to if it kept a stale inventory.
    h.details["restart_warmup"] = h.run_sequential("restart-warmup", list(workload.probes(seed, 8)))
    old_keys = set(victim.refresh().keys())
    client = ClientLoop(h, seed)
    client.start()
    try:
        time.sleep(1.0)
        t_stop = time.monotonic()
        assert victim.proc is not None and victim.tap is not None
        h.procs.stop(victim.proc)
        # The stopped engine's cache is gone: our reconstruction starts empty and takes only the
        # new engine's frames (whose seq restarts at 0). The gateway must find this out itself.
        victim.tap.wait_quiet(SETTLE_QUIET_S)
        victim.restart_view()
        h.start_engine(victim)
        h.wait_engine(victim)
        t_healthy = time.monotonic()
        recovered_at: float | None = None
        polls: list[dict[str, Any]] = []
        while time.monotonic() - t_healthy < RECOVERY_DEADLINE_S:
            state = h.gateway.replicas_state().get(victim.rid, {})
            diff = h.index_diff(victim)
            gw_keys = h.gateway.index_keys(victim.rid) or set()
            stale = len((gw_keys & old_keys) - victim.held.keys())
            ok = (
                bool(state.get("healthy"))
                and bool(state.get("agent_connected"))
                and equal(diff)
                and stale == 0
            )
            polls.append({"t": round(time.monotonic() - t_healthy, 3), "ok": ok, "stale_keys": stale, **diff})
            if ok:
                recovered_at = time.monotonic()
                break
            time.sleep(0.05)
        # Keep the client going a little past recovery: its requests must stay exact from here.
        time.sleep(3.0)
    finally:
        client.stop()
    h.settle()
    # Accuracy after recovery, on sequential requests: first over the prefixes the victim held
    # before the restart, then over new ones, which the tie-break spreads so that the restarted
    # replica takes requests and hits again.
    after = h.run_sequential(
        "restart-after", list(workload.probes(seed, 4)) + list(workload.probes(seed + 200, 12))
    )
    lost = [r for r in client.rows if r["status"] != 200 and r.get("error") is None]
    recovered = recovered_at if recovered_at is not None else float("inf")
    in_window = [r for r in client.rows if t_healthy <= r["t"] < recovered]
    past = [r for r in client.rows if r["t"] >= recovered]
    h.details["restart"] = {
        "down_s": round(t_healthy - t_stop, 2),
        "old_blocks": len(old_keys),
        "polls": polls[:5] + polls[-5:],
        "client_requests": len(client.rows),
        "client_ok": sum(1 for r in client.rows if r["status"] == 200),
        "client_clear_errors": [r for r in client.rows if r["status"] != 200 and r.get("error") is not None],
        "lost": lost,
        "client_between_healthy_and_recovered": [brief(r, t_healthy) for r in in_window],
        "client_after_recovered_exact": exact(past),
        "after": after,
        "after_exact": exact(after),
    }
    recovery = None if recovered_at is None else recovered_at - t_healthy
    return recovery, len(lost)


def count_removed(frames: list[Frame]) -> int:
    return sum(1 for f in frames for ev in decode_payload(f.payload)[1] if ev["type"] == "BlockRemoved")


def brief(row: dict[str, Any], t0: float) -> dict[str, Any]:
    keys = ("status", "replica", "predicted", "cached", "error")
    return {"t": round(row["t"] - t0, 3), **{k: row.get(k) for k in keys}}
