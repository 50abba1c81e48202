"""The operator view: what the cache is worth and how long it keeps things (docs/operators.md;
docs/architecture.md, "Operator view").

``OperatorView`` owns four parts, each the one writer of its state, all on the event loop:
the trace recorder (``TraceRecorder``), the savings ledger (``SavingsLedger``), the block
lifetimes (``CacheLifetime``, an inventory observer) and the session turns (``SessionTurns``).
It is told of every answered request by ``Upstream`` (``answered``: the ``OutcomeSink`` hook) and
of every inventory change by the inventory stream (through ``ObserverFanout``); it never changes
a routing decision, the index or the fleet.

HTTP (behind the admin token): ``GET /admin/report`` (JSON), ``GET /admin/trace`` and
``POST /admin/trace {"enabled": true|false}`` (start or stop recording to ``operator.trace.path``;
a client cannot choose the file). Metrics are read from the parts at scrape time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.asyncio_tasks import cancel_and_wait
from gateway.cache_lifetime import CacheLifetime
from gateway.features.deferred_job import DeferredJob
from gateway.inventory_ops import Op
from gateway.inventory_sink import AgentHello
from gateway.inventory_stream import InventoryObserver
from gateway.openai_errors import error_response
from gateway.operator_config import OperatorConfig
from gateway.request_context import Attempt
from gateway.request_outcome import Outcome, Usage, outcome_of
from gateway.savings import SavingsLedger
from gateway.session_turns import SessionTurns
from gateway.trace_recorder import TraceRecorder

log = logging.getLogger("kvgate.operator")

FLUSH_INTERVAL_S = 1.0
MAX_DEFERRED = 4096
RECENT_DECISIONS = 50
MAX_SCORES = 8  # per recent decision: the best-scored replicas
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ObserverFanout:
    """Several inventory observers told in turn (the shared-state publisher, the lifetimes)."""

    def __init__(self, observers: Sequence[InventoryObserver]) -> None:
        self._observers = tuple(observers)

    def inventory_hello(self, hello: AgentHello) -> None:
        for o in self._observers:
            o.inventory_hello(hello)

    def inventory_snapshot(self, replica: str, entries: Mapping[int, str]) -> None:
        for o in self._observers:
            o.inventory_snapshot(replica, entries)

    def inventory_ops(self, replica: str, ops: Sequence[Op]) -> None:
        for o in self._observers:
            o.inventory_ops(replica, ops)


def with_observer(current: InventoryObserver | None, added: InventoryObserver) -> InventoryObserver:
    return added if current is None else ObserverFanout([current, added])


class OperatorView:
    def __init__(
        self,
        cfg: OperatorConfig,
        registry: CollectorRegistry | None = None,
        fleet_replicas: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self.cfg = cfg
        self.recorder = TraceRecorder(cfg.trace)
        self.ledger = SavingsLedger(cfg)
        self.lifetime = CacheLifetime(cfg.lifetime.max_tracked_blocks)
        self.turns = SessionTurns(self.lifetime, cfg.lifetime.session_bytes, fleet_replicas)
        self.started = time.time()
        self._flusher: asyncio.Task[None] | None = None
        self.decisions: deque[dict[str, Any]] = deque(maxlen=RECENT_DECISIONS)
        self.failures = 0  # answered requests the view failed to record (logged)
        # deferred encodes: answered requests waiting for their keys, and keys that came first
        self._awaiting: OrderedDict[DeferredJob, Outcome] = OrderedDict()
        self._early_keys: OrderedDict[DeferredJob, list[int]] = OrderedDict()
        if registry is not None:
            registry.register(_OperatorCollector(self))

    # ------------------------------------------------------------------ hooks
    def answered(self, a: Attempt, use: Usage | None) -> None:
        """The ``OutcomeSink`` hook: one request answered with 200. Runs before the response's
        end is written, so nothing it raises may reach the request: a failure (a full disk under
        the trace) is logged and counted, and the answer goes out whole."""
        self._guarded(self._answered, a, use)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            self.failures += 1
            log.exception("operator view: recording an answered request failed")

    def _answered(self, a: Attempt, use: Usage | None) -> None:
        o = outcome_of(a, use, self.cfg.tenant_header)
        self.ledger.record(o)
        self.decisions.append(_decision(a, o))
        job = a.info.deferred
        if job is None or a.info.approximate:
            self._keyed(o)
        else:
            self._deferred_answered(job, o)

    def _deferred_answered(self, job: DeferredJob, o: Outcome) -> None:
        """Encoded after routing: the keys come through the job's on_keys, before or after the
        answer. A job already over with no keys delivered (dropped from the backlog, or encoded
        before this attempt could listen) will deliver none: the request is recorded without
        them at once, and the job is not held."""
        keys = self._early_keys.pop(job, None)
        if keys is not None:
            self._keyed(_with_keys(o, keys))
        elif job.finished.is_set():
            self._keyed(o)
        else:
            _bounded_put(self._awaiting, job, o)

    def deferred(self, a: Attempt) -> None:
        """The ``OutcomeSink`` hook: wrap the job's ``on_keys`` (set by the proxy for this
        attempt) so the keys also reach the answered request they belong to."""
        job = a.info.deferred
        assert job is not None and not job.finished.is_set()  # the proxy calls it only then
        inner = job.on_keys

        def on_keys(keys: list[int]) -> None:
            if inner is not None:
                inner(keys)
            o = self._awaiting.pop(job, None)
            if o is not None:
                self._guarded(self._keyed, _with_keys(o, keys))
            else:
                _bounded_put(self._early_keys, job, keys)

        job.on_keys = on_keys

    def _keyed(self, o: Outcome) -> None:
        """The request with its exact block keys (or none when its features were approximate)."""
        self.recorder.add(o)
        if o.block_keys:
            self.lifetime.note_depths(o.block_keys)
        self.turns.turn(o, self.ledger.tenant(o.tenant))

    def reconfigure(self, cfg: OperatorConfig) -> None:
        """A reload: prices, the tenant bound and the tenant header apply at once; trace and
        lifetime bounds at the next start of a recording, or a restart."""
        self.cfg = cfg
        self.ledger.cfg = cfg

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.cfg.trace.enabled:
            self.recorder.start()
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="kvgate-trace-flush")

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self._guarded(self.recorder.flush)

    async def stop(self) -> None:
        flusher, self._flusher = self._flusher, None
        await cancel_and_wait(flusher)
        self.recorder.stop()

    # ------------------------------------------------------------------ HTTP
    def routes(self, guard: Callable[[Handler], Handler]) -> list[web.RouteDef]:
        return [
            web.get("/admin/report", guard(self.report_endpoint)),
            web.get("/admin/trace", guard(self.trace_status)),
            web.post("/admin/trace", guard(self.trace_toggle)),
        ]

    def report(self) -> dict[str, Any]:
        rows = self.ledger.rows()
        return {
            "generated_at": time.time(),
            "since": self.started,
            "savings": {
                "rows": rows,
                "totals": self.ledger.totals(rows),
                "prefill_s_per_token": self.ledger.prefill_s_per_token(),
                "by_replica": self.ledger.by_replica(),
                "gpus_per_replica": self.cfg.gpus_per_replica,
            },
            "cache_lifetime": self.lifetime.report(),
            "turns": self.turns.report(),
            "trace": self.recorder.status(),
            "recent_decisions": list(self.decisions),
            "failures": self.failures,
        }

    async def report_endpoint(self, _request: web.Request) -> web.StreamResponse:
        return _json(self.report())

    async def trace_status(self, _request: web.Request) -> web.StreamResponse:
        return _json(self.recorder.status())

    async def trace_toggle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            return error_response(400, 'the body must be JSON: {"enabled": true|false}')
        enabled = body.get("enabled") if isinstance(body, dict) else None
        if not isinstance(enabled, bool):
            return error_response(400, "'enabled' must be true or false", param="enabled")
        if enabled:
            if not self.cfg.trace.path:
                return error_response(
                    409, "no trace file configured (operator.trace.path)", code="no_trace_path"
                )
            try:
                self.recorder.start()
            except OSError as exc:
                return error_response(500, f"cannot open the trace file: {exc.strerror or exc}")
        else:
            self.recorder.stop()
        return _json(self.recorder.status())


def _decision(a: Attempt, o: Outcome) -> dict[str, Any]:
    """A recent decision as the status page shows it (its explain: reason, match and scores)."""
    d = a.choice.decision
    best = sorted(d.scores.items(), key=lambda kv: -kv[1])[:MAX_SCORES]
    return {
        "at": time.time(),
        "model": o.model,
        "tenant": o.tenant,
        "replica": o.replica,
        "reason": d.reason,
        "matched_blocks": d.matched_blocks,
        "prompt_tokens": o.prompt_tokens,
        "predicted_cached_tokens": o.predicted_tokens,
        "engine_cached_tokens": o.cached_tokens,
        "ttft_ms": round(o.ttft_s * 1000, 3) if o.ttft_s is not None else None,
        "scores": {rid: round(float(s), 4) for rid, s in best},
    }


def _with_keys(o: Outcome, keys: list[int]) -> Outcome:
    # the engine's prompt count when it reported usage: the keys cover the exact prompt
    return dataclasses.replace(o, block_keys=tuple(keys), gateway_prompt_tokens=o.prompt_tokens)


def _bounded_put(d: OrderedDict[DeferredJob, Any], job: DeferredJob, value: Any) -> None:
    """Keep at most ``MAX_DEFERRED`` entries (a job dropped from the encode backlog never
    reports keys; its request goes unrecorded)."""
    d[job] = value
    while len(d) > MAX_DEFERRED:
        d.popitem(last=False)


def _json(doc: Any) -> web.Response:
    return web.Response(body=orjson.dumps(doc), content_type="application/json")


class _OperatorCollector(Collector):
    """The operator view's metrics, read when Prometheus scrapes."""

    def __init__(self, view: OperatorView) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        v = self._view
        rows = v.ledger.rows()
        fams = {
            "prompt_tokens": (
                "kvgate_savings_prompt_tokens",
                "Engine-counted prompt tokens of answered requests.",
            ),
            "saved_prefill_tokens": (
                "kvgate_savings_cached_tokens",
                "Prompt tokens the engines served from cache.",
            ),
            "saved_engine_s": ("kvgate_savings_engine_seconds", "Prefill engine time saved by cache hits."),
            "saved_gpu_s": ("kvgate_savings_gpu_seconds", "GPU-seconds saved by cache hits."),
            "saved_usd": ("kvgate_savings_usd", "Money saved by cache hits at the configured prices (USD)."),
        }
        for field, (name, doc) in fams.items():
            c = CounterMetricFamily(name, doc, labels=["tenant", "model"])
            for r in rows:
                if r[field] is not None:
                    c.add_metric([r["tenant"], r["model"]], float(r[field]))
            yield c
        g = GaugeMetricFamily(
            "kvgate_replica_prefill_seconds_per_token",
            "Measured prefill time per computed prompt token (slope of TTFT on uncached tokens).",
            labels=["replica"],
        )
        for rid, spt in v.ledger.prefill_s_per_token().items():
            if spt is not None:
                g.add_metric([rid], spt)
        yield g
        yield from self._lifetimes()
        yield from self._turns()
        t = CounterMetricFamily("kvgate_trace_lines", "Lines written to the recorded trace.")
        t.add_metric([], v.recorder.stats.lines)
        yield t
        e = GaugeMetricFamily("kvgate_trace_recording", "1 while the gateway records its traffic.")
        e.add_metric([], 1.0 if v.recorder.enabled else 0.0)
        yield e

    def _lifetimes(self) -> Iterator[Metric]:
        lt = self._view.lifetime
        families = (
            ("kvgate_cache_block_residency_seconds",
             "How long blocks lived in a replica's cache (store to remove, from engine events).",
             "replica", lt.residency),
            ("kvgate_cache_block_residency_by_depth_seconds",
             "Block residency by the block's position in the prompts (blocks).", "depth", lt.by_depth),
        )  # fmt: skip
        for name, doc, label, hists in families:
            fam = HistogramMetricFamily(name, doc, labels=[label])
            for value, hist in sorted(hists.items()):
                hist.add_to(fam, [value])
            yield fam

    def _turns(self) -> Iterator[Metric]:
        turns = self._view.turns
        gap = HistogramMetricFamily(
            "kvgate_session_turn_gap_seconds", "Time from a session's answered turn to its next turn."
        )
        turns.gaps.add_to(gap, [])
        yield gap
        c = CounterMetricFamily(
            "kvgate_returning_turns",
            "Returning session turns by the state of their reusable prefix at arrival.",
            labels=["tenant", "prefix"],
        )
        m = CounterMetricFamily(
            "kvgate_returning_turns_engine_missed",
            "Returning turns whose engine-reported cached tokens fell short of the reusable prefix.",
            labels=["tenant"],
        )
        for tenant, tc in sorted(turns.by_tenant.items()):
            for state, n in (("alive", tc.alive), ("evicted", tc.evicted), ("unknown", tc.unknown),
                             ("none", tc.no_prefix)):  # fmt: skip
                c.add_metric([tenant, state], n)
            m.add_metric([tenant], tc.engine_missed)
        yield c
        yield m
