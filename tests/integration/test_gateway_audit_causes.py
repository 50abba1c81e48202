"""Every cause of an inexact cached-token prediction (gateway/prediction_audit.py), each made to
happen on real processes: a gateway in front of a fake backend whose reported cached tokens and
prompt length the request sets, and a minimal agent (the real inventory stream) that decides
what the index holds, and when: before the decision, or while the request is in flight."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.app_parts import build_state
from gateway.config import parse_config
from kvgate_tools.stream_agent import StreamAgent
from proto.kvgate.v1 import inventory_pb2 as pb
from tests.integration.gateway_harness import AGENT_TOKEN, Backend, Gateway, Procs, base_config, http
from tests.integration.test_gateway_deferred import _doc
from tests.integration.test_gateway_observability import _access_lines
from tests.polling import wait_until

BS = 16
DEFER_CHARS = 2048
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Fleet:
    """One gateway, one fake backend ``r0`` and an agent speaking for it."""

    gw: Gateway
    backend: Backend
    agent: StreamAgent
    cfg: dict[str, Any]

    def features(self, prompt: str) -> tuple[list[int], int]:
        """The keys and prompt length the gateway computes for ``prompt`` when it is encoded
        whole (a deferred request's keys once its encode is done); the featurizer built for it
        is closed before this returns (its encode threads end with it)."""
        state = build_state(parse_config({**self.cfg, "proxy": {"tokenize_defer_chars": 0}}))

        async def encode() -> tuple[list[int], int]:
            try:
                feats, _info = await state.featurizer.features(
                    "completions", {"model": "m", "prompt": prompt}
                )
                return list(feats.block_keys), feats.prompt_tokens
            finally:
                await state.featurizer.close()

        return asyncio.run(encode())

    def events(self, **event: Any) -> None:
        self.agent.send(events=pb.Events(events=[pb.Event(**event)]))

    def post(self, prompt: str, **extra: Any) -> dict[str, str]:
        status, headers, body = http(
            "POST",
            self.gw.url + "/v1/completions",
            json.dumps({"model": "m", "prompt": prompt, "max_tokens": 3, **extra}).encode(),
            {"content-type": "application/json"},
        )
        assert status == 200, body
        return headers

    def while_in_flight(self, prompt: str, during: Callable[[], None], **extra: Any) -> dict[str, str]:
        """Stream ``prompt`` (slowly: it says ``slow``, ~0.9 s) and run ``during`` once the
        backend has it."""
        assert "slow" in prompt
        seen = self.backend.stats()["requests"]
        out: dict[str, dict[str, str]] = {}
        t = threading.Thread(target=lambda: out.update(h=self.post(prompt, **STREAM, **extra)))
        t.start()
        wait_until(lambda: self.backend.stats()["requests"] > seen, what="request at the backend")
        during()
        t.join(30)
        return out["h"]

    def causes(self) -> dict[str, int]:
        audit = self.gw.replicas()["r0"]["prediction_audit"]
        return dict(audit["inexact_causes"])

    def last_entry(self) -> dict[str, Any]:
        """The access-log line of the last request (written once its answer went out)."""
        sent = self.backend.stats()["requests"]

        def proxied() -> list[dict[str, Any]]:
            got = [e for e in _access_lines(self.gw) if str(e.get("path", "")).startswith("/v1/")]
            return got if len(got) >= sent else []

        return dict(wait_until(proxied, what="the access-log line")[-1])

    def last_cause(self) -> str:
        return str(self.last_entry()["audit_cause"])


@pytest.fixture
def fleet(procs: Procs) -> Iterator[Fleet]:
    b = procs.backend("r0")
    cfg = base_config(b, proxy={"tokenize_defer_chars": DEFER_CHARS})
    gw = procs.gateway(cfg)
    agent = StreamAgent(gw.inventory_port, AGENT_TOKEN)
    try:
        agent.send(hello=pb.Hello(replica_id="r0", url=b.url, models=["m"], block_size=BS, engine="fake",
                                  protocol_version=1))  # fmt: skip
        agent.send(snapshot=pb.SnapshotChunk(snapshot_id=1, keys=[], medium="GPU", last=True))
        wait_until(lambda: gw.replicas()["r0"]["agent_connected"], what="agent registered")
        yield Fleet(gw, b, agent, cfg)
    finally:
        agent.close()


def _sentence(topic: str) -> str:
    return f"Notes on {topic}: the quick brown fox jumps over the lazy dog. " * 3


def _held(f: Fleet, keys: list[int]) -> Callable[[], bool]:
    def check() -> bool:
        _status, doc = f.gw.admin("GET", "/admin/index?replica=r0")
        return set(keys) <= set(doc["keys"])

    return check


def test_over_predictions_by_cause(fleet: Fleet) -> None:
    f = fleet
    # concurrent_not_stored: the second request matches the first one's speculative entries,
    # which the engine never stored
    a = _sentence("alpha")
    assert f.post(a)["x-kvgate-matched-tokens"] == "0"
    assert int(f.post(a)["x-kvgate-matched-tokens"]) >= 3 * BS
    assert f.last_cause() == "concurrent_not_stored"

    # stale_index / tokenization: three blocks reported by the engine, one reported cached,
    # nothing removed since; the engine counts the prompt as the gateway does, or not
    for topic, extra, cause in (("beta", 0, "stale_index"), ("gamma", 5, "tokenization")):
        prompt = _sentence(topic)
        keys, n = f.features(prompt)
        f.events(stored=pb.Stored(keys=keys[:3]))
        wait_until(_held(f, keys[:3]), what="blocks stored")
        h = f.post(prompt, fake_cached_tokens=BS, fake_prompt_tokens=n + extra)
        assert h["x-kvgate-matched-tokens"] == str(3 * BS)
        assert f.last_cause() == cause

    # evicted: the engine reports the third block removed while the request is in flight
    prompt = _sentence("delta") + " slow"
    keys, n = f.features(prompt)
    f.events(stored=pb.Stored(keys=keys[:3]))
    wait_until(_held(f, keys[:3]), what="blocks stored")

    def evict() -> None:
        f.events(removed=pb.Removed(keys=keys[2:3]))
        wait_until(lambda: not _held(f, keys[2:3])(), what="block removed")

    h = f.while_in_flight(prompt, evict, fake_cached_tokens=2 * BS, fake_prompt_tokens=n)
    assert h["x-kvgate-matched-tokens"] == str(3 * BS)
    assert f.last_cause() == "evicted"
    assert f.causes() == {"concurrent_not_stored": 1, "stale_index": 1, "tokenization": 1, "evicted": 1}


def test_under_predictions_by_cause(fleet: Fleet) -> None:
    f = fleet
    # not_yet_reported: the engine stores (and the agent reports) the blocks while the request is
    # in flight: they were on their way at the decision
    prompt = _sentence("epsilon") + " slow"
    keys, n = f.features(prompt)

    def store_keys(held: list[int]) -> None:
        f.events(stored=pb.Stored(keys=held))
        wait_until(_held(f, held), what="blocks stored")

    h = f.while_in_flight(
        prompt, lambda: store_keys(keys[:3]), fake_cached_tokens=3 * BS, fake_prompt_tokens=n
    )
    assert h["x-kvgate-matched-tokens"] == "0"
    assert f.last_cause() == "not_yet_reported"
    # not_yet_reported too: stored after the decision and evicted again before the audit; the
    # engine counts the prompt as the gateway does, so its blocks were under the request's keys
    prompt = _sentence("eta") + " slow"
    keys, n = f.features(prompt)

    def store_and_evict() -> None:
        store_keys(keys[:3])
        f.events(removed=pb.Removed(keys=keys[:3]))
        wait_until(lambda: not _held(f, keys[:1])(), what="blocks removed")

    f.while_in_flight(prompt, store_and_evict, fake_cached_tokens=3 * BS, fake_prompt_tokens=n)
    assert f.last_cause() == "not_yet_reported"
    # stale_index: the same, with an agent that says its inventory may miss blocks
    f.agent.send(state=pb.AgentState(degraded=True, reason="event gap"))
    wait_until(lambda: f.gw.replicas()["r0"]["index_degraded"], what="agent degraded")
    prompt = _sentence("theta")
    _keys, n = f.features(prompt)
    f.post(prompt, fake_cached_tokens=3 * BS, fake_prompt_tokens=n)
    assert f.last_cause() == "stale_index"
    f.agent.send(state=pb.AgentState(degraded=False))
    wait_until(lambda: not f.gw.replicas()["r0"]["index_degraded"], what="agent recovered")
    # tokenization: the engine reports blocks no agent ever reported under the request's keys,
    # and counts another prompt length (the fake backend's: characters)
    f.post(_sentence("zeta"), fake_cached_tokens=3 * BS)
    assert f.last_cause() == "tokenization"
    # ... or more cached blocks than the gateway's prompt has
    f.post("short", fake_cached_tokens=2 * BS)
    assert f.last_cause() == "tokenization"
    assert f.causes() == {"not_yet_reported": 2, "stale_index": 1, "tokenization": 2}


def test_deferred_requests_are_audited_with_their_full_keys(fleet: Fleet) -> None:
    f = fleet
    # a new document is routed before it is encoded: on no key at all (predicted 0)
    doc = _doc(7, 900) + " slow"
    assert len(doc) > DEFER_CHARS
    full, _n = f.features(doc)
    f.events(stored=pb.Stored(keys=full[:2]))  # the engine holds its first two blocks
    wait_until(_held(f, full[:2]), what="blocks stored")
    h = f.post(doc, fake_cached_tokens=2 * BS, **STREAM)
    assert h["x-kvgate-matched-tokens"] == "0"
    entry = f.last_entry()
    assert entry["deferred_chars"] > 0 and entry["audit_cause"] == "deferred_encode"
    # the stream outlasted the encode: the cause was checked against the whole prompt's keys
    assert entry["audit_full_key_blocks"] == len(full)

    # the engine's blocks are not under the document's keys, even with all of them: tokenization
    other = _doc(8, 900) + " slow"
    f.post(other, fake_cached_tokens=2 * BS, **STREAM)
    entry = f.last_entry()
    assert entry["deferred_chars"] > 0 and entry["audit_cause"] == "tokenization"
    # an exact prediction on deferred features is counted too
    f.post(_doc(9, 900), fake_cached_tokens=0)
    audit = f.gw.replicas()["r0"]["prediction_audit"]
    assert (audit["total"], audit["exact"]) == (3, 1)
    assert audit["inexact_causes"] == {"deferred_encode": 1, "tokenization": 1}


def test_blocks_taken_as_evicted_before_the_prefill_and_kept(procs: Procs) -> None:
    """eviction_estimate: the replica's agent says its KV cache holds 10 blocks; a long prompt
    awaits its first byte there (its prefill queued ahead); a request whose three blocks the
    index holds then needs more room than the cache has, so the prediction takes them as evicted
    before its prefill (``evicted_before_prefill``), and the engine reports them cached."""
    b = procs.backend("r0")
    cfg = base_config(b)
    gw = procs.gateway(cfg)
    agent = StreamAgent(gw.inventory_port, AGENT_TOKEN)
    try:
        agent.send(hello=pb.Hello(replica_id="r0", url=b.url, models=["m"], block_size=BS, engine="fake",
                                  capacity_blocks=10, protocol_version=1))  # fmt: skip
        agent.send(snapshot=pb.SnapshotChunk(snapshot_id=1, keys=[], medium="GPU", last=True))
        wait_until(lambda: gw.replicas()["r0"]["agent_connected"], what="agent registered")
        f = Fleet(gw, b, agent, cfg)
        prompt = _sentence("iota")
        keys, n = f.features(prompt)
        assert len(keys) >= 3
        f.events(stored=pb.Stored(keys=keys[:3]))
        wait_until(_held(f, keys[:3]), what="blocks stored")
        ahead = "late-first-byte " + " ".join(f"word{i}" for i in range(150))
        seen = b.stats()["requests"]
        t = threading.Thread(target=lambda: f.post(ahead))
        t.start()
        wait_until(lambda: b.stats()["requests"] > seen, what="the long prompt at the backend")
        h = f.post(prompt, fake_cached_tokens=3 * BS, fake_prompt_tokens=n)
        t.join(30)
        assert h["x-kvgate-matched-tokens"] == "0"  # the prediction: all three taken as evicted
        entry = [e for e in _access_lines(gw) if e.get("audit_cause")]
        assert [e["audit_cause"] for e in entry] == ["eviction_estimate"], entry
        assert (entry[0]["matched_blocks"], entry[0]["predicted_cached_tokens"]) == (3, 0)
        assert f.causes() == {"eviction_estimate": 1}
    finally:
        agent.close()
