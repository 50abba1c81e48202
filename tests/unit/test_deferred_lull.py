"""A lull before each whole deferred job (gateway/features/deferred.py): the worker starts a job's
remaining text only once no request has arrived for ``quiet_s``, and drops it unencoded once it
has waited ``max_wait_s`` without one; heads and takeovers are not held; the featurizer reports
every request it featurizes as an arrival, with the config's times."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

from gateway.config_http import ProxyConfig
from gateway.features.budgets import DeferredLimits
from gateway.features.deferred import DeferredEncodes
from gateway.features.featurizer import encode_settings
from gateway.features.segment_encoder import SegmentEncoder
from gateway.request import request_of
from tests.unit.test_features_deferred import chat, closing, make, text
from tests.unit.test_features_heads_first import SEP, _job, spied_encoder


async def _watch(seen: list[str], stamps: dict[str, float], texts: list[str], until: asyncio.Event) -> None:
    """Note when each of ``texts`` first reaches the encoder (polled every millisecond)."""
    loop = asyncio.get_running_loop()
    while not until.is_set():
        for t in texts:
            if t not in stamps and any(t in s for s in seen):
                stamps[t] = loop.time()
        await asyncio.sleep(0.001)


async def _arrivals(d: DeferredEncodes, seconds: float, every: float = 0.005) -> float:
    """Report an arrival every ``every`` s for ``seconds``; returns the last one's loop time."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    last = loop.time()
    while loop.time() < end:
        d.arrival()
        last = loop.time()
        await asyncio.sleep(every)
    return last


@contextlib.asynccontextmanager
async def _watched(
    lull: tuple[float, float], texts: list[str]
) -> AsyncIterator[tuple[SegmentEncoder, DeferredEncodes, dict[str, float]]]:
    """An encoder over the tiny tokenizer, deferred encodes on the event loop with ``lull``, and
    when each of ``texts`` first reached the encoder (event-loop time), until the block ends."""
    enc, seen = spied_encoder()
    d = DeferredEncodes(DeferredLimits(1_000_000, None, *lull), lambda: None)
    stamps: dict[str, float] = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(seen, stamps, texts, stop))
    try:
        yield enc, d, stamps
    finally:
        stop.set()
        await watcher
        await d.close()


async def test_a_whole_job_waits_until_arrivals_pause() -> None:
    """Arrivals every 5 ms for 0.3 s: the job (submitted first) is not encoded meanwhile, and
    starts no sooner than ``quiet_s`` after the last one."""
    body = text(1, 150)
    async with _watched((0.05, 10.0), [body]) as (enc, d, stamps):
        d.arrival()
        d.submit(_job(enc, body, 1))
        last = await _arrivals(d, 0.3)
        assert body not in stamps and d.encoded == 0 and d.lulls >= 1
        async with asyncio.timeout(10):
            await d.drain()
        await asyncio.sleep(0.005)
        assert d.encoded == 1 and stamps[body] >= last + 0.05


async def test_a_job_no_lull_reaches_within_max_wait_is_not_encoded() -> None:
    """Arrivals never pause for ``quiet_s`` (0.1 s) in 0.7 s: the first job, submitted at the
    start, is dropped unencoded once it has waited ``max_wait_s`` (0.3 s; no segment cached, no
    keys recorded, the backlog empty of it), while a job submitted at 0.6 s is encoded in the lull
    after them (0.8 s, before its own 0.9 s)."""
    early, late = text(2, 150), text(7, 150)
    async with _watched((0.1, 0.3), [early, late]) as (enc, d, stamps):
        keys: list[list[int]] = []
        first = _job(enc, early, 2)
        first.on_keys = keys.append  # as the proxy, once routed
        d.arrival()
        d.submit(first)
        arrivals = asyncio.create_task(_arrivals(d, 0.7))
        await asyncio.sleep(0.6)
        assert d.expired == 1 and d.encoded == 0 and not d.pending(2) and d.queued_chars == 0
        second = _job(enc, late, 7)
        d.submit(second)
        last = await arrivals
        async with asyncio.timeout(10):
            await d.drain()
        await asyncio.sleep(0.005)
        assert early not in stamps and keys == [] and first.finished.is_set()
        assert enc.still_missing(first.plan).missing  # nothing of it cached
        assert d.encoded == 1 and d.expired == 1 and stamps[late] >= last + 0.1
        assert not enc.still_missing(second.plan).missing


async def test_heads_and_takeovers_are_not_held() -> None:
    """Under steady arrivals, a queued job's head (a new system prompt) is encoded at once, and a
    request taking a queued job over gets it encoded at once; a plain job still waits."""
    plain, system, message, taken = text(3, 120), text(4, 120), text(5, 60), text(6, 120)
    async with _watched((0.05, 10.0), [plain, system, message, taken]) as (enc, d, stamps):
        arrivals = asyncio.create_task(_arrivals(d, 0.6))
        try:
            await asyncio.sleep(0.01)
            d.submit(_job(enc, plain, 3))
            d.submit(_job(enc, system + SEP + message, 4))
            d.submit(_job(enc, taken, 5))
            await asyncio.sleep(0.1)
            assert system in stamps and d.heads_first == 1  # the head, at once
            assert plain not in stamps and message not in stamps and taken not in stamps
            async with asyncio.timeout(1):
                await d.expedite(5)  # a request carrying the third job's text
            await asyncio.sleep(0.005)  # (the watcher's turn)
            assert taken in stamps and not arrivals.done()
            assert plain not in stamps and message not in stamps  # still waiting for a lull
            last = await arrivals
            async with asyncio.timeout(10):
                await d.drain()
            await asyncio.sleep(0.005)
            assert min(stamps[plain], stamps[message]) >= last + 0.05 and d.encoded == 3
        finally:
            arrivals.cancel()


async def test_every_request_featurized_is_an_arrival_with_the_configs_lull() -> None:
    """The config's times reach the deferred encodes; ``featurize`` reports each request
    (``explain`` does not: it has no side effect)."""
    s = encode_settings(ProxyConfig(tokenize_defer_quiet_s=0.02, tokenize_defer_max_wait_s=0.3))
    assert (s.defer_quiet_s, s.defer_max_wait_s) == (0.02, 0.3)
    defaults = ProxyConfig()
    assert defaults.tokenize_defer_quiet_s > 0 and defaults.tokenize_defer_max_wait_s > 0
    async with closing(make(defer_quiet_s=0.02, defer_max_wait_s=0.3)) as (fz,):
        d = fz.deferred
        assert (d.limits.quiet_s, d.limits.max_wait_s) == (0.02, 0.3) and d._last_arrival == -math.inf
        await fz.features("chat", chat("hi there"))
        first = d._last_arrival
        assert first > -math.inf
        await asyncio.sleep(0.01)
        await fz.featurize(request_of("chat", chat("an explained request"), None), explain=True)
        assert d._last_arrival == first
        await fz.features("chat", chat("hello again"))
        assert d._last_arrival > first
