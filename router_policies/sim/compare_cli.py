"""``kvgate compare``: replay a trace (or a generated workload) through each policy on N simulated
replicas at several offered loads; print a table, write JSON and a plot.

    kvgate compare --trace FILE | --workload agent|groups [--replicas 8]
        [--policies round_robin,least_loaded,consistent_hash,kv_aware] [--cache-blocks N]
        [--profile NAME] [--loads 0.5,0.8,1.0] [--seed S] [--json OUT] [--plot OUT.png]

Policy parameters go in brackets after a name: ``kv_aware[balance_abs=16,min_match_ratio=0.2]``
(values are JSON numbers / booleans, otherwise strings; validated by the policy's own model).

Loads: a load L replays the trace with its arrival times rescaled so that the offered request
rate is L x the fleet's capacity *without cache hits*: capacity = replicas / (mean engine time a
request costs a saturated replica with no prefix hit; ``simulator.no_cache_service_s``), and
t' = t0 + (t - t0) x natural_rate / (L x capacity). Order and relative spacing are kept. With hits
a policy does less work than that, so L = 1.0 is saturating only for a policy that never hits.

``--cache-blocks`` is per replica (default: the profile's KV capacity / the trace's block size).
The JSON is ``{"oracle_hit_rate", "runs": [{"policy", "load", "hit_rate", "ttft_p50_ms",
"ttft_p99_ms", "throughput_rps", "max_over_mean_load"}], "config": {...}}``; the same command and
seed give byte-identical JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from router_policies.errors import UserInputError
from router_policies.registry import validate_params
from router_policies.sim.profiles import DEFAULT_PROFILE, PROFILES, get_profile
from router_policies.sim.simulator import RunResult, SimFleet, oracle_hit_rate, prepare, run_matrix
from router_policies.sim.traces import Trace, load_trace
from router_policies.sim.workloads import WORKLOADS, generate

DEFAULT_POLICIES = "round_robin,least_loaded,consistent_hash,kv_aware"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Compare routing policies on a trace in the offline simulator."
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="a Mooncake-format JSONL trace")
    src.add_argument("--workload", choices=WORKLOADS, help="a generated workload (seeded by --seed)")
    parser.add_argument("--replicas", default="8", metavar="N", help="simulated replicas (default 8)")
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        metavar="LIST",
        help=f"comma-separated policies, each optionally name[key=value,...] (default {DEFAULT_POLICIES})",
    )
    parser.add_argument(
        "--cache-blocks", metavar="N", help="KV blocks per replica (default: the profile's KV / block size)"
    )
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        metavar="NAME",
        help=f"engine cost preset: {', '.join(sorted(PROFILES))} (default {DEFAULT_PROFILE})",
    )
    parser.add_argument(
        "--loads",
        default="0.5,0.8,1.0",
        metavar="LIST",
        help="offered loads as fractions of the fleet's no-cache capacity (default 0.5,0.8,1.0)",
    )
    parser.add_argument("--seed", default="0", metavar="S", help="seed of policies and workloads (default 0)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="write a plot of hit rate and TTFT p50/p99")


def _positive_int(flag: str, text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise UserInputError(f"{flag}: expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise UserInputError(f"{flag}: expected a positive integer, got {v}")
    return v


def _loads(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise UserInputError(f"--loads: {part.strip()!r} is not a number") from None
        if not (v > 0 and math.isfinite(v)):
            raise UserInputError(f"--loads: expected positive numbers, got {part.strip()}")
        out.append(v)
    if len(set(out)) != len(out):
        raise UserInputError("--loads: a load is listed twice")
    return out


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserInputError(f"--policies: unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise UserInputError(f"--policies: unbalanced '[' in {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_policies(text: str) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for spec in _split_top(text):
        if not spec:
            raise UserInputError(f"--policies: empty policy name in {text!r}")
        name, params = spec, {}
        if "[" in spec:
            if not spec.endswith("]"):
                raise UserInputError(f"--policies: expected name[key=value,...], got {spec!r}")
            name, _, body = spec[:-1].partition("[")
            for item in _split_top(body) if body.strip() else []:
                key, eq, val = item.partition("=")
                if not eq or not key.strip():
                    raise UserInputError(f"--policies: {name}: expected key=value, got {item!r}")
                params[key.strip()] = _value(val.strip())
        validate_params(name, params)  # names the policy and field on error
        out.append((name, params))
    labels = [_label(n, p) for n, p in out]
    if len(set(labels)) != len(labels):
        raise UserInputError("--policies: a policy is listed twice")
    return out


def _label(name: str, params: Mapping[str, Any]) -> str:
    if not params:
        return name
    return name + "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in params.items()) + "]"


class _Progress:
    """A progress bar on stderr when it is a terminal; one line per finished run otherwise."""

    def __init__(self, runs: int) -> None:
        self.runs = runs
        self.done_runs = 0
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.run_t0 = self.t0

    def __call__(self, policy: str, load: float, done: int, total: int) -> None:
        if self.tty:
            frac = (self.done_runs + done / total) / self.runs
            bar = "#" * int(30 * frac)
            sys.stderr.write(
                f"\r[{bar:<30}] run {self.done_runs + 1}/{self.runs} {policy} @ {load:g}: {done}/{total}   "
            )
            sys.stderr.flush()
        if done == total:
            self.done_runs += 1
            now = time.monotonic()
            if self.tty:
                sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.write(
                f"compare: [{self.done_runs}/{self.runs}] {policy} @ load {load:g}: {total} requests "
                f"in {now - self.run_t0:.1f} s\n"
            )
            sys.stderr.flush()
            self.run_t0 = now


def _table(results: Sequence[RunResult], oracle: float, labels: Mapping[int, str]) -> str:
    head = (
        f"{'load':>5}  {'policy':<24} {'hit rate':>8} {'/oracle':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
        f"{'req/s':>8} {'max/mean':>8}"
    )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(results):
        rel = r.hit_rate / oracle if oracle > 0 else float("nan")
        lines.append(
            f"{r.load:>5g}  {labels[i]:<24} {r.hit_rate:>8.4f} {rel:>8.3f} {r.ttft_p50_ms:>12.1f} "
            f"{r.ttft_p99_ms:>12.1f} {r.throughput_rps:>8.3f} {r.max_over_mean_load:>8.3f}"
        )
    return "\n".join(lines)


def write_plot(path: str, doc: Mapping[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    policies = list(dict.fromkeys(r["label"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for pol in policies:
        rs = [r for r in runs if r["label"] == pol]
        loads = [r["load"] for r in rs]
        axes[0].plot(loads, [r["hit_rate"] for r in rs], marker="o", label=pol)
        axes[1].plot(loads, [r["ttft_p50_ms"] for r in rs], marker="o", label=pol)
        axes[2].plot(loads, [r["ttft_p99_ms"] for r in rs], marker="o", label=pol)
    axes[0].axhline(doc["oracle_hit_rate"], color="grey", linestyle="--", label="oracle (shared LRU)")
    axes[0].set_title("prefix hit rate (tokens)")
    axes[1].set_title("TTFT p50 (ms)")
    axes[2].set_title("TTFT p99 (ms)")
    for ax in axes:
        ax.set_xlabel("offered load (fraction of no-cache capacity)")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    top = max([doc["oracle_hit_rate"], *(r["hit_rate"] for r in runs)])
    axes[0].set_ylim(0, min(1.0, top * 1.25) or 1.0)
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _source(args: argparse.Namespace, seed: int) -> Trace:
    if args.trace is not None:
        return load_trace(args.trace)
    return generate(args.workload, seed)


def run(args: argparse.Namespace) -> int:
    replicas = _positive_int("--replicas", args.replicas)
    seed_text = str(args.seed)
    try:
        seed = int(seed_text)
    except ValueError:
        raise UserInputError(f"--seed: expected an integer, got {seed_text!r}") from None
    if seed < 0:
        raise UserInputError(f"--seed: expected a non-negative integer, got {seed}")
    loads = _loads(args.loads)
    policies = parse_policies(args.policies)
    profile = get_profile(args.profile)
    cache_blocks = None if args.cache_blocks is None else _positive_int("--cache-blocks", args.cache_blocks)
    trace = _source(args, seed)
    engine = profile.engine_config(trace.block_size, cache_blocks)
    bs = trace.block_size
    for lineno, r in enumerate(trace.requests, start=1):
        need = -(-(r.input_length + max(1, r.output_length)) // bs)
        if need > engine.num_blocks:
            raise UserInputError(
                f"--cache-blocks: {engine.num_blocks} blocks per replica cannot hold request {lineno} of "
                f"{trace.name} ({r.input_length} + {r.output_length} tokens = {need} blocks of {bs})"
            )
    prep = prepare(trace)
    oracle = oracle_hit_rate(prep, replicas * engine.num_blocks)
    progress = _Progress(len(loads) * len(policies))
    results = run_matrix(prep, SimFleet(replicas, engine, seed), policies, loads, progress)
    labels = {i: _label(*policies[i % len(policies)]) for i in range(len(results))}
    source = f"trace {trace.name}" if args.trace is not None else f"workload {args.workload} (seed {seed})"
    print(
        f"{source}: {len(trace.requests)} requests, block size {bs}; {replicas} replicas x "
        f"{engine.num_blocks} blocks, profile {profile.name}, seed {seed}"
    )
    print(f"oracle hit rate (one shared LRU of {replicas * engine.num_blocks} blocks): {oracle:.4f}")
    print(_table(results, oracle, labels))
    runs = []
    for i, res in enumerate(results):
        row = res.as_json()
        if labels[i] != res.policy:
            row["params"] = policies[i % len(policies)][1]
        runs.append(row)
    doc: dict[str, Any] = {
        "oracle_hit_rate": round(oracle, 6),
        "runs": runs,
        "config": {
            "source": args.trace if args.trace is not None else f"workload:{args.workload}",
            "requests": len(trace.requests),
            "block_size": bs,
            "replicas": replicas,
            "cache_blocks": engine.num_blocks,
            "profile": profile.name,
            "seed": seed,
            "loads": loads,
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plot:
        plot_doc = dict(doc)
        plot_doc["runs"] = [dict(row, label=labels[i]) for i, row in enumerate(runs)]
        write_plot(
            args.plot, plot_doc, f"{source}; {replicas} replicas x {engine.num_blocks} blocks, {profile.name}"
        )
        print(f"wrote {args.plot}")
    return 0
