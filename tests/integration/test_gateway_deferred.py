"""Routing before encoding new text, on real processes: a burst of requests on one new long
document lands on the replica of the first of them (its deferred encode hands that replica the
whole prompt's keys before the others are matched), and the next turn is matched exactly."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from tests.integration.gateway_harness import REPO, Procs, base_config
from tests.polling import wait_until


def _doc(seed: int, words: int) -> str:
    vocab = (REPO / "assets/corpus/stdlib_docstrings.txt").read_text(encoding="utf-8").split()[:4000]
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(words))


async def _burst(url: str, bodies: list[dict[str, object]]) -> list[tuple[str, int]]:
    async with aiohttp.ClientSession() as http:

        async def one(body: dict[str, object]) -> tuple[str, int]:
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
                return resp.headers["x-kvgate-replica"], int(resp.headers["x-kvgate-matched-tokens"])

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def test_a_burst_on_a_new_document_lands_on_one_replica(procs: Procs) -> None:
    backends = [procs.backend(f"r{i}") for i in range(3)]
    gw = procs.gateway(
        base_config(*backends, policy={"name": "kv_aware", "seed": 0}, proxy={"tokenize_defer_chars": 2048})
    )
    wait_until(lambda: all(r["healthy"] for r in gw.replicas().values()), what="replicas healthy")
    doc = _doc(1, 900)  # ~6 KB: routed before it is encoded
    body = {"model": "m", "prompt": doc, "max_tokens": 4}
    results = asyncio.run(_burst(gw.url, [body] * 6))
    replicas = {r for r, _ in results}
    assert len(replicas) == 1, results
    matched = sorted(m for _, m in results)
    assert matched[0] == 0 and all(m > 1000 for m in matched[1:]), matched  # all but the first
    metrics = gw.metrics()
    deferred = [ln for ln in metrics.splitlines() if ln.startswith("kvgate_tokenize_deferred_total")]
    assert deferred and float(deferred[0].split()[-1]) == 1.0
    # a new question on the same document is matched exactly on that replica
    (again,) = asyncio.run(_burst(gw.url, [{**body, "prompt": doc + "\nQuestion: why?"}]))
    assert again[0] in replicas and again[1] > 1000
    # the burst's replica holds the whole document as speculative entries, the others nothing
    _, index = gw.admin("GET", "/admin/index")
    approximate = {r: v["approximate"] for r, v in index["replicas"].items()}
    (chosen,) = replicas
    assert approximate[chosen] > 1000 // 16 and sum(approximate.values()) == approximate[chosen], approximate
