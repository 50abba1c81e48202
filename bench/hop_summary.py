"""The gateway hop's headline figures (issue 15) for ``summary.json``, from ``overhead.json``
(``bench/overhead.py``) and ``streaming.json`` (``bench/streaming.py``); a figure whose input is
missing is ``null``:

* ``cpu_ms_per_request``: kvgate's CPU milliseconds per request (its process tree, from /proc),
  warm 8 KB chats (a pool resent), non-streaming, concurrency 32;
* ``cpu_per_request_vs_sglang_cache_aware``: that over sglang-router cache_aware's, same point;
* ``unloaded_added_p99_ms``: kvgate's added latency p99 at concurrency 1, 8 KB, non-streaming, the
  worse of unique chats (each one's new text tokenized) and warm ones;
* ``cpu_per_chunk_vs_sglang_cache_aware``: CPU per relayed SSE chunk, kvgate over sglang-router
  cache_aware (``streaming.json``'s own summary);
* ``workers2_throughput_vs_workers1``: requests/s of ``kvgate serve --workers 2`` over one
  process, warm 8 KB chats at concurrency 32, same run and backends;
* ``added_p50_c32_workers2_vs_sglang_cache_aware``: the added latency p50 at concurrency 32 (8 KB,
  non-streaming) with two workers over sglang-router cache_aware's, the worse of unique and warm
  chats.
"""

from __future__ import annotations

from typing import Any

HOP_KEYS = (
    "cpu_ms_per_request",
    "cpu_per_request_vs_sglang_cache_aware",
    "cpu_per_chunk_vs_sglang_cache_aware",
    "unloaded_added_p99_ms",
    "workers2_throughput_vs_workers1",
    "added_p50_c32_workers2_vs_sglang_cache_aware",
)


def _point(ov: dict[str, Any], *, warm: bool, conc: int) -> dict[str, Any]:
    for row in ov["rows"]:
        if (
            bool(row.get("warm")) == warm
            and not row["stream"]
            and row["prompt_bytes"] == 8192
            and row["concurrency"] == conc
        ):
            return dict(row)
    return {}


def hop_summary(ov: dict[str, Any] | None, streaming: dict[str, Any] | None) -> dict[str, Any]:
    s: dict[str, Any] = dict.fromkeys(HOP_KEYS)
    if ov:
        warm = _point(ov, warm=True, conc=32)
        kv, sg = warm.get("kvgate"), warm.get("sglang_cache_aware")
        if kv:
            s["cpu_ms_per_request"] = round(kv["cpu_s_per_1000"], 3)
            if sg and sg["cpu_s_per_1000"]:
                s["cpu_per_request_vs_sglang_cache_aware"] = round(
                    kv["cpu_s_per_1000"] / sg["cpu_s_per_1000"], 2
                )
        unloaded = [
            p["kvgate"]["added_p99_ms"]
            for w in (False, True)
            if "kvgate" in (p := _point(ov, warm=w, conc=1))
        ]
        if unloaded:
            s["unloaded_added_p99_ms"] = round(max(unloaded), 3)
        w1, w2 = warm.get("kvgate"), warm.get("kvgate_workers2")
        if w1 and w2 and w1["rps"]:
            s["workers2_throughput_vs_workers1"] = round(w2["rps"] / w1["rps"], 3)
        ratios = []
        for w in (False, True):
            p = _point(ov, warm=w, conc=32)
            k2, sg = p.get("kvgate_workers2"), p.get("sglang_cache_aware")
            if k2 and sg and sg["added_p50_ms"] > 0:
                ratios.append(k2["added_p50_ms"] / sg["added_p50_ms"])
        if ratios:
            s["added_p50_c32_workers2_vs_sglang_cache_aware"] = round(max(ratios), 2)
    for k, v in ((streaming or {}).get("summary") or {}).items():
        if k in s:
            s[k] = v
    return s
