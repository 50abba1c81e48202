"""Stated invariants of the simulated engine (sim_engine/core.py, request_faults.py, metrics.py,
server.py, tokenization.py) and of the agent's readers of what an engine publishes and serves
(engine_events.py, inventory_groups.py, engine_models.py, load_probe.py) that no other test
enforced, checked in-process, without sockets. Each test quotes the module stating its invariant."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Iterable
from itertools import pairwise
from types import SimpleNamespace
from typing import Any, cast

import msgpack
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.contract import MAX_LORA_ADAPTERS
from replica_agent.engine_events import BlockRemoved, BlockStored, EngineEvent, MalformedEvent, decode_event
from replica_agent.engine_events import decode_payload as decode
from replica_agent.engine_models import engine_models
from replica_agent.inventory import AgentInventory
from replica_agent.load_probe import parse_engine_metrics
from replica_agent.sim_engine.block_registry import BlockRegistry
from replica_agent.sim_engine.core import CoreHooks, EngineCore, _Abort
from replica_agent.sim_engine.engine_hashes import HashFormat
from replica_agent.sim_engine.http_api import Routes
from replica_agent.sim_engine.kv_events import EventEncoding, KvEventPublisher
from replica_agent.sim_engine.metrics import TTFT_BUCKETS, EngineMetrics
from replica_agent.sim_engine.options import default_tokenizer_dir
from replica_agent.sim_engine.protocol import ApiError
from replica_agent.sim_engine.request_faults import KINDS, FaultFieldError, RequestFaults
from replica_agent.sim_engine.server import SimEngine
from replica_agent.sim_engine.tokenization import EngineTokenizer
from router_policies.sim import replica_model as rm
from router_policies.sim.profiles import DEFAULT_PROFILE, get_profile
from tests.polling import until
from tests.unit.test_agent_engine_models import card
from tests.unit.test_agent_inventory import RecordingSink, grouped
from tests.unit.test_agent_subscriber import stored as wire_stored

SEEDS = range(4)
BS = 4  # tokens per block
BLOCKS = 64  # the engine's KV cache


def engine_config() -> rm.EngineConfig:
    """The default profile's engine with instantaneous steps (the core's loop then only yields)."""
    base = get_profile(DEFAULT_PROFILE).engine_config(BS, BLOCKS)
    return dataclasses.replace(base, costs=rm.StepCosts(0.0, 0.0))


def core_of(max_pending: int) -> tuple[EngineCore, rm.ReplicaModel, list[object]]:
    """A core, its model, and the KV-event batches it publishes."""
    model, batches, pub = rm.ReplicaModel(engine_config()), list[object](), cast(Any, SimpleNamespace())
    pub.publish, hooks = batches.append, CoreHooks(lambda _s: None, lambda _h: None, lambda _n: None)
    core = EngineCore(model, BlockRegistry("m", BS, HashFormat.INT), pub, max_pending, hooks)
    return core, model, batches


@pytest.mark.parametrize("seed", SEEDS)
async def test_core_bounds_pending_requests_and_publishes_one_batch_a_step(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """core.py: ``_handles`` holds the requests submitted and neither finished nor aborted, at most
    ``max_pending`` (with those queued; more get 503); one KV-event batch per step that has events;
    every request ends finished or failed, and then holds no block (only cached ones stay)."""
    rng, max_pending = random.Random(seed), 4
    core, model, batches = core_of(max_pending)
    steps: list[bool] = []  # whether each step had events
    step = model.step

    def counted(now: float, horizon: float | None = None) -> rm.StepResult:
        res = step(now, horizon)
        steps.append(bool(res.events))
        return res

    monkeypatch.setattr(model, "step", counted)
    core.start()
    handles = []
    for _ in range(300):
        r = rng.random()
        if r < 0.45:
            full = core.pending >= max_pending
            try:
                tokens = [rng.randint(1, 3) for _ in range(rng.randint(1, 14))]
                handles.append(core.submit(tokens, rng.randint(1, 40)))
                assert not full
            except ApiError as exc:
                assert full and exc.status == 503
        elif r < 0.6 and handles:
            core.abort(rng.choice(handles))
        for _ in range(rng.randint(0, 3)):
            await asyncio.sleep(0)
        assert core.pending <= max_pending and len(batches) <= sum(steps) <= len(batches) + 1
        assert all(not h.finished and h.error is None for h in core._handles.values())
    await until(lambda: not core.pending, timeout_s=10, interval_s=0)
    assert all(h.finished != (h.error is not None) for h in handles) and len(batches) == sum(steps) > 0
    assert {h.error for h in handles} == {None, "aborted"}
    assert core.registry_entries == len(model.cached_ids())
    await core.stop()


async def test_core_refuses_exactly_the_requests_the_model_would() -> None:
    """core.py: a request too large for the KV cache (the model's RequestTooLargeError) is checked
    at submit, before it reaches the model (which keeps the check as a guard)."""
    rng, core = random.Random(0), core_of(1000)[0]
    for i in range(300):
        prompt, out = rng.randint(200, 260), rng.randint(1, 60)  # around the cache's 64 blocks
        try:
            req = rm.EngineRequest(i, range(prompt // BS), prompt, out)
            rm.ReplicaModel(engine_config()).submit(req, 0.0)
            too_large = False
        except rm.RequestTooLargeError:
            too_large = True
        try:
            core.submit([1] * prompt, out)
            assert not too_large
        except ApiError as exc:
            assert too_large and exc.status == 400


async def test_an_abort_always_reaches_the_core() -> None:
    """core.py: a client's abort always reaches the core (found false: debug calls queued in one
    step could take the room the aborts were said to have)."""
    core = core_of(1)[0]
    handle = core.submit([1] * 5, 2)
    calls = [asyncio.ensure_future(core.call(lambda: None)) for _ in range(2 * 1 + 64 - 1)]
    await asyncio.sleep(0)  # the debug reads of one step: each queued
    core.abort(handle)  # the client went away
    queued = [core._commands.get_nowait() for _ in range(core._commands.qsize())]
    for c in calls:
        c.cancel()
    assert any(isinstance(cmd, _Abort) for cmd in queued)


async def test_a_failed_core_fails_its_requests_and_refuses_new_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """core.py ``run``: a bug in the step loop must not leave clients waiting forever: fail them all
    and refuse new work (/health turns 503)."""
    core, model, _ = core_of(4)

    def broken(*_args: object) -> rm.StepResult:
        raise RuntimeError("a bug")

    monkeypatch.setattr(model, "step", broken)
    handle = core.submit([1] * 9, 3)
    core.start()
    assert core._task is not None
    await asyncio.wait({core._task})
    assert handle.error == "engine core failed" and handle.changed.is_set() and not core.alive
    for refused in (lambda: core.submit([1] * 9, 3), lambda: core.call(lambda: 1).send(None)):
        with pytest.raises(ApiError, match="shutting down") as exc:
            refused()
        assert exc.value.status == 503


async def test_stop_fails_every_outstanding_request_and_call() -> None:
    """core.py ``stop`` (server.py: the core stops first; it fails every outstanding request, so
    handlers finish and new ones get 503)."""
    core = core_of(4)[0]
    running = core.submit([1] * 9, 3)
    core._apply_pending_commands()  # in the engine now
    queued = core.submit([2] * 9, 3)
    call = asyncio.ensure_future(core.call(lambda: 1))
    await asyncio.sleep(0)
    await core.stop()
    await asyncio.wait({call}, timeout=5)
    assert running.error == queued.error == "engine shutting down" and not core._handles
    assert call.cancelled() and running.changed.is_set() and queued.changed.is_set()
    with pytest.raises(ApiError, match="shutting down"):
        core.submit([1] * 9, 3)


async def test_sim_engine_stops_the_core_then_http_then_the_publisher() -> None:
    """server.py: stop: the core first, then the HTTP runner, then the tokenizer's thread and the
    request log (only HTTP handlers use them), then the publisher."""
    order: list[str] = []

    class Log:
        def close(self) -> None:
            order.append("request log")

    class Part:
        def __init__(self, name: str) -> None:
            self.name = name

        async def stop(self) -> None:
            order.append(self.name)

        cleanup = close = stop

        def shutdown(self, wait: bool, cancel_futures: bool) -> None:
            assert wait and cancel_futures
            order.append(self.name)

    engine = cast(Any, SimEngine.__new__(SimEngine))
    engine._core, engine._runner, engine.publisher = Part("core"), Part("http"), Part("publisher")
    engine._tokenize_pool, engine.request_log = Part("tokenizer"), Log()
    await SimEngine.stop(engine)
    assert order == ["core", "http", "tokenizer", "request log", "publisher"]


@pytest.mark.parametrize("seed", SEEDS)
def test_request_faults_are_taken_in_arrival_order_first_kind_first(seed: int) -> None:
    """request_faults.py: each count applies to the next N generation requests, in arrival order; a
    request takes the first fault with a count left, in the order of KINDS; ``set`` replaces the
    counts (absent ones become 0)."""
    rng, faults = random.Random(seed), RequestFaults()
    for _ in range(30):
        counts = {k: rng.randint(0, 3) for k in KINDS if rng.random() < 0.7}
        faults.set(counts)
        applied = dict(faults.applied)
        want = [k for k in KINDS for _ in range(counts.get(k, 0))] + [None, None]
        n = rng.randint(0, len(want))
        assert [faults.take() for _ in range(n)] == want[:n]
        assert faults.applied == {k: applied[k] + want[:n].count(k) for k in KINDS}


async def test_request_faults_alone_leave_the_event_faults_as_they_are() -> None:
    """http_api.py ``set_faults``: a body of request faults only changes those: the event faults stay."""
    pub = KvEventPublisher("inproc://unused", None, "kv", 5, EventEncoding.MAP)
    core = SimpleNamespace(call=lambda fn: asyncio.sleep(0, fn()))
    routes = Routes(cast(Any, SimpleNamespace(core=core, publisher=pub, seed=0)))

    async def post(body: dict[str, Any]) -> Any:
        request = SimpleNamespace(read=lambda: asyncio.sleep(0, orjson.dumps(body)))
        return orjson.loads(cast(Any, await routes.set_faults(cast(Any, request))).body)

    await post({"drop": 2, "reorder": 1})
    got = await post({"hang": 1, "slow_ms": 5})
    assert (got["drop"], got["reorder"], got["requests"]["hang"], got["requests"]["slow_ms"]) == (2, 1, 1, 5)
    got = await post({"duplicate": 1, "error": 1})
    assert (got["drop"], got["duplicate"], got["requests"]["hang"], got["requests"]["error"]) == (0, 1, 0, 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_bad_fault_field_changes_nothing(seed: int) -> None:
    """request_faults.py ``set``: raises ``FaultFieldError`` (naming the field) before changing
    anything."""
    rng, faults = random.Random(seed), RequestFaults()
    bad = [("error", -1), ("slow", True), ("hang", 1_000_001), ("stall", "1"), ("error_status", 404),
           ("error_status", 700), ("slow_ms", 600_001), ("slow_ms", 1.5)]  # fmt: skip
    for _ in range(100):
        body: dict[str, Any] = {k: rng.randint(0, 3) for k in rng.sample(KINDS, 3)}
        body |= {"error_status": rng.choice((500, 502, 503, 504)), "slow_ms": rng.randint(0, 9)}
        if rng.random() < 0.5:
            before, (name, value) = faults.as_dict(), rng.choice(bad)
            with pytest.raises(FaultFieldError) as exc:
                faults.set({**body, name: value})
            assert exc.value.field == name and faults.as_dict() == before
        else:
            faults.set(body)
            assert faults.as_dict() == {**dict.fromkeys(KINDS, 0), **body, "applied": faults.applied}


def _labels(render: bytes) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(render.decode()):
        for s in family.samples:
            out.setdefault(family.name, set()).update(s.labels)
    return out


def test_every_metric_carries_model_name_and_engine() -> None:
    """metrics.py: every metric carries vLLM's labels ``model_name`` and ``engine``, but
    ``vllm:cache_config_info`` (``engine`` only, as vLLM's); one registry per engine instance."""
    a, b = (EngineMetrics(rm.ReplicaModel(engine_config()), "sim") for _ in "ab")
    a.observe_ttft(0.5)
    a.request_finished(7, 2)
    labels = _labels(a.render())
    info = labels.pop("vllm:cache_config_info")
    assert len(labels) >= 10 and all({"model_name", "engine"} <= names for names in labels.values())
    assert "engine" in info and "model_name" not in info
    assert 'vllm:prompt_tokens_total{engine="0",model_name="sim"} 7.0' in a.render().decode()
    assert 'vllm:prompt_tokens_total{engine="0",model_name="sim"} 0.0' in b.render().decode()


@pytest.mark.parametrize(
    "lowest",
    [0.03],
)  # fmt: skip
def test_ttft_buckets_are_at_most_1_35x_apart_up_to_10_s(lowest: float) -> None:
    """metrics.py: TTFT boundaries at most ~1.35x apart up to 10 s (a p99 can be read from them)."""
    bounds = [b for b in TTFT_BUCKETS if lowest <= b <= 10.0]
    assert list(TTFT_BUCKETS) == sorted(set(TTFT_BUCKETS)) and bounds[-1] == 10.0
    assert max(hi / lo for lo, hi in pairwise(bounds)) <= 1.35


def test_generated_tokens_are_safe_and_the_same_in_every_process() -> None:
    """tokenization.py: generated text is made of safe tokens only (ids whose own decoding is
    printable ASCII, no special token); ``pseudo_tokens``: same inputs, same output, in every
    process (the golden value was computed by another one)."""
    tok = EngineTokenizer(default_tokenizer_dir())
    special, rng = set(tok._tok.all_special_ids), random.Random(0)
    for _ in range(40):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 80))]
        out = tok.pseudo_tokens(5, prompt, 30)
        assert out == tok.pseudo_tokens(5, list(prompt), 30) and not special & set(out)
        assert all((t := tok.decode([i])) and t.isascii() and t.isprintable() for i in out)
    assert tok.pseudo_tokens(3, [1, 2, 3], 6) == [88, 1398, 1466, 1945, 898, 804]


def raw_event(rng: random.Random) -> Any:
    """An engine event as msgpack gives it: well formed, or with a field of the wrong type."""
    junk: Any = rng.choice([None, True, 1.5, "x", b"y", [], {}, [1, "a"], -3])
    hashes = [rng.randint(1, 6) for _ in range(rng.randint(0, 2))]
    medium, group = rng.choice(["GPU", "GPU", "CPU", None, "", 7]), rng.choice([None, 0, 1, True])
    r = rng.random()
    if r < 0.1:
        return ["BlockRemoved", hashes, medium]
    if r < 0.15:
        return rng.choice([{"type": "AllBlocksCleared"}, ["AllBlocksCleared"], junk])
    ev: dict[str, Any] = dict(type="BlockRemoved", block_hashes=hashes, medium=medium, group_idx=group)
    if r > 0.55:
        ev = {**wire_stored(rng.randint(1, 6), rng.choice([None, 3]), [1, 2]), "group_idx": group}
    if rng.random() < 0.15:
        ev[rng.choice(list(ev))] = junk
    return ev


def effects(events: Iterable[EngineEvent]) -> list[tuple[Any, ...]]:
    """What a batch does, one removal a hash (merging removals must not change it)."""
    out: list[tuple[Any, ...]] = []
    for ev in events:
        if isinstance(ev, BlockRemoved):
            out += [("removed", h, ev.medium, ev.group) for h in ev.block_hashes]
        elif isinstance(ev, BlockStored):
            out.append(
                ("stored", tuple(ev.block_hashes), ev.parent, tuple(ev.token_ids), ev.medium, ev.group)
            )
        else:
            out.append(("cleared",))
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_decoding_skips_bad_events_and_merges_removals_keeping_their_effects(seed: int) -> None:
    """engine_events.py ``decode_payload``: a payload that is not an EventBatch raises
    ``MalformedEvent``; single events that do not decode are skipped and counted; adjacent removals
    of one medium (and group) are merged into one event, with the same order of effects."""
    rng, merged = random.Random(seed), 0
    for _ in range(300):
        raws = [raw_event(rng) for _ in range(rng.randint(0, 8))]
        if rng.random() < 0.05:  # not a batch
            with pytest.raises(MalformedEvent):
                decode(msgpack.packb(rng.choice([raws[:1], "x", 5, {"ts": 1}]))[: rng.randint(0, 9)])
            continue
        batch = decode(msgpack.packb(rng.choice([[2.5, raws, 0], {"ts": 2.5, "events": raws}])))
        one_by_one: list[EngineEvent] = []
        for raw in raws:
            with contextlib.suppress(MalformedEvent):
                one_by_one.append(decode_event(raw))
        assert batch.malformed == len(raws) - len(one_by_one)
        assert effects(batch.events) == effects(one_by_one)
        runs = [(a.medium, a.group) == (b.medium, b.group) for a, b in pairwise(batch.events)
                if isinstance(a, BlockRemoved) and isinstance(b, BlockRemoved)]  # fmt: skip
        assert not any(runs)
        merged += len(one_by_one) - len(batch.events)
    assert merged > 0


def test_adapters_left_out_are_chosen_by_name_whatever_the_order() -> None:
    """engine_models.py: beyond MAX_LORA_ADAPTERS adapters the rest are left out (sorted by name, so
    the choice is stable)."""
    rng = random.Random(0)
    names = [f"a{i:05d}" for i in range(MAX_LORA_ADAPTERS + 5)]
    want = frozenset(names[:MAX_LORA_ADAPTERS])
    for _ in range(3):
        rng.shuffle(names)
        assert engine_models({"data": [card("m"), *(card(n, "m") for n in names)]}).adapters == want


def test_the_engine_is_named_by_any_sample_and_unread_lines_are_not_parsed() -> None:
    """load_probe.py: the engine is named by any of its samples, read here or not; a malformed line
    of a metric not read is no error."""
    unread = "# TYPE vllm:e2e_request_latency_seconds histogram\nvllm:e2e_request_latency_seconds_count 3.0\n"
    assert parse_engine_metrics(unread).engine == "vllm"
    assert parse_engine_metrics("sglang:gen_throughput 5.0\n").engine == "sglang"
    load = parse_engine_metrics('vllm:num_requests_running{engine="0"} 2.0\nvllm:iteration_tokens{le= 1\n')
    assert (load.engine, load.running) == ("vllm", 2)


def test_the_switch_to_group_tracking_is_silent() -> None:
    """inventory_groups.py ``_switch_to_groups``: the blocks tracked so far go to a group tracker
    silently: they stay reported until the new groups say otherwise."""
    sink = RecordingSink()
    inv = AgentInventory("m", 2, max_blocks=100, sink=sink)
    inv.apply([grouped([10, 11, 12], None, [1, 2, 3, 4, 5, 6], group=0)])
    before, ops = inv.snapshot(), list(sink.ops)
    inv.apply([grouped([20], None, [], group=1)])  # a second group, its first event keying nothing
    assert inv.hybrid and inv.snapshot() == before and sink.ops == ops
