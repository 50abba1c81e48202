"""``kvgate whatif``: replay a recorded trace (the gateway's own, gateway/trace_recorder.py) in the
simulator against the current fleet and the variations an operator asks about (docs/operators.md,
"What-if").

    kvgate whatif --trace recorded.jsonl --replicas 4 --cache-blocks 2048 [--profile NAME]
        [--time-scale S] [--prefill-ms-per-1k T] [--policy kv_aware[...]]
        [--vary 2x-replicas,2x-cache,policy=least_loaded] [--ttft-p99-target-ms MS]
        [--json OUT] [--plot OUT.png]

Every scenario runs the same simulator as ``kvgate compare`` (router_policies/sim/simulator.py:
the gateway's policies and placement code over replica models) at the trace's *recorded* arrival
times, not rescaled: the question is what this traffic would have met. The current fleet is
``--replicas`` x ``--cache-blocks`` with the engine profile ``--profile``; its step costs are
multiplied by ``--time-scale`` (the sim-engine's flag of the same name) and, when
``--prefill-ms-per-1k`` is given (the gateway report's measured prefill speed), the prefill cost
per token is set to it. Variations: ``Nx-replicas``, ``Nx-cache``, ``policy=NAME[params]``.
With ``--ttft-p99-target-ms``, the fewest replicas (up to 4x the current fleet) whose simulated
TTFT p99 meets the target are searched for and reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router_policies.errors import UserInputError
from router_policies.sim.compare_cli import parse_policies
from router_policies.sim.profiles import DEFAULT_PROFILE, PROFILES, get_profile
from router_policies.sim.replica_model import EngineConfig, StepCosts
from router_policies.sim.simulator import PreparedTrace, SimFleet, prepare, simulate
from router_policies.sim.traces import load_trace

DEFAULT_VARIATIONS = "2x-replicas,2x-cache"
_SCALE = re.compile(r"^(\d+(?:\.\d+)?)x-(replicas|cache)$")
MAX_TARGET_FACTOR = 4


@dataclass(frozen=True, slots=True)
class Scenario:
    label: str
    replicas: int
    cache_blocks: int
    policy: str
    params: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class FleetModel:
    """The current fleet as the simulator models it."""

    replicas: int
    engine: EngineConfig
    policy: str
    params: Mapping[str, Any]

    def baseline(self) -> Scenario:
        return Scenario("current fleet", self.replicas, self.engine.num_blocks, self.policy, self.params)


def engine_of(
    profile: str, block_size: int, cache_blocks: int, time_scale: float, prefill_ms_per_1k: float | None
) -> EngineConfig:
    base = get_profile(profile).engine_config(block_size, cache_blocks)
    c = base.costs
    s = time_scale
    costs = StepCosts(
        step_overhead_s=c.step_overhead_s * s,
        prefill_s_per_token=c.prefill_s_per_token * s
        if prefill_ms_per_1k is None
        else prefill_ms_per_1k / 1e6,
        prefill_s_per_token_ctx=c.prefill_s_per_token_ctx * s,
        decode_s_per_seq=c.decode_s_per_seq * s,
        decode_s_per_ctx_token=c.decode_s_per_ctx_token * s,
    )
    return dataclasses.replace(base, costs=costs)


def variations(text: str, fleet: FleetModel) -> list[Scenario]:
    out: list[Scenario] = []
    base = fleet.baseline()
    for part in [p.strip() for p in text.split(",") if p.strip()] if text else []:
        m = _SCALE.match(part)
        if m:
            f = float(m.group(1))
            if f <= 0:
                raise UserInputError(f"--vary: {part}: the factor must be positive")
            if m.group(2) == "replicas":
                out.append(dataclasses.replace(base, label=part, replicas=max(1, round(base.replicas * f))))
            else:
                out.append(
                    dataclasses.replace(base, label=part, cache_blocks=max(1, round(base.cache_blocks * f)))
                )
        elif part.startswith("policy="):
            ((name, params),) = parse_policies(part.removeprefix("policy="))
            out.append(dataclasses.replace(base, label=part, policy=name, params=params))
        else:
            raise UserInputError(
                f"--vary: unknown variation {part!r} (Nx-replicas, Nx-cache, policy=NAME[...])"
            )
    return out


def run_scenario(prep: PreparedTrace, fleet: FleetModel, sc: Scenario, seed: int) -> dict[str, Any]:
    engine = dataclasses.replace(fleet.engine, num_blocks=sc.cache_blocks)
    fleet_sim = SimFleet(replicas=sc.replicas, engine=engine, seed=seed)
    res = simulate(prep, fleet_sim, (sc.policy, dict(sc.params)), 1.0, prep.arrival_s)
    return {
        "scenario": sc.label,
        "replicas": sc.replicas,
        "cache_blocks": sc.cache_blocks,
        "policy": sc.policy,
        "params": dict(sc.params),
        "hit_rate": round(res.hit_rate, 6),
        "ttft_p50_ms": round(res.ttft_p50_ms, 3),
        "ttft_p99_ms": round(res.ttft_p99_ms, 3),
        "throughput_rps": round(res.throughput_rps, 6),
        "preemptions": res.preemptions,
    }


def replicas_for_target(
    prep: PreparedTrace, fleet: FleetModel, target_ms: float, seed: int
) -> dict[str, Any]:
    """The fewest replicas (1 .. 4x the fleet) whose TTFT p99 meets ``target_ms``: TTFT falls as
    replicas are added, so a binary search over the count."""
    lo, hi = 1, MAX_TARGET_FACTOR * fleet.replicas
    base = fleet.baseline()
    found: dict[str, Any] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        row = run_scenario(
            prep, fleet, dataclasses.replace(base, label=f"{mid} replicas", replicas=mid), seed
        )
        if row["ttft_p99_ms"] <= target_ms:
            found, hi = row, mid - 1
        else:
            lo = mid + 1
    return {"ttft_p99_target_ms": target_ms, "replicas": found["replicas"] if found else None, "row": found}


def whatif(
    prep: PreparedTrace, fleet: FleetModel, scenarios: Sequence[Scenario], seed: int
) -> list[dict[str, Any]]:
    return [run_scenario(prep, fleet, sc, seed) for sc in [fleet.baseline(), *scenarios]]


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = f"{'scenario':<28} {'replicas':>8} {'cache blk':>9} {'policy':<16} {'hit rate':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['scenario']:<28} {r['replicas']:>8} {r['cache_blocks']:>9} {r['policy']:<16} "
            f"{r['hit_rate']:>8.4f} {r['ttft_p50_ms']:>12.1f} {r['ttft_p99_ms']:>12.1f}"
        )
    return "\n".join(lines)


def write_plot(path: str, rows: Sequence[Mapping[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["scenario"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].bar(labels, [r["hit_rate"] for r in rows], color="tab:blue")
    axes[0].set_title("prefix hit rate (tokens)")
    axes[0].set_ylim(0, 1)
    x = range(len(rows))
    axes[1].bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], width=0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in rows], width=0.4, label="p99")
    axes[1].set_xticks(list(x), labels)
    axes[1].set_title("TTFT (ms)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def configure(p: argparse.ArgumentParser) -> None:
    p.description = "Replay a recorded trace against the current fleet and variations in the simulator."
    p.add_argument(
        "--trace", required=True, metavar="FILE", help="a Mooncake-format trace (the gateway's recording)"
    )
    p.add_argument(
        "--gateway",
        metavar="URL",
        help="read the current fleet's replica count and measured "
        "prefill speed from this gateway's /admin endpoints (token from $KVGATE_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--replicas", type=int, help="replicas of the current fleet (default: the gateway's healthy ones)"
    )
    p.add_argument(
        "--cache-blocks", type=int, help="KV blocks per replica (default: the profile's KV / block size)"
    )
    p.add_argument(
        "--profile", default=DEFAULT_PROFILE, help=f"engine cost preset: {', '.join(sorted(PROFILES))}"
    )
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="multiplies the profile's step costs (default 1)"
    )
    p.add_argument(
        "--prefill-ms-per-1k", type=float, help="measured prefill time per 1k computed tokens (ms)"
    )
    p.add_argument(
        "--policy", default="kv_aware", help="the fleet's policy, name[key=value,...] (default kv_aware)"
    )
    p.add_argument("--vary", default=DEFAULT_VARIATIONS, help=f"variations (default {DEFAULT_VARIATIONS})")
    p.add_argument("--ttft-p99-target-ms", type=float, help="also find the replicas needed for this TTFT p99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the rows as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write a plot of hit rate and TTFT p50/p99")


def from_gateway(args: argparse.Namespace) -> None:
    """Fill ``--replicas`` and ``--prefill-ms-per-1k`` left unset from a live gateway: its healthy
    replicas, and the median of the prefill speeds it measured."""
    from gateway.report_cli import fetch_report

    token = os.environ.get("KVGATE_ADMIN_TOKEN") or None
    if args.replicas is None:
        reps = fetch_report(args.gateway, token, "/admin/replicas")["replicas"]
        args.replicas = sum(1 for r in reps if r.get("healthy"))
    if args.prefill_ms_per_1k is None:
        speeds = [
            v for v in fetch_report(args.gateway, token)["savings"]["prefill_s_per_token"].values() if v
        ]
        args.prefill_ms_per_1k = statistics.median(speeds) * 1e6 if speeds else None


def fleet_of(args: argparse.Namespace, block_size: int) -> FleetModel:
    if args.gateway:
        from_gateway(args)
    if args.replicas is None:
        raise UserInputError("--replicas is needed (or --gateway URL to read it from a gateway)")
    if args.replicas <= 0 or (args.cache_blocks is not None and args.cache_blocks <= 0):
        raise UserInputError("--replicas and --cache-blocks must be positive")
    if not args.time_scale > 0:
        raise UserInputError("--time-scale must be positive")
    ((policy, params),) = parse_policies(args.policy)
    engine = engine_of(args.profile, block_size, args.cache_blocks, args.time_scale, args.prefill_ms_per_1k)
    return FleetModel(args.replicas, engine, policy, params)


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    fleet = fleet_of(args, trace.block_size)
    prep = prepare(trace)
    rows = whatif(prep, fleet, variations(args.vary, fleet), args.seed)
    print(
        f"trace {trace.name}: {len(trace.requests)} requests at their recorded times, block size {trace.block_size}"
    )
    print(format_table(rows))
    doc: dict[str, Any] = {"rows": rows, "config": {"trace": args.trace, "profile": args.profile,
                                                   "time_scale": args.time_scale, "seed": args.seed}}  # fmt: skip
    if args.ttft_p99_target_ms is not None:
        doc["target"] = replicas_for_target(prep, fleet, args.ttft_p99_target_ms, args.seed)
        n = doc["target"]["replicas"]
        print(
            f"replicas for TTFT p99 <= {args.ttft_p99_target_ms:g} ms: {n if n else f'more than {MAX_TARGET_FACTOR * fleet.replicas}'}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, rows, f"what-if on {trace.name}")
        print(f"wrote {args.plot}")
    return 0
