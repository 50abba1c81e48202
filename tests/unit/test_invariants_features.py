"""The stated invariants of the request path's parts that no other test enforced, or enforced
only in part: the featurizer's bounded caches and budgets, the prompt reader, the prediction audit,
API keys and agent credentials, the task helpers. Each test quotes the invariant it checks from
the module that states it, over seeded random operation sequences where it is about sequences;
tests/unit/test_invariants_upstream.py and test_invariants_relay.py do the same for the
upstream's client, its first-byte watch, the stream relay and the upstream."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry

from gateway.agent_credentials import RegistrationRules, credentials_of, token_digest
from gateway.api_keys import ApiAuth, ApiAuthMetrics, ApiKeys, key_id
from gateway.asyncio_tasks import cancel_and_wait
from gateway.config import ApiKeysConfig, AuthConfig, ModelConfig, RegistrationConfig
from gateway.features.budgets import ByteBudget
from gateway.features.byte_lru import ByteLRU
from gateway.features.char_blocks import char_block_keys, char_root_key
from gateway.features.memo_cache import MemoCache
from gateway.features.model_registry import ModelRegistry
from gateway.features.prompt import read_prompt
from gateway.features.segment_encoder import BoundedLRU
from gateway.prediction_audit import AuditCase, SseTail, inexact_cause
from gateway.rate_limit import TokenBuckets
from gateway.request import request_of
from router_policies.block_keys import block_keys, root_key
from router_policies.placement import IndexAtDispatch
from router_policies.prefix_index import PrefixIndex
from tests.unit.test_features_deferred import TINY

SEEDS = [0, 1, 2]


# --- gateway/features/byte_lru.py --------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_byte_lru_holds_at_most_capacity_entries_and_max_bytes(seed: int) -> None:
    """byte_lru.py: "``bytes <= max_bytes`` and ``len <= capacity`` after every ``put``" (and
    ``bytes`` is the sum of the entries' sizes, which the bound is about)."""
    rng = random.Random(seed)
    for _ in range(20):
        capacity = rng.randrange(0, 8)
        max_bytes = rng.choice([None, rng.randrange(0, 60)])
        lru: ByteLRU[int, int] = ByteLRU(capacity, max_bytes, lambda _k, v: v)
        for _ in range(60):
            op = rng.random()
            key = rng.randrange(12)
            if op < 0.7:
                lru.put(key, rng.randrange(1, 25))
                assert len(lru) <= capacity
                assert max_bytes is None or lru.bytes <= max_bytes
            elif op < 0.9:
                lru.get(key)
            else:
                lru.peek(key)
            assert lru.bytes == sum(v for v in lru._data.values())


# --- gateway/features/budgets.py ---------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
async def test_byte_budget_holds_at_most_its_limit_unless_one_holder_holds_it_all(seed: int) -> None:
    """budgets.py, ``ByteBudget``: "Invariant: ``held <= limit`` unless one holder holds it all",
    through ``try_acquire`` as through ``acquire``; ``release`` never waits."""
    rng = random.Random(seed)
    budget = ByteBudget(100)
    holds: list[int] = []  # what each holder holds now
    waiting: list[asyncio.Task[None]] = []

    async def acquire(n: int) -> None:
        await budget.acquire(n)
        holds.append(n)

    def check() -> None:
        assert budget.held == sum(holds)
        assert budget.held <= budget.limit or len(holds) == 1

    for _ in range(300):
        op = rng.random()
        n = rng.choice([rng.randrange(1, 60), rng.randrange(60, 250)])
        if op < 0.4:
            if budget.try_acquire(n):
                holds.append(n)
        elif op < 0.6:
            waiting.append(asyncio.get_running_loop().create_task(acquire(n)))
        elif holds:
            budget.release(holds.pop(rng.randrange(len(holds))))  # returns at once
        await asyncio.sleep(0)  # the woken waiters take their turn
        check()
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


# --- gateway/features/memo_cache.py ------------------------------------------------------------


def test_a_read_only_memo_counts_refreshes_and_keeps_nothing() -> None:
    """memo_cache.py, ``read_only``: "entries are read without counting or refreshing them, and
    nothing is kept"."""
    memo = MemoCache(10 * 1024)
    memo.put("a", "A", 500)
    memo.put("b", "B", 500)
    with memo.read_only():
        assert memo.get("a") == "A" and memo.get("missing") is None
        memo.put("c", "C", 500)
        assert memo.text(("t", 1), lambda: "rendered") == "rendered"
    assert (memo.hits, memo.misses, len(memo), memo.bytes) == (0, 0, 2, 1000)
    assert list(memo._lru._data) == ["a", "b"]  # "a" was not refreshed
    assert memo.get("c") is None and memo.get(("t", 1)) is None


# --- gateway/features/model_registry.py, char_blocks.py, prompt.py -----------------------------


def test_a_tokenizer_folder_shared_by_two_models_is_loaded_once() -> None:
    """model_registry.py: "a tokenizer folder shared by several models (without a chat template
    override) is loaded once"."""
    models = [ModelConfig(name=n, tokenizer=TINY, block_size=16) for n in ("a", "b")]
    registry = ModelRegistry(models, BoundedLRU(10), remote_available=False)
    a, b = registry.resolve("a").model.local, registry.resolve("b").model.local
    assert a is not None and a is b


@pytest.mark.parametrize("seed", SEEDS)
def test_character_keys_are_in_a_namespace_of_their_own(seed: int) -> None:
    """char_blocks.py: "character keys never equal a token key the agents report" (their root is
    the token root's namespace with a ``\\x00chars`` suffix): the same numbers keyed as
    characters and as tokens share no key."""
    rng = random.Random(seed)
    for _ in range(20):
        model = rng.choice(["m", "llama", "qwen"])
        lora = rng.choice([None, "adapter"])
        salt = rng.choice([None, "s1"])
        assert char_root_key(model, lora, salt) != root_key(model, lora, salt)
        text = "".join(chr(rng.randrange(32, 1000)) for _ in range(rng.randrange(16, 200)))
        as_chars = char_block_keys(text, 16, model, lora, salt)
        codes = np.asarray([ord(c) for c in text], dtype=np.uint32)
        assert as_chars and not set(as_chars) & set(block_keys(codes, 16, model, lora, salt))


def test_read_prompt_touches_only_the_memo_and_nothing_under_read_only() -> None:
    """prompt.py: ``read_prompt``'s only side effect is the memo keeping a rendering, and under
    ``read_only`` (how ``/admin/explain`` reads) it has none (found false as first worded: "it
    has no side effect")."""
    memo = MemoCache(1 << 20)
    models = [ModelConfig(name="tiny", tokenizer=TINY, block_size=16)]
    registry = ModelRegistry(models, BoundedLRU(10), remote_available=False, memo=memo)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
    with memo.read_only():
        first = read_prompt(request_of("chat", body), registry)
    assert (len(memo), memo.misses) == (0, 0)
    assert read_prompt(request_of("chat", body), registry) == first
    assert (len(memo), memo.misses) == (1, 1)


# --- gateway/prediction_audit.py ---------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_an_sse_tail_holds_at_most_twice_its_limit_and_at_least_the_last_limit(seed: int) -> None:
    """prediction_audit.py, ``SseTail``: "at most ``2 * limit`` held, at least the last ``limit``
    kept" (and what it holds is the stream's last bytes)."""
    rng = random.Random(seed)
    for _ in range(10):
        limit = rng.randrange(1, 300)
        first = rng.randbytes(rng.randrange(0, 3 * limit))
        stream = bytearray(first)
        tail = SseTail(first, limit)
        for _ in range(100):
            chunk = rng.randbytes(
                rng.choice([0, 1, rng.randrange(1, limit + 1), rng.randrange(limit, 3 * limit)])
            )
            tail.feed(chunk)
            stream += chunk
            held = tail.value()
            assert len(held) <= 2 * limit
            assert len(held) >= min(limit, len(stream))
            assert bytes(stream).endswith(held)


OVER_CAUSES = {"concurrent_not_stored", "evicted", "tokenization", "stale_index"}
UNDER_CAUSES = {"eviction_estimate", "deferred_encode", "not_yet_reported", "stale_index", "tokenization"}


@pytest.mark.parametrize("seed", SEEDS)
def test_every_inexact_prediction_gets_one_cause_of_its_direction(seed: int) -> None:
    """prediction_audit.py: "Every inexact prediction is explained by one cause": character-block
    features by ``approximate_features``, an over-prediction (P > R) by one of the over-predicted
    causes, an under-prediction (P < R) by one of the under-predicted ones."""
    rng = random.Random(seed)
    bs = 4
    keys = list(range(1000, 1012))
    for _ in range(300):
        index = PrefixIndex()
        index.add_replica("r")
        index.store("r", keys[: rng.randrange(len(keys) + 1)])
        at = IndexAtDispatch(rng.randrange(8), index.removed_count("r"), rng.choice([0, 0, 2]))
        if rng.random() < 0.3:
            index.remove("r", keys[rng.randrange(len(keys)) :])
        predicted, reported = rng.randrange(0, 64), rng.randrange(0, 64)
        if predicted == reported:
            continue
        kind = rng.choice(["exact", "deferred", "approximate"])
        full = [*keys, 7, 8] if kind == "deferred" and rng.random() < 0.5 else None
        case = AuditCase(
            keys[: rng.randrange(len(keys) + 1)],
            bs,
            predicted,
            reported,
            at,
            kind,  # type: ignore[arg-type]
            full,
            rng.choice([None, 40]) if kind == "exact" else None,
            rng.choice([None, 40, 41]),
            rng.random() < 0.3,
        )
        cause = inexact_cause(index, "r", case)
        if kind == "approximate":
            assert cause == "approximate_features"
        else:
            assert cause in (OVER_CAUSES if predicted > reported else UNDER_CAUSES), (case, cause)


# --- gateway/rate_limit.py, gateway/api_keys.py, gateway/agent_credentials.py ------------------


async def _ok(_request: web.Request) -> web.StreamResponse:
    return web.Response(text="ok")


@pytest.mark.parametrize("seed", SEEDS)
async def test_only_authenticated_keys_get_a_bucket_and_metrics_name_no_key(seed: int) -> None:
    """rate_limit.py: "a key is never tracked unless it was authenticated first"; api_keys.py:
    "metrics are labelled by reason only, never by key"; every refusal is 401 ``invalid_api_key``
    with ``WWW-Authenticate: Bearer`` or 429 ``rate_limit_exceeded`` with ``Retry-After``."""
    rng = random.Random(seed)
    good = [f"sk-good-{i}" for i in range(3)]
    keys = ApiKeys.of(ApiKeysConfig(env="K"), {"K": ",".join(good)})
    assert keys is not None
    now = [0.0]
    buckets = TokenBuckets(1.0, 2, max_keys=len(keys.ids), clock=lambda: now[0])
    registry = CollectorRegistry()
    auth = ApiAuth(keys, buckets, ApiAuthMetrics(registry, len(keys.ids)))
    tracked: set[str] = set()
    for _ in range(100):
        now[0] += rng.random()
        presented = rng.choice([*good, "sk-bad", "", None, "Basic x"])
        headers = {} if presented is None else {"Authorization": f"Bearer {presented}"}
        if presented == "Basic x":
            headers = {"Authorization": "Basic x"}
        resp = await auth.middleware(make_mocked_request("POST", "/v1/completions", headers=headers), _ok)
        if presented in good:
            tracked.add(key_id(token_digest(presented)))
            assert resp.status in (200, 429)
        else:
            assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
            assert b'"invalid_api_key"' in resp.body  # type: ignore[attr-defined]
        if resp.status == 429:
            assert int(resp.headers["Retry-After"]) >= 1
            assert b'"rate_limit_exceeded"' in resp.body  # type: ignore[attr-defined]
        assert set(buckets._buckets) == tracked and len(buckets) <= buckets.max_keys
    assert all(kid.startswith("key-") and len(kid) == 12 for kid in tracked)
    for metric in registry.collect():
        for sample in metric.samples:
            assert set(sample.labels) <= {"reason"}, sample
            assert not any(kid in str(sample) or "sk-" in str(sample) for kid in tracked)


def test_agent_tokens_are_kept_only_as_digests() -> None:
    """agent_credentials.py: "Tokens are kept only as SHA-256 digests"."""
    tokens = {"S": "shared-token", "T0": "token-of-r0", "T1": "token-of-r1"}
    auth = AuthConfig(agent_token_env="S", agent_tokens={"r0": "T0", "r1": "T1"})
    creds = credentials_of(auth, tokens)
    assert creds.shared == token_digest("shared-token")
    assert set(creds.per_replica) == {token_digest("token-of-r0"), token_digest("token-of-r1")}
    held = repr(creds).encode()
    assert not any(t.encode() in held or t.encode().hex() in repr(creds) for t in tokens.values())


@pytest.mark.parametrize("suffix", ["/", "", "?x=1", "#f", "/v1", "/?x=1"])
def test_a_url_with_a_path_query_or_fragment_is_never_a_replicas_base_url(suffix: str) -> None:
    """agent_credentials.py, ``_url_parts``: "a URL with user info, a path, a query or a fragment
    is never a replica's base URL" (refused whatever the rules allow)."""
    rules = RegistrationRules.of(RegistrationConfig(allowed_urls=["http://*:*"], allowed_cidrs=["0.0.0.0/0"]))
    refused = rules.refusal("agent-registered", "http://10.0.0.5:8000" + suffix) is not None
    assert refused is (suffix not in ("/", ""))
    assert rules.refusal("agent-registered", "http://user@10.0.0.5:8000") is not None


# --- gateway/asyncio_tasks.py ------------------------------------------------------------------


async def test_cancel_and_wait_swallows_the_cancellation_and_propagates_any_other_error() -> None:
    """asyncio_tasks.py, ``cancel_and_wait``: returns once ``task`` has finished, "its
    ``CancelledError`` swallowed (an error it raised instead propagates)"; None: nothing."""
    await cancel_and_wait(None)
    ended: list[str] = []

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("forever")

    async def fails_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ValueError("cleanup failed") from None

    task = asyncio.get_running_loop().create_task(forever())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.done() and task.cancelled() and ended == ["forever"]
    bad = asyncio.get_running_loop().create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="cleanup failed"):
        await cancel_and_wait(bad)
    assert bad.done()
