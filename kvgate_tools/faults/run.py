"""``make faults``: every scenario of issue 13's fault table on real processes; writes
out/faults.json (``{"scenarios": [{name, sent, ok, clear_error, broken, lost, reconverge_s,
peak_rss_mb, pass}]}``, plus ``max_latency_s`` and ``notes`` per row, and the run's duration) and
exits 1 when any scenario fails (docs/faults.md).

    python -m kvgate_tools.faults.run [--out out/faults.json] [--soak-s 600] [--only NAME ...]
    python -m kvgate_tools.faults.run --table out/faults.json   # the Markdown table of docs/faults.md

A scenario that raises is recorded as failed with the error in its notes; the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvgate_tools.faults import engine_faults, fleet_faults, http_faults, inventory_faults, redis_faults, soak
from kvgate_tools.faults.common import Result, Tally
from kvgate_tools.faults.fleet_faults import FleetCtx
from kvgate_tools.local_fleet import LocalFleet

FleetScenario = Callable[[FleetCtx], Result]
FLEET_SCENARIOS: list[FleetScenario] = [
    fleet_faults.agent_restart_replay,
    fleet_faults.engine_kill_midstream,
    engine_faults.events_dropped,
    engine_faults.events_duplicated,
    engine_faults.events_reordered,
    engine_faults.events_corrupted,
    engine_faults.engine_hung,
    engine_faults.engine_slow,
    engine_faults.engine_5xx,
    fleet_faults.agent_restart_no_replay,  # last: it may leave r1's index short of its engine
]
Standalone = Callable[[Path], Result]
HTTP_SCENARIOS: list[Standalone] = [
    http_faults.malformed_http,
    http_faults.slow_clients,
    http_faults.bad_configs,
]
STANDALONE = [*HTTP_SCENARIOS, inventory_faults.abusive_streams, redis_faults.redis_restart_two_gateways]


def failed(name: str, exc: BaseException) -> Result:
    tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return Result(name, Tally(), None, 0.0, False, f"scenario raised: {tb}")


def run_fleet(tmp: Path, wanted: Callable[[str], bool], results: list[Result]) -> None:
    chosen = [s for s in FLEET_SCENARIOS if wanted(s.__name__)]
    if not chosen:
        return
    with LocalFleet(fleet_faults.fleet_options(tmp / "fleet")) as fleet:
        ctx = FleetCtx(fleet)
        for scenario in chosen:
            results.append(run_one(scenario.__name__, partial(scenario, ctx)))


def run_one(name: str, fn: Callable[[], Result]) -> Result:
    start = time.monotonic()
    try:
        r = fn()
    except Exception as exc:  # recorded as a failed scenario, the run goes on
        r = failed(name, exc)
    print(f"faults: {r.name}: {'pass' if r.passed else 'FAIL'} ({time.monotonic() - start:.1f} s) {r.row()}")
    sys.stdout.flush()
    return r


def markdown(doc: dict[str, Any]) -> str:
    """out/faults.json as the table of docs/faults.md."""
    cols = [
        "name",
        "sent",
        "ok",
        "clear_error",
        "broken",
        "lost",
        "reconverge_s",
        "peak_rss_mb",
        "pass",
        "notes",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in doc["scenarios"]:
        cells = ["" if r[c] is None else str(r[c]).replace("|", "/") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nWhole run: {doc['duration_s']:.0f} s.\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("out/faults.json"))
    ap.add_argument("--soak-s", type=float, default=600.0, help="soak duration in seconds (default 600)")
    ap.add_argument("--table", type=Path, help="print this faults.json as a Markdown table and exit")
    ap.add_argument("--only", nargs="*", default=None, help="run only scenarios whose function name is given")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(markdown(json.loads(args.table.read_text())), end="")
        return 0

    def wanted(name: str) -> bool:
        return args.only is None or name in args.only

    start = time.monotonic()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-faults-") as tmp_name:
        tmp = Path(tmp_name)
        run_fleet(tmp, wanted, results)
        for scenario in STANDALONE:
            if wanted(scenario.__name__):
                results.append(run_one(scenario.__name__, partial(scenario, tmp / scenario.__name__)))
        if wanted("soak"):
            results.append(run_one("soak", lambda: soak.soak(tmp / "soak", args.soak_s)))
    took = time.monotonic() - start
    doc = {"duration_s": round(took, 1), "scenarios": [r.row() for r in results]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    bad = [r.name for r in results if not r.passed]
    print(f"faults: {len(results) - len(bad)}/{len(results)} passed in {took:.0f} s -> {args.out}")
    if bad:
        print("faults: failed: " + ", ".join(bad))
    return 1 if bad or not results else 0


if __name__ == "__main__":
    sys.exit(main())
