"""The request path's parts: one envelope validation and one error type, a pure decision and one
commit of the speculative entries (undone on retry), and an explain that changes nothing."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.config import GatewayConfig, ModelConfig, parse_config
from gateway.features import EncodeSettings, Featurizer
from gateway.fleet import Fleet
from gateway.openai_errors import RequestError, error_response_of
from gateway.request import endpoint_of, parse_request, request_of
from gateway.request_errors import InvalidRequestError, UnknownModelError
from gateway.routing import Router, RoutingState
from router_policies.policy import RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.registry import build_policy

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "assets/tokenizers/kvgate-tiny")
WORDS = (ROOT / "assets/corpus/stdlib_docstrings.txt").read_text(encoding="utf-8").split()[:3000]


# --- parse and validate once ---------------------------------------------------------------------


def test_the_request_is_parsed_once_into_a_frozen_object() -> None:
    raw = b'{"model": "m", "prompt": "hi", "stream": true, "max_tokens": 7}'
    req = parse_request("completions", raw, "s-1")
    assert (req.endpoint, req.model, req.stream, req.session_id) == ("completions", "m", True, "s-1")
    assert (req.raw, req.prompt_field, req.max_output_tokens) == (raw, "prompt", 7)
    with pytest.raises(AttributeError):
        req.model = "n"  # type: ignore[misc]
    bad = [
        (b'{"model": ', "invalid_json", None),
        (b"[1]", "invalid_value", None),
        (b'{"prompt": "x"}', "invalid_value", "model"),
        (b'{"model": ""}', "invalid_value", "model"),
    ]
    for body, code, param in bad:
        with pytest.raises(InvalidRequestError) as err:
            parse_request("chat", body, None)
        assert (err.value.status, err.value.code, err.value.param) == (400, code, param)


def test_explain_names_its_endpoint_or_the_prompt_field_does() -> None:
    assert endpoint_of(None, {"model": "m", "messages": []}) == "chat"
    assert endpoint_of(None, {"model": "m", "prompt": "x"}) == "completions"
    assert endpoint_of("chat", {"model": "m", "prompt": "x"}) == "chat"
    assert endpoint_of("/v1/chat/completions", {}) == "chat"
    assert endpoint_of("/v1/completions", {}) == "completions"
    for named, body in [(None, {"model": "m"}), (None, {"prompt": 1, "messages": 2}), ("embed", {})]:
        with pytest.raises(InvalidRequestError) as err:
            endpoint_of(named, body)
        assert err.value.param == "endpoint"


def test_one_error_type_and_its_type_reaches_the_client() -> None:
    unknown = UnknownModelError("x")
    assert isinstance(unknown, RequestError) and isinstance(InvalidRequestError("y"), RequestError)
    resp = error_response_of(unknown)
    assert resp.status == 404 and resp.body is not None
    doc = orjson.loads(resp.body)  # type: ignore[arg-type]
    assert doc["error"]["type"] == "not_found_error" and doc["error"]["code"] == "model_not_found"
    # a type given explicitly wins over the status's default
    doc = orjson.loads(error_response_of(RequestError("z", status=400, type="custom")).body)  # type: ignore[arg-type]
    assert doc["error"]["type"] == "custom"
    assert RequestError("z", status=502).type == "upstream_error"


# --- decide, then commit -------------------------------------------------------------------------


def _setup(policy: str = "round_robin") -> tuple[Router, PrefixIndex, RoutingState]:
    cfg: GatewayConfig = parse_config(
        {
            "models": [{"name": "m", "block_size": 16}],
            "replicas": [{"id": "a", "url": "http://a:1"}, {"id": "b", "url": "http://b:1"}],
            "health": {"unhealthy_after": 1, "healthy_after": 1},
        }
    )
    index = PrefixIndex(cfg.index)
    fleet = Fleet(cfg, index)
    for rid in ("a", "b"):
        fleet.check_result(rid, True)
    state = RoutingState(cfg, build_policy(policy, {}, seed=0), Featurizer.from_config(cfg))
    return Router(index, fleet), index, state


def _feats(*keys: int) -> RequestFeatures:
    return RequestFeatures(model="m", block_keys=list(keys), prompt_tokens=16 * len(keys), block_size=16)


def test_decide_is_pure_and_commit_records_and_advances() -> None:
    router, index, state = _setup()
    feats = _feats(1, 2, 3)
    policy_before = copy.deepcopy(state.policy)
    first = router.decide(state, feats, router.match(feats))
    for _ in range(3):  # deciding again changes nothing: same replica, no entry
        assert router.decide(state, feats, router.match(feats)).record.id == first.record.id
    assert index.entries == 0 and vars(state.policy) == vars(policy_before)
    spec = router.commit(state, feats, first)
    assert index.approximate_keys(first.record.id) == [3, 2, 1]
    # the round-robin cursor moved on commit, once
    assert router.decide(state, feats, router.match(feats)).record.id != first.record.id
    # a deferred encode's full keys go through the same writer
    router.record(spec, [1, 2, 3, 4, 5])
    assert index.approximate_keys(first.record.id) == [5, 4, 3, 2, 1]


def test_undo_drops_only_what_the_attempt_added() -> None:
    router, index, state = _setup()
    index.store("a", [1])  # the engine holds the first block
    index.touch_approximate("a", [1, 2], now=time.monotonic())  # an earlier request's
    feats = _feats(1, 2, 3, 4)
    match = router.match(feats)
    choice = router.decide(state, feats, match, exclude=frozenset({"b"}))
    assert choice.record.id == "a" and choice.state.matched_blocks == 2
    spec = router.commit(state, feats, choice)
    router.record(spec, [1, 2, 3, 4, 5])  # its deferred encode finished before the retry
    assert set(index.approximate_keys("a")) == {2, 3, 4, 5}
    router.undo(spec)
    assert index.approximate_keys("a") == [2] and index.precise_keys("a") == [1]
    router.record(spec, [1, 2, 3, 4, 5, 6])  # a late deferred encode of an undone attempt
    assert index.approximate_keys("a") == [2]


# --- explain changes nothing ---------------------------------------------------------------------


def _chat(*contents: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": c} for c in contents]}


async def test_explain_featurizes_without_side_effects() -> None:
    fz = Featurizer(
        [ModelConfig(name="tiny", tokenizer=TINY, block_size=16)],
        EncodeSettings(cache_entries=1000, defer_chars=200),
    )
    try:
        await fz.features("chat", _chat("hello there"))
        await fz.deferred.drain()
        stats = fz.cache_stats()
        counts = dict(fz.mode_counts)
        seen = len(fz.planner.seen)
        new_text = _chat("hello there", " ".join(WORDS[1000:1400]))
        explained, info = await fz.featurize(request_of("chat", new_text), explain=True)
        assert info.deferred_chars > 0 and info.deferred is None  # reported, not queued
        # short new text: encoded before routing, but not cached
        await fz.featurize(request_of("chat", _chat("a short new question")), explain=True)
        assert fz.cache_stats() == stats and fz.mode_counts == counts and len(fz.planner.seen) == seen
        assert fz.deferred.submitted == 0 and len(fz.deferred) == 0
        # the real call that follows sees the same thing explain did
        real, real_info = await fz.features("chat", new_text)
        assert list(real.block_keys) == list(explained.block_keys)
        assert real_info.deferred_chars == info.deferred_chars and real_info.deferred is not None
        assert fz.cache_stats() != stats and len(fz.planner.seen) > seen
    finally:
        await fz.close()
