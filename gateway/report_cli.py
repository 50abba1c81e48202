"""``kvgate report``: the gateway's ``GET /admin/report`` as terminal tables (docs/operators.md).

kvgate report --url http://gateway:8000            # token from $KVGATE_ADMIN_TOKEN
kvgate report --file report.json                   # a report saved earlier
kvgate report --url ... --json                     # the JSON as served
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from router_policies.errors import UserInputError


def configure(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the gateway (default http://127.0.0.1:8000)"
    )
    src.add_argument("--file", type=Path, help="render a report saved as JSON instead")
    p.add_argument("--token-env", default="KVGATE_ADMIN_TOKEN", help="env var holding the admin token")
    p.add_argument("--json", action="store_true", help="print the JSON instead of tables")


def fetch_report(url: str, token: str | None, path: str = "/admin/report", timeout_s: float = 10.0) -> Any:
    """``GET path`` of the gateway at ``url`` (an admin endpoint) as JSON; raises ``UserInputError``."""
    req = urllib.request.Request(url.rstrip("/") + path)
    if token:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{url}: {path} answered with no JSON ({exc}): {body[:200]!r}") from None
    except urllib.error.HTTPError as exc:
        raise UserInputError(f"{url}: {path} answered {exc.code}: {exc.read()[:200]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UserInputError(f"{url}: cannot reach the gateway: {exc}") from None


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and abs(v) < 10**-digits:
            return f"{v:.2e}"
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO) -> None:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in cells:
        print(
            "  ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ),
            file=out,
        )


def render(report: dict[str, Any], out: TextIO | None = None) -> None:
    out = out or sys.stdout  # read at call time: a replaced sys.stdout (tests, redirection) is honoured
    sav = report["savings"]
    print("Savings (engine-reported cached tokens; money at the configured prices)", file=out)
    rows = [
        [r["tenant"], r["model"], r["requests"], r["prompt_tokens"], r["saved_prefill_tokens"], r["hit_rate"],
         r["saved_engine_s"], r["saved_gpu_s"], r["saved_usd"]]
        for r in sav["rows"]
    ]  # fmt: skip
    t = sav["totals"]
    rows.append(["TOTAL", "", t["requests"], t["prompt_tokens"], t["saved_prefill_tokens"], t["hit_rate"],
                 t["saved_engine_s"], t["saved_gpu_s"], t["saved_usd"]])  # fmt: skip
    table(["tenant", "model", "requests", "prompt tok", "cached tok", "hit rate", "engine s saved",
           "GPU-s saved", "USD saved"], rows, out)  # fmt: skip
    if t["unpriced_models"]:
        print(f"  no price for: {', '.join(t['unpriced_models'])} (operator.prices)", file=out)
    print("\nPrefill speed (slope of TTFT on computed tokens)", file=out)
    table(["replica", "ms / 1k tokens"],
          [[rid, v * 1e6 if v is not None else None] for rid, v in sav["prefill_s_per_token"].items()], out)  # fmt: skip
    lt = report["cache_lifetime"]
    print("\nCache lifetime (engine store -> remove events)", file=out)
    table(["replica", "removed blocks", "p50 s", "p90 s", "p99 s", "oldest held s"],
          [[rid, r["residency"]["count"], r["residency"]["p50_s"], r["residency"]["p90_s"], r["residency"]["p99_s"],
            r["oldest_held_age_s"]] for rid, r in lt["replicas"].items()], out)  # fmt: skip
    turns = report["turns"]
    gap = turns["turn_gap"]
    print(f"\nSession turns: gap p50 {_fmt(gap['p50_s'])} s, p90 {_fmt(gap['p90_s'])} s "
          f"over {gap['count']} returning turns", file=out)  # fmt: skip
    table(["tenant", "returning", "prefix alive", "prefix evicted", "eviction-miss share", "engine-miss share"],
          [[tn, c["returning_turns"], c["prefix_alive"], c["prefix_evicted"], c["eviction_miss_share"],
            c["engine_miss_share"]] for tn, c in [*turns["by_tenant"].items(), ("ALL", turns["all"])]], out)  # fmt: skip
    tr = report["trace"]
    state = "recording" if tr["enabled"] else "not recording"
    print(f"\nTrace: {state} ({tr['path'] or 'no path'}), {tr['lines']} lines", file=out)


def run(args: argparse.Namespace) -> int:
    if args.file is not None:
        try:
            report = json.loads(args.file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UserInputError(f"{args.file}: cannot read the report: {exc}") from None
    else:
        report = fetch_report(args.url, os.environ.get(args.token_env) or None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    return 0
