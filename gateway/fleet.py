"""Fleet state: the replicas the gateway can route to, their health and their load
(docs/architecture.md, "Fleet").

Replicas come from the config (static) and from agents that say hello over the inventory stream
(or, for another gateway instance's agents, through the shared state). ``Fleet`` is the only
owner of the replica set: ``reconfigure``, ``agent_hello`` and ``forget_stale`` are the only
methods that add or remove replicas, and they add and remove them in the prefix index too (the
index refuses replicas it was not given).

A record's parts each have one writer (``gateway/replica_record.py``): identity, agent link and
engine/remote load are replaced here; the health state machine changes through its own methods,
called from here; in-flight load is written by ``placement.Flight`` only; audit statistics by
``AuditStats.record`` only. The TTFT model (``ttft``, a ``placement.TtftFeed``) is written only
by the flights it starts (``dispatch``): each first byte fits the replica's model; ``snapshot``
carries every replica's fitted model to the policy (``ReplicaState.ttft``). Its samples go to the
TTFT audit (``ttft_listener``, set by the metrics; ``ReplicaRecord.ttft_audit``).

Invariants
* Every method is synchronous and never awaits, so a mutation is atomic on the event loop.
* The index tracks exactly the fleet's replicas (every add and remove goes through both).
* ``snapshot`` returns an immutable ``FleetSnapshot``; policies never see the mutable records.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from functools import partial

from gateway.config import GatewayConfig, ReplicaConfig
from gateway.inventory_sink import AgentEngine, AgentHello, AgentLoad
from gateway.replica_identity import ReplicaIdentity
from gateway.replica_load import NO_REMOTE_LOAD, EngineLoad, RemoteLoad, combined_queue
from gateway.replica_record import ReplicaRecord
from router_policies import placement
from router_policies.placement import (
    Candidate,
    Dispatch,
    Flight,
    IndexAtDispatch,
    IndexView,
    TouchRule,
    TtftFeed,
    TtftSample,
)
from router_policies.policy import FleetSnapshot, RequestFeatures
from router_policies.prefix_index import IndexBoundError, MatchResult, PrefixIndex
from router_policies.ttft.model import TtftModel
from router_policies.ttft.params import DEFAULT_PRIOR, NAMED_PRIORS, TtftParams


def ttft_prior_of(config: GatewayConfig) -> TtftParams:
    """The TTFT model's cold-start prior: the one kv_aware's ``prior`` names (the policy and the
    model then start from the same model), else the default."""
    name = config.policy.params_for("kv_aware").get("prior")
    return NAMED_PRIORS.get(name, DEFAULT_PRIOR) if isinstance(name, str) else DEFAULT_PRIOR


__all__ = ["Fleet", "Flight", "RemoteLoad", "ReplicaRecord"]


class Fleet:
    def __init__(
        self, config: GatewayConfig, index: PrefixIndex, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._index = index
        self._clock = clock  # monotonic seconds: health transitions and speculative entries
        self._records: dict[str, ReplicaRecord] = {}
        self._health = config.health
        self._block_sizes: dict[str, int] = {m.name: m.block_size for m in config.models}
        self._lora_fallback: dict[str, str] = {m.name: m.lora_fallback for m in config.models}
        self._allow_registration = config.inventory.allow_registration
        # where held-prefix hints for a recovering agent go (the inventory server's held_prefix,
        # set by the app; docs/agent.md, "Recovery without replay")
        self.held_prefix_sink: Callable[[str, Sequence[int], Sequence[int]], bool] | None = None
        # extra listener of TTFT samples (the metrics); the replica's own audit is always fed
        self.ttft_listener: Callable[[TtftSample], None] | None = None
        self.ttft = self._new_ttft(ttft_prior_of(config))
        self.reconfigure(config)

    def _new_ttft(self, prior: TtftParams) -> TtftFeed:
        return TtftFeed(TtftModel(prior), self._clock, self._ttft_sample)

    def _ttft_sample(self, sample: TtftSample) -> None:
        rec = self._records.get(sample.replica)
        if rec is not None:
            rec.ttft_audit.record(sample.relative_error)
            rec.ttft_model = self.ttft.model.params(sample.replica)  # the fit (routed on if it predicts)
        if self.ttft_listener is not None:
            self.ttft_listener(sample)

    # ------------------------------------------------------------------ the replica set
    def _add(self, identity: ReplicaIdentity) -> ReplicaRecord:
        self._index.add_replica(identity.id)  # may raise IndexBoundError: nothing added then
        rec = self._records[identity.id] = ReplicaRecord(identity)
        self.ttft.adopt(identity.id, self._records)  # a joining replica starts from its peers' fit
        return rec

    def _remove(self, replica: str) -> None:
        del self._records[replica]
        self._index.remove_replica(replica)
        self.ttft.model.forget(replica)

    def reconfigure(self, config: GatewayConfig) -> list[str]:
        """Apply a (re)loaded config's static replicas; returns the ids removed from the fleet.

        A static replica dropped from the config leaves the fleet unless an agent reports it
        (here or through the shared state): it then stays as an agent-registered replica."""
        self._health = config.health
        self._block_sizes = {m.name: m.block_size for m in config.models}
        self._lora_fallback = {m.name: m.lora_fallback for m in config.models}
        self._allow_registration = config.inventory.allow_registration
        # the lifetime of speculative entries: a routed request's (touch) and a snapshot's dropped
        # ones (snapshot_keep), from the one config field
        self.touch_rule = TouchRule(config.proxy.speculative_ttl_s)
        prior = ttft_prior_of(config)
        if prior != self.ttft.model.prior(""):  # another prior: every fit restarts from it
            self.ttft = self._new_ttft(prior)
        wanted: dict[str, ReplicaConfig] = {r.id: r for r in config.replicas}
        removed: list[str] = []
        for rid, rec in list(self._records.items()):
            if rec.identity.static and rid not in wanted:
                if rec.link.reported:
                    rec.identity = dataclasses.replace(rec.identity, static=False)
                else:
                    self._remove(rid)
                    removed.append(rid)
        for rid, rc in wanted.items():
            found = self._records.get(rid)
            if found is None:
                self._add(ReplicaIdentity(id=rid, url=rc.url, models=frozenset(rc.models), static=True))
                continue
            if found.identity.url != rc.url:
                found.health.unknown()
            found.identity = dataclasses.replace(
                found.identity, url=rc.url, models=frozenset(rc.models), static=True
            )
        return removed

    def register_remote(self, hello: AgentHello) -> str | None:
        """A replica whose agent streams to another gateway instance, learnt from the shared state:
        registered with the same checks and record as an agent's Hello here (one path into the
        replica set); None, or why it is refused."""
        return self.agent_hello(hello)

    def agent_hello(self, hello: AgentHello) -> str | None:
        """Accept an agent, registering its replica when the config does not list it; returns
        why it is refused, or None. Refuses a block size that cannot serve a configured model
        (the gateway's block size must be a multiple of the engine's, docs/architecture.md)."""
        models = frozenset(hello.models)
        for m in sorted(models):
            gw = self._block_sizes.get(m)
            if gw is not None and (hello.block_size <= 0 or gw % hello.block_size != 0):
                return (
                    f"replica {hello.replica_id!r}: engine block size {hello.block_size} does not "
                    f"divide the gateway's models[{m}].block_size={gw}"
                )
        rec = self._records.get(hello.replica_id)
        url = hello.url.rstrip("/")
        if rec is None:
            if not self._allow_registration:
                return (
                    f"replica {hello.replica_id!r} is not in the config (inventory.allow_registration is off)"
                )
            if not hello.url.startswith(("http://", "https://")):
                return f"replica {hello.replica_id!r}: hello url {hello.url!r} is not an http(s) URL"
            try:
                rec = self._add(ReplicaIdentity(id=hello.replica_id, url=url, models=models, static=False))
            except IndexBoundError as exc:
                return str(exc)
            rec.health.assume_healthy()
        elif not rec.identity.static:
            rec.identity = dataclasses.replace(rec.identity, url=url or rec.identity.url, models=models)
        rec.identity = dataclasses.replace(
            rec.identity,
            block_size=hello.block_size,
            engine=f"{hello.engine} {hello.engine_version}".strip(),
        )
        # the engine's KV cache, as its agent read it: the TTFT model's KV-demand term
        self.ttft.set_kv_capacity(hello.replica_id, hello.capacity_blocks * hello.block_size)
        return None

    def forget_stale(self, now: float, after_s: float) -> list[str]:
        """Drop agent-registered replicas whose agent is gone and that have been unhealthy for
        ``after_s`` (pods replaced under new ids would otherwise fill the index's max_replicas).
        Returns the ids removed."""
        gone = [
            rec.id
            for rec in self._records.values()
            if not rec.identity.static
            and not rec.link.reported  # shared: another gateway instance still hears its agent
            and not rec.health.healthy
            and rec.health.unhealthy_since is not None
            and now - rec.health.unhealthy_since >= after_s
        ]
        for rid in gone:
            self._remove(rid)
        return gone

    # ------------------------------------------------------------------ queries
    def get(self, replica: str) -> ReplicaRecord | None:
        return self._records.get(replica)

    def records(self) -> list[ReplicaRecord]:
        return list(self._records.values())

    def models(self) -> set[str]:
        """Models named by replicas (static ``models`` lists and agents' hellos)."""
        out: set[str] = set()
        for rec in self._records.values():
            out.update(rec.identity.models)
        return out

    def any_healthy(self) -> bool:
        return any(rec.health.healthy for rec in self._records.values())

    def tokenize_url(self, model: str) -> str | None:
        """A healthy replica serving ``model``, to ask its ``/tokenize`` (``tokenizer: remote``)."""
        for rec in self._records.values():
            if rec.health.healthy and rec.serves(model):
                return rec.identity.url
        return None

    def candidates(
        self, model: str, lora: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> list[ReplicaRecord]:
        """The replicas a request for ``model`` (and adapter ``lora``) may go to. With an adapter:
        those whose engine reported it loaded, while one of them is healthy and not in
        ``exclude``; otherwise the model's ``lora_fallback``: every replica of the model
        ('any') or none ('none')."""
        serving = [rec for rec in self._records.values() if rec.serves(model)]
        if lora is None:
            return serving
        holding = [rec for rec in serving if rec.identity.has_adapter(lora)]
        if any(rec.health.healthy and rec.id not in exclude for rec in holding):
            return holding
        return serving if self._lora_fallback.get(model, "any") == "any" else holding

    def snapshot(
        self,
        candidates: Iterable[ReplicaRecord],
        request: RequestFeatures,
        match: MatchResult,
        exclude: frozenset[str] = frozenset(),
    ) -> FleetSnapshot:
        now = self._clock()
        candidates = self._with_remote_now(candidates)
        r = request
        view = IndexView(match.blocks, match.scores, self._index, r.block_keys, r.block_size, r.prompt_tokens)
        return placement.snapshot(
            (
                Candidate(
                    rec.id,
                    rec.health.healthy,
                    rec.load(),
                    *combined_queue(rec.flights, rec.remote, now),
                    rec.flights.prompt_keys(),
                    rec.flights.unproduced_tokens(now),
                    partial(rec.flights.room_schedule, now),
                )
                for rec in candidates
            ),
            view,
            exclude,
            self.ttft.params,
        )

    def has_agent(self, replica_id: str) -> bool:
        """An agent reports the replica's blocks: to this gateway, or to another one that shares
        them through Redis."""
        rec = self._records.get(replica_id)
        return rec is not None and rec.link.reported

    # ------------------------------------------------------------------ placement
    @staticmethod
    def begin(record: ReplicaRecord, tokens: int, prefill: int) -> Flight:
        """A flight on ``record``: ``tokens`` in flight until ``end``, ``prefill`` (see
        ``placement.uncached_prompt_tokens``) pending until ``first_byte``."""
        return Flight(record.flights, tokens, prefill)

    def dispatch(self, record: ReplicaRecord, dispatch: Dispatch, start: float | None = None) -> Flight:
        """The flight of an attempt routed to ``record`` (``Dispatch``: the replica as the
        decision saw it, the prompt, the predicted cached tokens), started at ``start`` on the
        clock (default: now; the proxy gives the time its request was written): load as
        ``begin`` counts it, and the TTFT model fitted by its first byte (``Flight.first_byte()``)."""
        flight = self.ttft.flight(record.flights, dispatch, start)
        blocks = dispatch.cached_tokens // dispatch.block_size if dispatch.block_size else 0
        evicted = dispatch.state.evicted_blocks
        flight.at_dispatch = IndexAtDispatch.of(self._index, record.id, dispatch.keys, (blocks, evicted))
        return flight

    def _with_remote_now(self, candidates: Iterable[ReplicaRecord]) -> Iterable[ReplicaRecord]:
        """A decision's candidates, ``remote`` as fresh as known (a worker's: ``WorkerFleet``)."""
        return candidates

    def decision_turn(self) -> Awaitable[None] | None:
        """What to await before a decision: None (decide at once), but in a worker of several,
        the wait until no other worker is deciding (gateway/workers_shared_load.py). Awaited by
        the proxy before ``Router.decide``, never inside a mutation of the fleet or the index."""
        return None

    def flights_changed(self, record: ReplicaRecord, adding: Dispatch | None = None) -> None:
        """A flight on ``record`` reached its first byte or ended, or (``adding``) an attempt was
        decided for it, its flight not open yet: a worker of several publishes it."""

    @property
    def index(self) -> PrefixIndex:
        """The prefix index (read by the prediction audit)."""
        return self._index

    def touch(self, replica: str, keys: Sequence[int]) -> tuple[Sequence[int], float] | None:
        """The speculative index entries of a request routed to ``replica`` with ``keys``, with
        the placement rule's lifetime (``touch_rule``): (the keys entered, their lifetime) when
        the index was touched, else None (a worker relays what was touched to the others)."""
        if replica not in self._records:
            return None  # left the fleet since (a deferred encode finishing late)
        lifetime = self.touch_rule.lifetime_s(self._index, self.has_agent(replica))
        keys = placement.speculative_keys(keys, self._index.is_hybrid(replica))
        if not placement.speculative_touch(self._index, replica, keys, self._clock(), lifetime):
            return None
        return keys, lifetime

    def snapshot_keep(self) -> tuple[float, float]:
        """(now, lifetime_s) for the precise entries a snapshot drops, kept as speculative ones
        with the lifetime of a routed request's on a replica with an agent: an agent restarted
        beside a busy engine (its replay no longer reaching back) knows less than the engine still
        holds, and routing on what the gateway knew keeps that traffic there, where the engine
        hits and the held-prefix hints heal the agent (docs/agent.md, "Recovery without
        replay"). Blocks the engine did evict stop drawing traffic within that lifetime."""
        return self._clock(), self.touch_rule.lifetime_s(self._index, True)

    # ------------------------------------------------------------------ health
    def check_result(self, replica: str, ok: bool, error: str = "") -> None:
        """An active health check's outcome. The first result of a replica decides at once."""
        rec = self._records.get(replica)
        if rec is not None:
            rec.health.check_result(ok, error, self._health, self._clock())

    def proxy_success(self, rec: ReplicaRecord) -> None:
        rec.health.proxy_success()

    def proxy_failure(self, rec: ReplicaRecord, error: str, connect: bool = False) -> None:
        rec.health.proxy_failure(error, connect, self._health, self._clock())

    def key_block_size(self, models: Iterable[str]) -> int:
        """The block size the gateway keys the first of ``models`` it serves at (0: none); told
        to an agent in the Ack of its Hello, so that it re-keys a smaller engine page (W5a)."""
        return next((self._block_sizes[m] for m in models if m in self._block_sizes), 0)

    # ------------------------------------------------------------------ agents (FleetSink)
    def agent_load(self, replica_id: str, load: AgentLoad) -> None:
        rec = self._records.get(replica_id)
        if rec is not None:
            rec.engine_load = EngineLoad(load.running, load.waiting, load.kv_usage)

    def agent_engine(self, replica_id: str, engine: AgentEngine) -> None:
        """The agent's EngineState. A replica turning hybrid drops its speculative entries: they
        were recorded as whole prompts, which a hybrid engine does not keep reusable."""
        rec = self._records.get(replica_id)
        if rec is None:
            return
        if engine.hybrid != self._index.is_hybrid(replica_id):
            self._index.set_hybrid(replica_id, engine.hybrid)
            self._index.clear_approximate(replica_id)
        adapters = engine.lora_adapters if engine.adapters_known else None
        rec.identity = dataclasses.replace(rec.identity, hybrid=engine.hybrid, adapters=adapters)

    def agent_state(self, replica_id: str, *, connected: bool, degraded: bool) -> None:
        """The agent stream came or went. Without an agent the replica stays routable while its
        health checks pass, but its engine load is unknown from then on."""
        rec = self._records.get(replica_id)
        if rec is None:
            return
        rec.link = dataclasses.replace(rec.link, connected=connected, degraded=degraded)
        if not connected:
            rec.engine_load = EngineLoad()

    # ------------------------------------------------------------------ shared state
    def now(self) -> float:
        """The fleet's clock (monotonic seconds): the one flights start on."""
        return self._clock()

    def apply_remote_load(self, loads: Mapping[str, RemoteLoad]) -> None:
        """The other gateway instances' summed load (absent replicas: none). Engine figures are
        taken only for replicas whose agent is not connected here (ours are fresher)."""
        for rec in self._records.values():
            load = loads.get(rec.id) or NO_REMOTE_LOAD
            rec.remote = load
            if not rec.link.connected:
                # without an agent anywhere the engine's load is unknown (as in agent_state)
                rec.engine_load = EngineLoad(*load.engine) if load.engine else EngineLoad()

    def set_shared_inventory(self, replica_id: str, shared: bool) -> None:
        rec = self._records.get(replica_id)
        if rec is not None:
            rec.link = dataclasses.replace(rec.link, shared=shared)
