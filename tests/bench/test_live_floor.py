"""The live bench's TTFT floor (``bench/live_floor.py``): each request alone on one idle engine
whose cache keeps everything, so a prompt sent before is a cache hit there. Real processes: one
sim-engine over HTTP."""

from __future__ import annotations

import argparse
from pathlib import Path

import uvloop

from bench import live_fleet, live_floor, live_pool
from bench.live_workloads import load, render, working_set_blocks, workload
from kvgate_tools.procs import ProcessGroup


def test_a_prompt_sent_again_is_served_from_the_cache(tmp_path: Path) -> None:
    """The floor's premise: every earlier prompt is cached. The second sending of a long prompt
    prefills nothing (one block at most) and so is faster than its first, on the same idle engine."""
    w = workload("agent", Path("unused"))
    reqs = render(load(w, 6, seed=1), w, 6, max_blocks=48, max_tokens=1)
    prompt = max((p for _t, p, _n in reqs), key=len)
    args = argparse.Namespace(time_scale=1.0, cache_blocks=4096)
    with ProcessGroup(tmp_path) as procs:
        ((url, _ev, _rp),) = live_fleet.start_fleet(procs, 1, args)
        first, again = uvloop.run(live_floor.sequential_ttfts(url, [prompt, prompt], 60.0))
    assert 0 < again < first


def test_the_floors_engine_is_of_the_fleets_fastest_kind_and_never_evicts() -> None:
    w = workload("hetero", Path("unused"))  # every other engine 3x slower
    reqs = render(load(w, 40, seed=1), w, 40, max_blocks=48, max_tokens=1)
    fastest, cache_blocks = live_floor.floor_fleet(w, reqs)
    assert w.slowdowns == (1.0, 3.0) and fastest.slowdowns == (1.0,)
    working_set, largest = working_set_blocks(reqs)
    assert cache_blocks >= working_set + largest  # every prompt's blocks and one more in flight


def test_floor_run_gives_every_request_its_floor_and_the_pool_both_quantiles(tmp_path: Path) -> None:
    w = workload("agent", Path("unused"))
    reqs = render(load(w, 12, seed=1), w, 12, max_blocks=48, max_tokens=1)
    args = argparse.Namespace(time_scale=0.25, cache_blocks=64, timeout=60.0)
    got = live_floor.floor_run(w, reqs, args, tmp_path)
    assert len(got) == 12 and min(got) > 0  # sequential_ttfts raises on a request without a first token
    pooled = live_pool.pooled_floor([got, [2 * t for t in got]])
    assert set(pooled) == {"floor_ttft_p50_ms", "floor_ttft_p99_ms"}
    assert pooled["floor_ttft_p99_ms"] > max(got)  # the second seed's slower requests are in the pool


def test_the_fleet_lru_floors_engine_holds_the_fleets_blocks_and_no_more(tmp_path: Path) -> None:
    """``--lru-floor``: the same replay on an engine whose cache is the fleet's KV in all (it
    evicts, LRU), not the never-evicting floor's."""
    w = workload("agent", Path("unused"))
    reqs = render(load(w, 4, seed=1), w, 4, max_blocks=48, max_tokens=1)
    args = argparse.Namespace(time_scale=0.25, cache_blocks=64, timeout=60.0)
    got = live_floor.floor_run(w, reqs, args, tmp_path, fleet_blocks=4 * 64)
    assert len(got) == 4 and min(got) > 0
    started = (tmp_path / "engine0.log").read_text()
    assert "cache_blocks=256 " in started, started
    assert live_floor.floor_fleet(w, reqs)[1] != 256  # not what the floor itself would have used
