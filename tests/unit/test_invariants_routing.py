"""The stated invariants of the request path's modules (routing, proxy, request_context,
request_outcome, health, openai_errors, replica_audit), the metrics and documents.py that no other
test enforced, or only in part, over seeded random operation sequences where they are about
sequences; each test quotes the module that states its invariant; those found false are
``xfail(strict)`` (tests/unit/test_invariants_observability.py: the same for the operator view)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
from collections import Counter as Tally
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest

from gateway import proxy as proxy_module
from gateway.access_log import AccessLog
from gateway.config import GatewayConfig, HealthConfig, parse_config
from gateway.documents import read_document
from gateway.fleet import Fleet
from gateway.health import HealthChecker
from gateway.metric_specs import Metric, MetricSet
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import RequestError, openai_errors_middleware
from gateway.proxy import Proxy, ProxyParts
from gateway.replica_audit import TTFT_WINDOW, TtftAuditStats
from gateway.request import request_of
from gateway.request_context import Attempt, RequestContext
from gateway.request_outcome import Usage, outcome_of, usage_of
from gateway.routing import Router, RoutingState, Speculation
from gateway.upstream import Retry, Upstream
from router_policies.flights import Dispatch
from router_policies.policy import RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.registry import build_policy
from tests.polling import until
from tests.unit.test_documents import Failed
from tests.unit.test_invariants_gateway_state import test_index_mutations_never_await as _no_coroutines
from tests.unit.test_invariants_observability import _attempt
from tests.unit.test_invariants_relay import _ClientWriter, _ScriptedClient
from tests.unit.test_request_path import _feats, _setup

SEEDS = [0, 1, 2]
_NO_TRACING: Any = SimpleNamespace(tracer=None)
_NO_FEATURIZER: Any = None  # ``Proxy._features`` is the test's


def _config(replicas: int, retries: int = 2) -> GatewayConfig:
    replica_list = [{"id": f"r{i}", "url": f"http://r{i}:1"} for i in range(replicas)]
    return parse_config({"models": [{"name": "m", "block_size": 16}], "replicas": replica_list,
                         "proxy": {"retries": retries}, "health": {"interval_s": 0.01, "timeout_s": 0.5}})  # fmt: skip


@pytest.mark.parametrize("seed", SEEDS)
def test_a_speculation_keeps_its_longest_chain_and_its_undo_spares_the_held_blocks(seed: int) -> None:
    """routing.py, ``Speculation``: ``keys`` is "the longest key chain recorded"; ``held_blocks``,
    "leading blocks the replica held before: never undone"; ``record`` does "nothing once
    undone"."""
    rng = random.Random(seed)
    router, index, state = _setup()
    for trial in range(20):
        n, prompt = rng.randint(1, 8), [trial * 100 + i for i in range(20)]
        held = rng.randint(0, n)
        index.store("a", prompt[:held])
        feats = _feats(*prompt[:n])
        choice = router.decide(state, feats, router.match(feats), exclude=frozenset({"b"}))
        assert choice.state.matched_blocks == held
        spec, longest = router.commit(state, feats, choice), prompt[:n]
        for _ in range(rng.randint(0, 4)):  # deferred encodes' keys, longer or shorter
            keys = prompt[: rng.randint(1, 20)]
            router.record(spec, keys)
            longest = max(longest, keys, key=len)
            assert list(spec.keys) == longest
            assert set(index.approximate_keys("a")) >= set(keys[held:])
        router.undo(spec)
        router.record(spec, prompt)
        assert not set(index.approximate_keys("a")) & set(prompt)
        assert set(index.precise_keys("a")) >= set(prompt[:held])


def test_routing_is_synchronous() -> None:
    """routing.py: "Everything here is synchronous: the index and fleet are mutated without an
    await in between, so each decision is atomic on the event loop"."""
    _no_coroutines("routing")


class _States:
    """The app's routing state, replaced by a reload after every read."""

    def __init__(self, states: list[RoutingState]) -> None:
        self.states, self.reads = states, list[RoutingState]()

    def __call__(self) -> RoutingState:
        self.reads.append(self.states[len(self.reads) % 2])
        return self.reads[-1]


async def _one_request(rng: random.Random, states: _States, answer_at: int) -> tuple[int, list[Any]]:
    """A request through ``Proxy._handle`` whose attempts before ``answer_at`` fail with a
    ``Retry``: the answer's status and the attempts (replica, may_retry, context)."""
    fleet = Fleet(states.states[0].config, index := PrefixIndex())
    for rec in fleet.records():
        fleet.check_result(rec.id, True)
    metrics = GatewayMetrics(CollectorRegistry(), index, fleet, dict)
    unused: Any = None  # the session and client: ``_attempt`` is the test's
    parts = ProxyParts(Router(index, fleet), fleet, unused, unused, metrics, _NO_TRACING, AccessLog())
    proxy = Proxy(states, parts)
    tried: list[Any] = []

    async def features(_ctx: RequestContext) -> tuple[RequestFeatures, Any]:
        return RequestFeatures("m", [rng.randrange(99)], 20, 16), SimpleNamespace(approximate=False)

    async def attempt(ctx: RequestContext, _f: Any, _i: Any, choice: Any, may_retry: bool) -> web.Response:
        tried.append((choice.record.id, may_retry, ctx))
        assert ctx.log["replica"] == choice.record.id  # this attempt's decision overwrote the last
        if len(tried) <= answer_at:
            raise Retry("503", f"{choice.record.id}: 503")
        return web.Response(text="ok")

    proxy._features, proxy._attempt = features, attempt  # type: ignore[method-assign,assignment]
    resp = await proxy._handle(make_mocked_request("POST", "/v1/completions"), "completions")
    return resp.status, tried


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_request_is_retried_at_most_proxy_retries_times_on_replicas_not_tried(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """proxy.py: a failure before the first byte "is retried on the next-best replica (the policy
    decides again without the replicas already tried [...]), at most ``proxy.retries`` times";
    the state is "read once: a reload never mixes two configs in one request"; request_context.py,
    ``annotate``: "a retry's overwrites the first"."""

    async def body(*_args: Any) -> bytes:
        return b'{"model": "m", "prompt": "x"}'

    monkeypatch.setattr(proxy_module, "read_body", body)
    rng = random.Random(seed)
    for _ in range(15):
        n, retries = rng.randint(1, 5), rng.sample(range(6), 2)
        policies = [build_policy("round_robin", {}, seed=0) for _ in retries]
        states = _States(
            [RoutingState(_config(n, r), p, _NO_FEATURIZER) for r, p in zip(retries, policies, strict=True)]
        )
        answer_at = rng.randint(0, 6)
        status, tried = await _one_request(rng, states, answer_at)
        assert len(states.reads) == 2  # the proxy's start, then the request's one read
        retries_now = states.reads[1].config.proxy.retries
        want = min(retries_now + 1, n, answer_at + 1)
        assert len(tried) == want == len({replica for replica, _, _ in tried})
        assert [may_retry for _, may_retry, _ in tried] == [i < retries_now for i in range(want)]
        assert all(ctx.state is states.reads[1] for _, _, ctx in tried)
        assert status == (200 if answer_at < want else 502)
        log = tried[-1][2].log
        assert (log["replica"], log.get("retries", 0)) == (tried[-1][0], min(answer_at, want))


def test_usage_and_the_outcome_fall_back_only_for_what_the_engine_left_out() -> None:
    """request_outcome.py: ``usage_of`` is None for "no usage block, or none of its counts" (a
    bool or a negative is no count); the outcome's prompt is "the engine's count when it reported
    usage, else the gateway's", its completion "the engine's count, else the request's
    max_tokens", its cached tokens "None when the answer carried no usage", its block keys "empty
    when the features were approximate"."""
    assert usage_of({"usage": {}}) is None and usage_of({"choices": []}) is None
    assert usage_of({"usage": {"prompt_tokens": True, "completion_tokens": -1}}) is None
    details = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": False}}
    assert usage_of({"usage": details}) == Usage(5, None, None) and Usage(5, None, None).cached_tokens == 0
    a = _attempt(random.Random(0), "t")
    for use in (None, Usage(100, 7, 32), Usage(None, 7, None), Usage(90, None, 0)):
        for exact in (True, False):
            a.info.exact = exact
            o = outcome_of(a, use, "x-t")
            engine = (None, None) if use is None else (use.prompt_tokens, use.completion_tokens)
            assert (o.prompt_tokens, o.completion_tokens) == (engine[0] or 64, engine[1] or 4)
            assert o.cached_tokens == (None if use is None else use.cached_tokens)
            assert o.gateway_prompt_tokens == 64 and o.block_keys == ((1, 2, 3, 4) if exact else ())


class _Sink(_ClientWriter):
    """The client's writer (noting when the answer's end is written) and the operator view's
    ``OutcomeSink`` (noting, per ``answered``, whether that end was out)."""

    def __init__(self) -> None:
        self.ended, self.calls = False, list[bool]()

    async def write_eof(self, *_args: Any) -> None:
        self.ended = True

    def answered(self, *_args: Any) -> None:
        self.calls.append(self.ended)

    def deferred(self, *_args: Any) -> None:
        raise AssertionError("no deferred encode here")


async def _answered_calls(hows: list[str]) -> dict[str, list[bool]]:
    """Per scripted upstream answer (tests/unit/test_invariants_relay.py), the sink's calls."""
    router, index, state = _setup()
    fleet = router._fleet
    client = _ScriptedClient()
    upstream = Upstream(client, fleet, GatewayMetrics(CollectorRegistry(), index, fleet, dict))  # type: ignore[arg-type]
    features = RequestFeatures("m", [], 64, 16)
    choice = router.decide(state, features, router.match(features))
    dispatch = Dispatch.of(choice.state, features, choice.predicted_tokens, 1)
    info = SimpleNamespace(approximate=False, deferred_chars=0, deferred=None)
    out: dict[str, list[bool]] = {}
    for how in hows:
        client.how = how
        upstream.outcomes = sink = _Sink()
        ctx = RequestContext(make_mocked_request("POST", "/v1/completions", writer=sink), state, None)
        body = {"model": "m", "prompt": "x", "max_tokens": 1, "stream": how.startswith("sse")}
        ctx.parsed = request_of("completions", body, raw=b"{}")
        a = Attempt(ctx, features, info, choice, dispatch, Speculation(choice.record.id, 0), False)  # type: ignore[arg-type]
        with contextlib.suppress(Retry, RequestError):
            await upstream.send(a, upstream.start(ctx, choice.record))
        out[how] = sink.calls
    await upstream.stop()
    return out


async def test_an_answer_is_told_to_the_sink_once_and_before_its_end_is_written() -> None:
    """request_outcome.py: ``answered`` "once per request the engine answered with 200";
    operator_view.py: it "runs before the response's end is written, so nothing it raises may
    reach the request" (a 503, a failure before the first byte or mid-stream: not answered)."""
    calls = await _answered_calls(["json", "sse", "503", "fail_first", "sse_fail", "json"])
    assert calls == {"json": [False], "sse": [False], "503": [], "fail_first": [], "sse_fail": []}


class _HealthSession:
    """``aiohttp.ClientSession.get`` for ``/health``: each check answers 200 once every check of
    its round has started (a round checking one replica after another fails), noting its url and
    timeout."""

    def __init__(self, replicas: int) -> None:
        self.n, self.asked = replicas, list[tuple[str, float | None]]()
        self.rounds: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)

    def get(self, url: str, timeout: aiohttp.ClientTimeout) -> contextlib.AbstractAsyncContextManager[Any]:
        self.asked.append((url, timeout.total))
        return self._answer()

    @contextlib.asynccontextmanager
    async def _answer(self) -> AsyncIterator[Any]:
        started = self.rounds[(len(self.asked) - 1) // self.n]
        if len(self.asked) % self.n == 0:
            started.set()
        try:
            await asyncio.wait_for(started.wait(), 1.0)
        except TimeoutError:
            raise AssertionError("a round's checks did not run concurrently") from None
        yield SimpleNamespace(status=200, read=lambda: asyncio.sleep(0, b""))


async def test_start_checks_every_replica_at_once_before_returning_and_each_round_reads_the_config() -> None:
    """health.py: "``start()`` runs one round before returning"; "A round checks every replica
    concurrently, each bounded by ``health.timeout_s``"; the config is "read each round, so a
    reload applies to the next one"; "``stop()`` cancels the loop and waits for it"."""
    cfg = _config(3)
    fleet, session = Fleet(cfg, PrefixIndex()), _HealthSession(3)
    health = [cfg.health]
    checker = HealthChecker(fleet, session, lambda: health[0])  # type: ignore[arg-type]
    await checker.start()
    assert sorted(session.asked) == [(f"http://r{i}:1/health", 0.5) for i in range(3)]
    assert all(rec.healthy for rec in fleet.records())
    health[0] = HealthConfig(interval_s=0.01, timeout_s=0.25)  # a reload
    await until(lambda: len(session.asked) >= 9, "two more rounds")
    task = checker._task
    await checker.stop()
    assert task is not None and task.done() and checker._task is None
    assert {timeout for _, timeout in session.asked[3:]} == {0.25}


async def test_a_round_that_fails_does_not_end_health_checking(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """health.py: "a bug in one round must not end health checking"."""
    cfg = _config(3)
    fleet, session = Fleet(cfg, PrefixIndex()), _HealthSession(3)
    checker = HealthChecker(fleet, session, lambda: cfg.health)  # type: ignore[arg-type]
    await checker.start()
    records, bugs = fleet.records, [RuntimeError("a bug")]

    def buggy() -> Any:
        if bugs:
            raise bugs.pop()
        return records()

    monkeypatch.setattr(fleet, "records", buggy)
    await until(lambda: not bugs and len(session.asked) >= 6, "a round after the failed one")
    await checker.stop()
    assert "health round failed" in caplog.text


async def test_every_error_the_middleware_sees_becomes_openai_json() -> None:
    """openai_errors.py: "aiohttp's own errors (unknown path 404, wrong method 405, oversized
    admin body 413) and any unexpected exception become OpenAI error JSON" (a redirect is none)."""
    errors = [web.HTTPNotFound(), web.HTTPMethodNotAllowed("PUT", ["GET"]), web.HTTPRequestEntityTooLarge(10, 20),
              RuntimeError("a bug"), KeyError("x"), web.HTTPFound("/x")]  # fmt: skip
    for exc in errors:

        async def handler(_request: web.Request, exc: BaseException = exc) -> web.StreamResponse:
            raise exc

        status = exc.status if isinstance(exc, web.HTTPException) else 500
        with pytest.raises(web.HTTPFound) if status < 400 else contextlib.nullcontext():
            resp = await openai_errors_middleware(make_mocked_request("PUT", "/x"), handler)
            assert (resp.status, resp.content_type) == (status, "application/json")
            assert set(json.loads(resp.body)["error"]) == {"message", "type", "param", "code"}  # type: ignore[attr-defined]


def test_the_ttft_audit_keeps_the_last_window_for_its_median() -> None:
    """replica_audit.py: "Keeps the last ``TTFT_WINDOW`` relative errors [...] for their median",
    ``total`` counting every one."""
    rng, stats, errors = random.Random(5), TtftAuditStats(), list[float]()
    for i in range(2 * TTFT_WINDOW + 37):
        errors.append(rng.uniform(-1.0, 3.0))
        stats.record(errors[-1])
        if i % 101 == 0:
            assert stats.median_abs_error() == statistics.median(abs(e) for e in errors[-TTFT_WINDOW:])
    assert stats.total == len(errors) and len(stats._errors) == TTFT_WINDOW


def test_batched_request_metrics_are_flushed_before_each_scrape_reads_them() -> None:
    """metrics.py: the batches are "flushed into its metric before the registry is collected:
    the first collector registered"; ``Children`` keeps one child per label values; a batched
    counter, like any counter, never goes down."""
    router, index, _ = _setup()
    registry = CollectorRegistry()
    m = GatewayMetrics(registry, index, router._fleet, dict)
    rng, want = random.Random(4), Tally[tuple[str, str]]()
    for i in range(60):
        labels = (rng.choice("ab"), rng.choice(["200", "503"]))
        m.requests_by("p", *labels).inc()
        m.decision_time.observe(rng.random() / 100)
        want[labels] += 1
        text = generate_latest(registry).decode()  # each scrape shows every update so far
        for (rid, status), n in want.items():
            assert f'_requests_total{{policy="p",replica="{rid}",status="{status}"}} {float(n)}' in text
        assert f"kvgate_decision_seconds_count {float(i + 1)}" in text
    assert len(m.requests_by._cache) == len(want)
    with pytest.raises(ValueError):
        m.requests_by("p", "a", "200").inc(-1)


class _Base(MetricSet):
    hits = Metric(Counter, "t_hits", "Hits.", ("kind",))


class _Derived(_Base):
    wait = Metric(Histogram, "t_wait", "Wait.", buckets=(0.1, 1.0))


def test_a_metric_set_creates_every_metric_its_classes_declare_on_its_own_registry() -> None:
    """metric_specs.py: ``MetricSet`` "creates, on ``registry``, every ``Metric`` its class (and
    its bases) declares"; "on an instance of the set, the attribute is that instance's metric"."""
    registries = [CollectorRegistry(), CollectorRegistry()]
    sets = [_Derived(r) for r in registries]
    for n, (s, registry) in enumerate(zip(sets, registries, strict=True)):
        assert isinstance(s.hits, Counter) and isinstance(s.wait, Histogram)
        s.hits.labels("x").inc(n + 1)
        assert registry.get_sample_value("t_hits_total", {"kind": "x"}) == n + 1
    assert REGISTRY.get_sample_value("t_hits_total", {"kind": "x"}) is None  # no global registry
    assert isinstance(_Derived.hits, Metric) and sets[0].wait is not sets[1].wait
    with pytest.raises(AttributeError):
        _ = object.__new__(_Derived).wait  # before ``MetricSet.__init__``


def test_a_document_read_catches_only_what_cannot_be_read_or_parsed(tmp_path: Path) -> None:
    """documents.py: ``read_document`` fails "cannot read", "not UTF-8 text" or "invalid <kind>"
    ("nothing else is caught")."""
    with pytest.raises(Failed, match=r"^cannot read: Is a directory$"):
        read_document(tmp_path, "YAML", Failed)
    (tmp_path / "latin1.yaml").write_bytes("a: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(Failed, match=r"^not UTF-8 text: byte 6 "):
        read_document(tmp_path / "latin1.yaml", "YAML", Failed)
