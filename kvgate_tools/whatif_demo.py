"""``make whatif-demo``: the operator loop end to end on this machine (docs/operators.md).

1. A live fleet (kvgate_tools/local_fleet.py: sim-engines publishing real KV events, an agent
   beside each, the gateway) records its own traffic (``operator.trace``) while the seeded agent
   workload (long gaps between turns, several tenants) is replayed over HTTP.
2. The engines' own counters give the live hit rate (``vllm:prefix_cache_hits_total`` /
   ``..._queries_total``); ``GET /admin/report`` gives savings, cache lifetime and eviction misses.
3. ``kvgate whatif`` logic replays the recorded trace in the simulator against the same fleet
   (replicas, cache blocks, the engines' profile and time scale, the prefill speed the gateway
   measured) and 2x replicas, 2x cache and another policy.

Writes ``out/whatif.json`` (the figures below and the what-if rows), ``out/whatif.png``,
``out/whatif-report.txt`` (``kvgate report``'s tables) and ``out/whatif-trace.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from gateway.report_cli import render
from kvgate_tools.demo import engine_hit_counters, percentile
from kvgate_tools.demo_workload import AgentWorkloadSpec, agent_sessions
from kvgate_tools.local_fleet import FleetOptions, LocalFleet, http_json
from kvgate_tools.operator_replay import replay_sessions
from router_policies.flags import options_from_flags
from router_policies.sim.simulator import prepare
from router_policies.sim.traces import load_trace
from router_policies.sim.whatif import FleetModel, engine_of, format_table, variations, whatif, write_plot

# Example prices (USD per million input tokens, fresh / cached): DeepSeek-V3's published API
# prices as written down on 2026-12-01 (kvgate issue 16); the demo's model is priced like it.
PRICE_IN, PRICE_CACHED = 0.27, 0.07
WITHIN_POINTS = 0.05


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--cache-blocks", type=int, default=384, help="KV blocks per engine (default 384)")
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--think-s", type=float, default=4.0, help="mean gap between a session's turns")
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out"))


def live_run(args: argparse.Namespace, trace_path: Path) -> dict[str, Any]:
    operator = {
        "trace": {"enabled": True, "path": str(trace_path), "reorder_window_s": 1.0},
        "prices": {"kvgate-tiny": {"input": PRICE_IN, "cached_input": PRICE_CACHED,
                                   "source": "DeepSeek-V3 API prices, written down 2026-12-01"}},
    }  # fmt: skip
    fleet_flags = ("replicas", "cache_blocks", "profile", "time_scale", "seed")
    extra = {"operator": operator}
    opts = options_from_flags(
        FleetOptions, args, fleet_flags, extra_config=extra, log_dir=args.out / "whatif-logs"
    )
    spec = AgentWorkloadSpec(sessions=args.sessions, think_time_mean_s=args.think_s, seed=args.seed)
    sessions = agent_sessions(opts.model, spec)
    with LocalFleet(opts) as fleet:
        print(f"whatif-demo: live fleet of {args.replicas} engines x {args.cache_blocks} blocks, replaying "
              f"{sum(len(s.turns) for s in sessions)} turns of {len(sessions)} sessions ...", flush=True)  # fmt: skip
        result = asyncio.run(replay_sessions(fleet.gateway_url, sessions))
        hits = queries = 0.0
        for i in range(len(fleet.engines)):
            h, q = engine_hit_counters(fleet.engine_metrics(i))
            hits, queries = hits + h, queries + q
        http_json(f"{fleet.gateway_url}/admin/trace", {"enabled": False}, headers=fleet.admin_headers)
        report = http_json(f"{fleet.gateway_url}/admin/report", headers=fleet.admin_headers)
    return {"result": result, "hits": hits, "queries": queries, "report": report}


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.out / "whatif-trace.jsonl"
    for old in args.out.glob("whatif-trace.jsonl*"):
        old.unlink()
    live = live_run(args, trace_path)
    report, result = live["report"], live["result"]
    buf = io.StringIO()
    render(report, buf)
    (args.out / "whatif-report.txt").write_text(buf.getvalue())
    print(buf.getvalue())

    trace = load_trace(trace_path)
    speeds = [v for v in report["savings"]["prefill_s_per_token"].values() if v is not None]
    measured_ms_per_1k = statistics.median(speeds) * 1e6 if speeds else None
    engine = engine_of(args.profile, trace.block_size, args.cache_blocks, args.time_scale, measured_ms_per_1k)
    fleet = FleetModel(args.replicas, engine, "kv_aware", {})
    rows = whatif(
        prepare(trace), fleet, variations("2x-replicas,2x-cache,policy=least_loaded", fleet), args.seed
    )
    print(format_table(rows))
    write_plot(
        str(args.out / "whatif.png"), rows, f"what-if on the recorded trace ({len(trace.requests)} requests)"
    )

    live_rate = live["hits"] / live["queries"] if live["queries"] else 0.0
    same = rows[0]["hit_rate"]
    turns = report["turns"]["all"]
    doc = {
        "live_hit_rate": round(live_rate, 6),
        "whatif_same_fleet_hit_rate": same,
        "hit_rate_gap_points": round(100 * (same - live_rate), 3),
        "within_5_points": abs(same - live_rate) <= WITHIN_POINTS,
        "eviction_miss_share": turns["eviction_miss_share"],
        "eviction_miss_share_engine": turns["engine_miss_share"],
        "savings_usd": report["savings"]["totals"]["saved_usd"],
        "expected_savings_usd": live["hits"] * (PRICE_IN - PRICE_CACHED) / 1e6,
        "engine_cached_tokens": live["hits"],
        "engine_prompt_tokens": live["queries"],
        "live_ttft_p50_ms": round(1000 * percentile(result.ttft_s, 0.5), 3),
        "live_ttft_p99_ms": round(1000 * percentile(result.ttft_s, 0.99), 3),
        "requests": result.requests,
        "errors": result.errors,
        "recorded_lines": len(trace.requests),
        "measured_prefill_ms_per_1k_tokens": measured_ms_per_1k,
        "profile_prefill_ms_per_1k_tokens": engine_of(
            args.profile, 16, 1, args.time_scale, None
        ).costs.prefill_s_per_token
        * 1e6,
        "turns": turns,
        "rows": rows,
        "config": {
            "replicas": args.replicas,
            "cache_blocks": args.cache_blocks,
            "sessions": args.sessions,
            "think_s": args.think_s,
            "profile": args.profile,
            "time_scale": args.time_scale,
            "seed": args.seed,
        },
    }
    (args.out / "whatif.json").write_text(json.dumps(doc, indent=2) + "\n")
    shutil.rmtree(args.out / "whatif-logs", ignore_errors=True)
    print(f"\nlive hit rate {live_rate:.4f}, simulated same fleet {same:.4f} "
          f"({doc['hit_rate_gap_points']:+.2f} points); eviction-miss share {turns['eviction_miss_share']} "
          f"(engine {turns['engine_miss_share']}); saved {doc['savings_usd']:.6f} USD "
          f"(expected {doc['expected_savings_usd']:.6f})\nwrote {args.out / 'whatif.json'}")  # fmt: skip
    return 0 if result.errors == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="whatif-demo")
    configure(parser)
    sys.exit(run(parser.parse_args()))
