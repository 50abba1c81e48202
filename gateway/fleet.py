"""Fleet state: the replicas the gateway can route to, their health and their load.

Replicas come from the config (static) and from agents that say hello over the inventory stream.
Health is fed by the active checker (``gateway.health``) and passively by the proxy: a replica
that fails ``health.unhealthy_after`` times in a row is ejected, and comes back after
``health.healthy_after`` consecutive successful checks. A connect error ejects at once: nothing
listens at that address.

Load is what this gateway routed and has not finished (requests, tokens, and uncached prompt
tokens still waiting for their first byte), plus what the agents report from the engine.

Invariants
* Every method is synchronous and never awaits, so a mutation is atomic on the event loop.
* A ``Flight`` releases exactly what it added: ``first_byte`` and ``end`` are idempotent.
* ``snapshot`` returns an immutable ``FleetSnapshot``; policies never see the mutable records.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.config import GatewayConfig, HealthConfig, ReplicaConfig
from gateway.inventory_sink import AgentHello, AgentLoad
from router_policies.policy import FleetSnapshot, ReplicaState
from router_policies.prefix_index import IndexBoundError, PrefixIndex


@dataclass(slots=True)
class ReplicaRecord:
    id: str
    url: str
    models: frozenset[str]  # empty: every configured model
    static: bool
    agent_connected: bool = False
    index_degraded: bool = False  # the agent says the index may miss some of its blocks
    engine: str = ""
    block_size: int | None = None
    healthy: bool = False
    checked: bool = False  # at least one health result arrived
    unhealthy_since: float | None = None  # monotonic time it last became unhealthy
    ok_streak: int = 0
    fail_streak: int = 0
    last_error: str = ""
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    pending_prefill_tokens: int = 0
    engine_running: int = 0
    engine_waiting: int = 0
    kv_usage: float = 0.0
    requests: int = 0
    failures: int = 0
    audit_total: int = 0
    audit_exact: int = 0
    # shared state (gateway/shared_state.py): what other gateway instances routed here and have
    # not finished, and whether this replica's precise inventory arrives through Redis
    remote_requests: int = 0
    remote_tokens: int = 0
    remote_prefill_tokens: int = 0
    shared_inventory: bool = False

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models

    def describe(self) -> dict[str, object]:
        return {
            "id": self.id,
            "url": self.url,
            "models": sorted(self.models),
            "source": "static" if self.static else "agent",
            "agent_connected": self.agent_connected,
            "index_degraded": self.index_degraded,
            "engine": self.engine,
            "block_size": self.block_size,
            "healthy": self.healthy,
            "last_error": self.last_error,
            "in_flight_requests": self.in_flight_requests,
            "in_flight_tokens": self.in_flight_tokens,
            "pending_prefill_tokens": self.pending_prefill_tokens,
            "engine_running": self.engine_running,
            "engine_waiting": self.engine_waiting,
            "kv_usage": self.kv_usage,
            "requests": self.requests,
            "failures": self.failures,
            "remote_in_flight_requests": self.remote_requests,
            "remote_in_flight_tokens": self.remote_tokens,
            "shared_inventory": self.shared_inventory,
            "prediction_audit": {
                "total": self.audit_total,
                "exact": self.audit_exact,
                "exact_fraction": (self.audit_exact / self.audit_total) if self.audit_total else None,
            },
        }


@dataclass(frozen=True, slots=True)
class RemoteLoad:
    """Load other gateway instances report for one replica (``engine``: running, waiting, KV usage
    from the instance holding the replica's agent, when one does)."""

    requests: int
    tokens: int
    prefill: int
    engine: tuple[int, int, float] | None = None


class Flight:
    """One routed attempt on one replica; holds the load it added until released."""

    __slots__ = ("_open", "_prefill_open", "prefill", "record", "tokens")

    def __init__(self, record: ReplicaRecord, tokens: int, prefill: int) -> None:
        self.record = record
        self.tokens = tokens
        self.prefill = prefill
        self._open = True
        self._prefill_open = True
        record.in_flight_requests += 1
        record.in_flight_tokens += tokens
        record.pending_prefill_tokens += prefill
        record.requests += 1

    def first_byte(self) -> None:
        if self._prefill_open:
            self._prefill_open = False
            self.record.pending_prefill_tokens -= self.prefill

    def end(self) -> None:
        self.first_byte()
        if self._open:
            self._open = False
            self.record.in_flight_requests -= 1
            self.record.in_flight_tokens -= self.tokens


class Fleet:
    def __init__(self, config: GatewayConfig, index: PrefixIndex) -> None:
        self._index = index
        self._records: dict[str, ReplicaRecord] = {}
        self._health = config.health
        self._block_sizes: dict[str, int] = {m.name: m.block_size for m in config.models}
        self._allow_registration = config.inventory.allow_registration
        self.reconfigure(config)

    # ------------------------------------------------------------------ config
    def reconfigure(self, config: GatewayConfig) -> list[str]:
        """Apply a (re)loaded config's static replicas; returns the ids removed from the fleet.

        A static replica dropped from the config leaves the fleet unless its agent is connected
        (it then stays as an agent-registered replica)."""
        self._health = config.health
        self._block_sizes = {m.name: m.block_size for m in config.models}
        self._allow_registration = config.inventory.allow_registration
        wanted: dict[str, ReplicaConfig] = {r.id: r for r in config.replicas}
        removed: list[str] = []
        for rid, rec in list(self._records.items()):
            if rec.static and rid not in wanted:
                if rec.agent_connected:
                    rec.static = False
                else:
                    del self._records[rid]
                    self._index.remove_replica(rid)
                    removed.append(rid)
        for rid, rc in wanted.items():
            found = self._records.get(rid)
            if found is None:
                self._index.add_replica(rid)
                self._records[rid] = ReplicaRecord(
                    id=rid, url=rc.url, models=frozenset(rc.models), static=True
                )
                continue
            if found.url != rc.url:
                # a new address is a new process: unknown until checked
                found.checked = False
                found.healthy = False
            found.url = rc.url
            found.models = frozenset(rc.models)
            found.static = True
        return removed

    # ------------------------------------------------------------------ queries
    def get(self, replica: str) -> ReplicaRecord | None:
        return self._records.get(replica)

    def records(self) -> list[ReplicaRecord]:
        return list(self._records.values())

    def models(self) -> set[str]:
        """Models named by replicas (static ``models`` lists and agents' hellos)."""
        out: set[str] = set()
        for rec in self._records.values():
            out.update(rec.models)
        return out

    def any_healthy(self) -> bool:
        return any(rec.healthy for rec in self._records.values())

    def tokenize_url(self, model: str) -> str | None:
        """A healthy replica serving ``model``, to ask its ``/tokenize`` (``tokenizer: remote``)."""
        for rec in self._records.values():
            if rec.healthy and rec.serves(model):
                return rec.url
        return None

    def candidates(self, model: str) -> list[ReplicaRecord]:
        return [rec for rec in self._records.values() if rec.serves(model)]

    def snapshot(
        self,
        candidates: Iterable[ReplicaRecord],
        matched: Mapping[str, int],
        scores: Mapping[str, float],
        exclude: frozenset[str] = frozenset(),
    ) -> FleetSnapshot:
        return FleetSnapshot(
            tuple(
                ReplicaState(
                    id=rec.id,
                    healthy=rec.healthy and rec.id not in exclude,
                    in_flight_requests=rec.in_flight_requests + rec.remote_requests,
                    in_flight_tokens=rec.in_flight_tokens + rec.remote_tokens,
                    pending_prefill_tokens=rec.pending_prefill_tokens + rec.remote_prefill_tokens,
                    engine_running=rec.engine_running,
                    engine_waiting=rec.engine_waiting,
                    kv_usage=rec.kv_usage,
                    matched_blocks=matched.get(rec.id, 0),
                    match_score=scores.get(rec.id, 0.0),
                    held_blocks=self._index.held_count(rec.id),
                )
                for rec in candidates
            )
        )

    # ------------------------------------------------------------------ load
    @staticmethod
    def begin(record: ReplicaRecord, tokens: int, prefill: int) -> Flight:
        return Flight(record, tokens, prefill)

    # ------------------------------------------------------------------ health
    def _set_health(self, rec: ReplicaRecord, ok: bool, error: str = "") -> None:
        h: HealthConfig = self._health
        rec.checked = True
        if ok:
            rec.ok_streak += 1
            rec.fail_streak = 0
            if not rec.healthy and rec.ok_streak >= h.healthy_after:
                rec.healthy = True
                rec.unhealthy_since = None
                rec.last_error = ""
        else:
            rec.fail_streak += 1
            rec.ok_streak = 0
            rec.last_error = error
            if rec.healthy and rec.fail_streak >= h.unhealthy_after:
                rec.healthy = False
                rec.unhealthy_since = time.monotonic()

    def check_result(self, replica: str, ok: bool, error: str = "") -> None:
        """An active health check's outcome. The first result of a replica decides at once."""
        rec = self._records.get(replica)
        if rec is None:
            return
        if not rec.checked:
            rec.checked = True
            rec.healthy = ok
            rec.unhealthy_since = None if ok else time.monotonic()
            rec.ok_streak, rec.fail_streak = (1, 0) if ok else (0, 1)
            rec.last_error = error
            return
        self._set_health(rec, ok, error)

    def proxy_success(self, rec: ReplicaRecord) -> None:
        if rec.fail_streak:
            rec.fail_streak = 0

    def proxy_failure(self, rec: ReplicaRecord, error: str, connect: bool = False) -> None:
        rec.failures += 1
        if connect:
            # nothing listens there: eject now rather than after unhealthy_after more requests
            if rec.healthy:
                rec.unhealthy_since = time.monotonic()
            rec.healthy = False
            rec.ok_streak = 0
            rec.fail_streak = max(rec.fail_streak + 1, self._health.unhealthy_after)
            rec.last_error = error
            return
        self._set_health(rec, False, error)

    def key_block_size(self, models: Iterable[str]) -> int:
        """The block size the gateway keys the first of ``models`` it serves at (0: none); told
        to an agent in the Ack of its Hello, so that it re-keys a smaller engine page (W5a)."""
        return next((self._block_sizes[m] for m in models if m in self._block_sizes), 0)

    # ------------------------------------------------------------------ agents (FleetSink)
    def agent_hello(self, hello: AgentHello) -> str | None:
        """Accept an agent, registering its replica when the config does not list it. Refuses a
        block size that cannot serve a configured model (the gateway's block size must be a
        multiple of the engine's, ARCHITECTURE.md §3)."""
        models = frozenset(hello.models)
        for m in sorted(models):
            gw = self._block_sizes.get(m)
            if gw is not None and (hello.block_size <= 0 or gw % hello.block_size != 0):
                return (
                    f"replica {hello.replica_id!r}: engine block size {hello.block_size} does not "
                    f"divide the gateway's models[{m}].block_size={gw}"
                )
        rec = self._records.get(hello.replica_id)
        if rec is None:
            if not self._allow_registration:
                return (
                    f"replica {hello.replica_id!r} is not in the config (inventory.allow_registration is off)"
                )
            if not hello.url.startswith(("http://", "https://")):
                return f"replica {hello.replica_id!r}: hello url {hello.url!r} is not an http(s) URL"
            try:
                self._index.add_replica(hello.replica_id)
            except IndexBoundError as exc:
                return str(exc)
            rec = ReplicaRecord(id=hello.replica_id, url=hello.url.rstrip("/"), models=models, static=False)
            self._records[hello.replica_id] = rec
            # the agent runs beside a live engine; the active checks confirm or eject it
            rec.healthy = True
            rec.checked = True
        elif not rec.static:
            rec.url = hello.url.rstrip("/") or rec.url
            rec.models = models
        rec.block_size = hello.block_size
        rec.engine = f"{hello.engine} {hello.engine_version}".strip()
        return None

    def agent_load(self, replica_id: str, load: AgentLoad) -> None:
        rec = self._records.get(replica_id)
        if rec is None:
            return
        rec.engine_running = load.running
        rec.engine_waiting = load.waiting
        rec.kv_usage = load.kv_usage

    def agent_state(self, replica_id: str, *, connected: bool, degraded: bool) -> None:
        """The agent stream came or went. Without an agent the replica stays routable while its
        health checks pass, but its engine load is unknown from then on."""
        rec = self._records.get(replica_id)
        if rec is None:
            return
        rec.agent_connected = connected
        rec.index_degraded = degraded
        if not connected:
            rec.engine_running = rec.engine_waiting = 0
            rec.kv_usage = 0.0

    def forget_stale(self, now: float, after_s: float) -> list[str]:
        """Drop agent-registered replicas whose agent is gone and that have been unhealthy for
        ``after_s`` (pods replaced under new ids would otherwise fill the index's max_replicas).
        Returns the ids removed."""
        gone = [
            rec.id
            for rec in self._records.values()
            if not rec.static
            and not rec.agent_connected
            and not rec.shared_inventory  # another gateway instance still hears its agent
            and not rec.healthy
            and rec.unhealthy_since is not None
            and now - rec.unhealthy_since >= after_s
        ]
        for rid in gone:
            del self._records[rid]
            self._index.remove_replica(rid)
        return gone

    def has_agent(self, replica_id: str) -> bool:
        """An agent reports the replica's blocks: to this gateway, or to another one that shares
        them through Redis."""
        rec = self._records.get(replica_id)
        return rec is not None and (rec.agent_connected or rec.shared_inventory)

    # ------------------------------------------------------------------ shared state
    def apply_remote_load(self, loads: Mapping[str, RemoteLoad]) -> None:
        """The other gateway instances' summed load (absent replicas: none). Engine figures are
        taken only for replicas whose agent is not connected here (ours are fresher)."""
        for rec in self._records.values():
            load = loads.get(rec.id) or RemoteLoad(0, 0, 0)
            rec.remote_requests = load.requests
            rec.remote_tokens = load.tokens
            rec.remote_prefill_tokens = load.prefill
            if not rec.agent_connected:
                # without an agent anywhere the engine's load is unknown (as in agent_state)
                rec.engine_running, rec.engine_waiting, rec.kv_usage = load.engine or (0, 0, 0.0)

    def set_shared_inventory(self, replica_id: str, shared: bool) -> None:
        rec = self._records.get(replica_id)
        if rec is not None:
            rec.shared_inventory = shared
