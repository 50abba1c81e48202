"""Turn ``bench/results/{index,overhead,live}.json`` into ``summary.json`` (the headline figures,
exactly the keys of ``SUMMARY_KEYS``), ``table.md`` (every figure) and plots (``*.png``).

Headline figures and how they are taken (conservative where a choice exists):
* ``overhead_p50_ms`` / ``overhead_p99_ms``: kvgate's added latency (kvgate minus direct, same
  percentile), non-streaming, 8 KB prompts, concurrency 32;
* ``rps_per_core_vs_sglang_cache_aware``: kvgate's requests per CPU-second of its process tree
  over sglang-router cache_aware's, same point;
* ``events_per_s_per_core``: the lowest steady-state churn rate over the index runs at the largest
  block count measured; ``match_2048_us_at_10m``: the highest median ``match`` time of a
  2,048-block prompt at 10M blocks (or the largest count measured); ``bytes_per_block``: the
  highest resident bytes per indexed entry at that count;
* the live rows pool each router's replays of every seed (``bench/live_pool.py``: the quantiles of
  all their first tokens, hits over queries of all their prompts);
* ``live_ttft_p99_vs_best_peer``: kvgate's TTFT p99 over the lowest peer TTFT p99, the worst
  (highest) ratio over the workloads; ``live_hit_rate_vs_best_peer``: kvgate's engine-counted hit
  rate over the highest peer's, the worst (lowest) ratio over the workloads;
  ``live_ttft_p50_vs_best_peer``: the same as the p99 ratio for the p50 (worst over workloads);
  ``live_ttft_p99_floor_vs_best_peer``: the TTFT floor's p99 (each request alone on an idle engine
  holding every earlier prompt, ``bench/live_floor.py``: no router's p99 is below it) over the
  lowest peer TTFT p99, the highest over the workloads: the least p99 ratio any router could reach;
* ``ttft_audit_median_abs_error``: kvgate's TTFT model, median absolute relative error of its
  predictions against observed first bytes (bench/live_metrics.py), the worst over the workloads;
* ``new_replica_share``: the share of the next 300 requests a fourth replica joining three warm
  ones receives (``bench/new_replica.py``);
* the hop's figures: ``bench/hop_summary.py``.
A figure whose inputs are missing is ``null``.

    .venv/bin/python -m bench.report [--results bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.hop_summary import HOP_KEYS, hop_summary

ROOT = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = (
    "overhead_p50_ms",
    "overhead_p99_ms",
    "rps_per_core_vs_sglang_cache_aware",
    "events_per_s_per_core",
    "match_2048_us_at_10m",
    "bytes_per_block",
    "live_ttft_p99_vs_best_peer",
    "live_hit_rate_vs_best_peer",
    "live_ttft_p50_vs_best_peer",
    "live_ttft_p99_floor_vs_best_peer",
    "ttft_audit_median_abs_error",
    "new_replica_share",
    *HOP_KEYS,
)
ROUTERS = ("kvgate", "kvgate_workers2", "sglang_cache_aware", "sglang_round_robin", "vllm_router_cache_aware")


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _overhead_point(
    ov: dict[str, Any], stream: bool = False, size: int = 8192, conc: int = 32
) -> dict[str, Any]:
    for row in ov["rows"]:
        if (
            not row.get("warm")
            and row["stream"] == stream
            and row["prompt_bytes"] == size
            and row["concurrency"] == conc
        ):
            return dict(row)
    return {}


def summarize(
    index: dict[str, Any] | None,
    ov: dict[str, Any] | None,
    live: dict[str, Any] | None,
    new_replica: dict[str, Any] | None = None,
    hop: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``hop``: ``hop_summary``'s figures (bench/hop_summary.py)."""
    s: dict[str, Any] = dict.fromkeys(SUMMARY_KEYS)
    s.update(hop or {})
    if ov:
        point = _overhead_point(ov)
        kv = point.get("kvgate")
        if kv:
            s["overhead_p50_ms"] = round(kv["added_p50_ms"], 3)
            s["overhead_p99_ms"] = round(kv["added_p99_ms"], 3)
            sg = point.get("sglang_cache_aware")
            if sg and sg["rps_per_core"]:
                s["rps_per_core_vs_sglang_cache_aware"] = round(kv["rps_per_core"] / sg["rps_per_core"], 3)
    if index:
        rows = index["rows"]
        top = max(r["blocks"] for r in rows)
        at = [r for r in rows if r["blocks"] == top]
        s["events_per_s_per_core"] = round(min(r["churn_events_per_s"] for r in at))
        s["match_2048_us_at_10m"] = round(max(r["match_us_median"]["2048"] for r in at), 1)
        s["bytes_per_block"] = round(max(r["bytes_per_entry"] for r in at), 1)
    if live:
        s.update(_live_summary(live["rows"]))
    if new_replica:
        s["new_replica_share"] = new_replica.get("new_replica_share")
    return s


def _live_summary(all_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The live ratios to the best peer (worst over workloads) and the TTFT audit's error."""
    p99: list[float] = []
    p50: list[float] = []
    hit: list[float] = []
    floor: list[float] = []
    audit: list[float] = []
    for wl in sorted({r["workload"] for r in all_rows}):
        rows = [r for r in all_rows if r["workload"] == wl]
        kv = [r for r in rows if r["router"].startswith("kvgate")]
        peers = [r for r in rows if not r["router"].startswith("kvgate") and r["ok"]]
        if kv and kv[0].get("ttft_audit_median_abs_error") is not None:
            audit.append(kv[0]["ttft_audit_median_abs_error"])
        if not kv or not peers:
            continue
        # (ratios, kvgate row's figure, the best peer's figure it is divided by)
        for ratios, mine, key in (
            (p99, "ttft_p99_ms", "ttft_p99_ms"),
            (p50, "ttft_p50_ms", "ttft_p50_ms"),
            (floor, "floor_ttft_p99_ms", "ttft_p99_ms"),  # absent with --no-floor
        ):
            best = min(p[key] for p in peers)
            if best > 0 and kv[0].get(mine) is not None:
                ratios.append(kv[0][mine] / best)
        best_hit = max(p["hit_rate"] for p in peers)
        if best_hit > 0:
            hit.append(kv[0]["hit_rate"] / best_hit)
    out: dict[str, Any] = {}
    if p99:
        out["live_ttft_p99_vs_best_peer"] = round(max(p99), 3)
    if p50:
        out["live_ttft_p50_vs_best_peer"] = round(max(p50), 3)
    if floor:
        out["live_ttft_p99_floor_vs_best_peer"] = round(max(floor), 3)
    if hit:
        out["live_hit_rate_vs_best_peer"] = round(min(hit), 3)
    if audit:
        out["ttft_audit_median_abs_error"] = round(max(audit), 3)
    return out


def _deferred(r: dict[str, Any]) -> str:
    bg = r.get("deferred_cpu_s_per_1000", 0.0)
    return f" ({bg:.3f})" if bg else ""


def table(
    index: dict[str, Any] | None,
    ov: dict[str, Any] | None,
    live: dict[str, Any] | None,
    summary: dict[str, Any],
) -> str:
    out = [
        f"# kvgate benchmark results ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Machine: {platform.machine()}, {_cpu_model()}, {_ncpu()} CPUs, Python {platform.python_version()}.",
        "",
        "## Summary",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| `{k}` | {summary[k]} |" for k in SUMMARY_KEYS],
        "",
    ]
    if index:
        out += [
            "## Index",
            "",
            "| blocks | replicas | events/s (churn) | events/s (populate) | match 128 us | match 2048 us | match 8192 us | bytes/entry | bytes/distinct key |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in index["rows"]:
            m = r["match_us_median"]
            out.append(
                f"| {r['blocks']:,} | {r['replicas']} | {r['churn_events_per_s']:,.0f} | {r['populate_events_per_s']:,.0f} "
                f"| {m['128']:.1f} | {m['2048']:.1f} | {m['8192']:.1f} | {r['bytes_per_entry']:.1f} | {r['bytes_per_distinct_key']:.1f} |"
            )
        out.append("")
    if ov:
        out += [
            "## Gateway overhead (fake backends on loopback)",
            "",
            "Added = router minus direct at the same percentile; CPU = the router's process tree "
            "(for kvgate, in brackets: of which its lowest-priority thread encoding new text after routing).",
            "",
            "| mode | prompt | c | router | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | CPU s / 1k req | req/s per core | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in ov["rows"]:
            mode = ("warm " if row.get("warm") else "") + ("stream" if row["stream"] else "json")
            size = f"{row['prompt_bytes'] // 1024} KB"
            d = row["direct"]
            out.append(
                f"| {mode} | {size} | {row['concurrency']} | direct | {d['rps']:,.0f} | {d['p50_ms']:.2f} | {d['p99_ms']:.2f} | | | | | {d['errors']:.0f} |"
            )
            for name in ROUTERS:
                r = row.get(name)
                if r:
                    out.append(
                        f"| {mode} | {size} | {row['concurrency']} | {name} | {r['rps']:,.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
                        f"| {r['added_p50_ms']:.2f} | {r['added_p99_ms']:.2f} | {r['cpu_s_per_1000']:.3f}{_deferred(r)} | {r['rps_per_core']:,.0f} | {r['errors']:.0f} |"
                    )
        out.append("")
    if live:
        out += [
            "## Live fleet (simulated engines)",
            "",
            "| workload | router | policy | hit rate | TTFT p50 ms | TTFT p99 ms | TTFT p99 ms per seed "
            "| engine TTFT p50 / p99 ms | hop in p50 / p99 ms | hop out p50 / p99 ms "
            "| router (agents) CPU ms per request | floor TTFT p99 ms | req/s | errors "
            "| TTFT audit median abs error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in live["rows"]:
            audit = r.get("ttft_audit_median_abs_error")
            each = " / ".join(f"{s['ttft_p99_ms']:.1f}" for s in r.get("per_seed", []))
            out.append(
                f"| {r['workload']} | {r['router']} | {r['policy']} | {r['hit_rate']:.3f} | {r['ttft_p50_ms']:.1f} "
                f"| {r['ttft_p99_ms']:.1f} | {each or '-'} "
                f"| {_ms(r.get('engine_ttft_p50_ms'))} / {_ms(r.get('engine_ttft_p99_ms'))} "
                f"| {_ms(r.get('inbound_p50_ms'))} / {_ms(r.get('inbound_p99_ms'))} "
                f"| {_ms(r.get('outbound_p50_ms'))} / {_ms(r.get('outbound_p99_ms'))} "
                f"| {_cpu(r)} "
                f"| {_ms(r.get('floor_ttft_p99_ms'))} "
                f"| {r['throughput_rps']:.2f} | {r['errors']} | {'-' if audit is None else f'{audit:.3f}'} |"
            )
        out.append("")
    return "\n".join(out)


def _cpu(row: dict[str, Any]) -> str:
    """The router's CPU per request, with its agents' in parentheses when it has any."""
    router, agents = row.get("router_cpu_ms_per_request"), row.get("agents_cpu_ms_per_request")
    if router is None:
        return "-"
    return f"{router:.2f}" + (f" ({agents:.2f})" if agents else "")


def _ms(value: float | None) -> str:
    """A table cell of milliseconds; '-' when not measured (a row from before the figure)."""
    return "-" if value is None else f"{value:.1f}"


def plots(
    results: Path, index: dict[str, Any] | None, ov: dict[str, Any] | None, live: dict[str, Any] | None
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(results / name, dpi=110)
        plt.close(fig)
        written.append(name)

    if index:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in index["rows"]:
            xs = [int(k) for k in r["match_us_median"]]
            ax.plot(
                xs,
                list(r["match_us_median"].values()),
                marker="o",
                label=f"{r['blocks']:,} blocks, {r['replicas']} replicas",
            )
        ax.axhline(200, color="grey", linestyle="--", linewidth=0.8, label="goal at 2,048 blocks")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt blocks")
        ax.set_ylabel("match median (us)")
        ax.set_title("Prefix index match time")
        ax.legend(fontsize=7)
        save(fig, "index_match.png")
    if ov:
        labels = []
        per_router: dict[str, list[float]] = {n: [] for n in ROUTERS}
        for row in ov["rows"]:
            if row["concurrency"] == 1:
                continue
            labels.append(
                f"{'W' if row.get('warm') else ''}{'S' if row['stream'] else 'J'} {row['prompt_bytes'] // 1024}K c{row['concurrency']}"
            )
            for n in ROUTERS:
                per_router[n].append(row[n]["rps_per_core"] if n in row else 0.0)
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(ROUTERS)
        for i, n in enumerate(ROUTERS):
            ax.bar([x + i * width for x in range(len(labels))], per_router[n], width, label=n)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, fontsize=7)
        ax.set_ylabel("requests per router CPU-second")
        ax.set_title("Router efficiency (J json, S stream, W warm; prompt size; concurrency)")
        ax.legend(fontsize=7)
        save(fig, "overhead_rps_per_core.png")
    if live:
        wls = sorted({r["workload"] for r in live["rows"]})
        fig, axes = plt.subplots(1, 2, figsize=(9, 4))
        for wi, wl in enumerate(wls):
            rows = [r for r in live["rows"] if r["workload"] == wl]
            bar_x = [float(x) + wi * 0.4 for x in range(len(rows))]
            axes[0].bar(bar_x, [r["hit_rate"] for r in rows], 0.4, label=wl)
            axes[1].bar(bar_x, [r["ttft_p99_ms"] for r in rows], 0.4, label=wl)
            names = [r["router"] for r in rows]
        for ax, title in zip(axes, ("engine prefix hit rate", "client TTFT p99 (ms)"), strict=True):
            ax.set_xticks([x + 0.2 for x in range(len(names))], names, fontsize=7, rotation=15)
            ax.set_title(title)
            ax.legend(fontsize=7)
        save(fig, "live.png")
    return written


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _ncpu() -> int:
    import os

    return len(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "bench/results")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    res = args.results
    index, ov, live = _load(res / "index.json"), _load(res / "overhead.json"), _load(res / "live.json")
    hop = hop_summary(ov, _load(res / "streaming.json"))
    summary = summarize(index, ov, live, _load(res / "new_replica.json"), hop)
    (res / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (res / "table.md").write_text(table(index, ov, live, summary) + "\n")
    written = [] if args.no_plots else plots(res, index, ov, live)
    print(json.dumps(summary, indent=1))
    print(f"wrote {res / 'summary.json'}, {res / 'table.md'}" + "".join(f", {res / w}" for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
