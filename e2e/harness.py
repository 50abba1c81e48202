"""The harness's state: the replicas (engine process, event tap, the block set rebuilt from its
events) and the gateway, with the calls every check uses (send a request, settle, compare the
gateway's index with the rebuilt sets). Split out of ``e2e/run.py``; see docs/e2e-vllm.md.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e import http_client, vllm_replica, workload
from e2e.event_tap import EventTap, HeldBlocks, wait_quiet
from e2e.kvgate_procs import Gateway
from e2e.vllm_replica import BLOCK_SIZE, ReplicaSpec
from kvgate_tools.procs import ProcessGroup
from kvgate_tools.prom_text import kvgate_audit

MODEL = "tiny-llama"
KV_CACHE_BYTES = 3 * 1024 * 1024  # 96 blocks of 32 tokens of the tiny Llama (32 KiB per block)
SETTLE_QUIET_S = 0.3  # no event for this long: the engine has published its last step
INDEX_SYNC_DEADLINE_S = 5.0


@dataclass
class Replica:
    rid: str
    spec: ReplicaSpec
    proc: subprocess.Popen[bytes] | None = None  # the running engine
    tap: EventTap | None = None
    model: str = MODEL
    hybrid: bool = False  # several KV-cache groups: ``held`` reports what vLLM can reuse
    held: HeldBlocks = field(init=False)
    applied: int = 0  # frames of the tap already applied to ``held``

    def __post_init__(self) -> None:
        self.held = HeldBlocks(self.model, BLOCK_SIZE, hybrid=self.hybrid)

    def restart_view(self) -> None:
        """The engine restarted: rebuild from its new frames only."""
        assert self.tap is not None
        self.held = HeldBlocks(self.model, BLOCK_SIZE, hybrid=self.hybrid)
        self.applied = len(self.tap.snapshot())

    def refresh(self) -> HeldBlocks:
        assert self.tap is not None
        frames = self.tap.snapshot()
        self.held.apply_frames(frames[self.applied :])
        self.applied = len(frames)
        return self.held


def engine_name(r: Replica) -> str:
    """The engine's name in the process group (its log file)."""
    return f"{r.rid}-vllm"


@dataclass
class Harness:
    procs: ProcessGroup
    vllm_python: Path
    model_dir: Path
    replicas: list[Replica]
    gateway: Gateway
    details: dict[str, Any] = field(default_factory=dict)
    model: str = MODEL

    # ---- engines ------------------------------------------------------------------------

    def start_engine(self, r: Replica) -> None:
        r.proc = vllm_replica.spawn(
            self.procs, engine_name(r), self.vllm_python, self.model_dir, self.model, r.spec
        )
        if r.tap is None:
            # Our own subscriber, opened before the engine binds: it sees every frame from seq 0,
            # and reconnects by itself across an engine restart on the same port.
            r.tap = EventTap(r.spec.events_endpoint)

    def wait_engine(self, r: Replica) -> float:
        """Seconds until the replica's engine answers ``/health``."""
        assert r.proc is not None, "start_engine first"
        return vllm_replica.wait_ready(self.procs, engine_name(r), r.proc, r.spec)

    def reset_engine_caches(self) -> None:
        for r in self.replicas:
            resp = http_client.post(r.spec.url + "/reset_prefix_cache", None)
            if resp.status != 200:
                raise RuntimeError(f"{r.rid}: /reset_prefix_cache: HTTP {resp.status}")
            # AllBlocksCleared is published with the next engine step: make one.
            http_client.post(
                r.spec.url + "/v1/completions", {"model": self.model, "prompt": "flush", "max_tokens": 1}
            )
        self.settle()

    def gateway_audits(self) -> dict[str, object]:
        """The running gateway's audits from its /metrics (kvgate_tools/prom_text.kvgate_audit): the
        TTFT model's median absolute relative error over its first tokens, the cached-token
        audit's exact share and causes. Reported, not judged: issue 11's bar is on the live bench."""
        return dict(kvgate_audit(http_client.get(self.gateway.url + "/metrics").body.decode()))

    def hits(self) -> dict[str, float]:
        out = {}
        for r in self.replicas:
            text = http_client.get(r.spec.url + "/metrics").body.decode()
            out[r.rid] = http_client.metric_sum(text, "vllm:prefix_cache_hits_total")
        return out

    # ---- synchronisation and the index check --------------------------------------------

    def settle(self) -> None:
        wait_quiet([r.tap for r in self.replicas if r.tap is not None], SETTLE_QUIET_S)

    def index_diff(self, r: Replica) -> dict[str, int]:
        engine = r.refresh().keys()
        gw = self.gateway.index_keys(r.rid)
        gw = gw if gw is not None else set()
        return {
            "engine_blocks": len(engine),
            "gateway_blocks": len(gw),
            "missing_in_gateway": len(engine - gw),
            "extra_in_gateway": len(gw - engine),
            "unkeyed_engine_blocks": sum(1 for k in r.held.engine.values() if k is None),
        }

    def wait_index_equal(self, deadline_s: float = INDEX_SYNC_DEADLINE_S) -> dict[str, dict[str, int]]:
        """Poll until every replica's gateway keys equal the engine's rebuilt set; return the
        last diff (equal or not, when the deadline passed)."""
        t0 = time.monotonic()
        while True:
            diffs = {r.rid: self.index_diff(r) for r in self.replicas}
            if all(equal(d) for d in diffs.values()) or time.monotonic() - t0 > deadline_s:
                return diffs
            time.sleep(0.05)

    # ---- requests -----------------------------------------------------------------------

    def send(self, req: workload.Req, timeout_s: float = 120.0) -> dict[str, Any]:
        headers = {"x-session-id": req.session} if req.session else {}
        t0 = time.monotonic()
        resp = http_client.post(self.gateway.url + req.path(), req.with_model(self.model), headers, timeout_s)
        row: dict[str, Any] = {
            "tag": req.tag,
            "kind": req.kind,
            "status": resp.status,
            "replica": resp.headers.get("x-kvgate-replica"),
            "predicted": int_or_none(resp.headers.get("x-kvgate-matched-tokens")),
            "latency_ms": round((time.monotonic() - t0) * 1000, 1),
        }
        try:
            doc = resp.json()
        except ValueError:
            doc = None
        if resp.status == 200 and isinstance(doc, dict):
            row["prompt_tokens"] = (doc.get("usage") or {}).get("prompt_tokens")
            row["cached"] = http_client.cached_tokens(doc.get("usage"))
        else:
            row["error"] = openai_error(doc)
        return row

    def run_sequential(self, phase: str, reqs: list[workload.Req]) -> list[dict[str, Any]]:
        """Send one at a time; after each, let the events reach the gateway (tap quiet, then the
        gateway's index equal to the rebuilt sets) so that the next prediction is well defined."""
        rows = []
        for req in reqs:
            row = self.send(req)
            self.settle()
            diffs = self.wait_index_equal()
            row["phase"] = phase
            row["index_equal_after"] = all(equal(d) for d in diffs.values())
            rows.append(row)
        return rows


def equal(d: dict[str, int]) -> bool:
    return d["missing_in_gateway"] == 0 and d["extra_in_gateway"] == 0 and d["unkeyed_engine_blocks"] == 0


def int_or_none(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def openai_error(doc: Any) -> dict[str, Any] | None:
    """The ``error`` object when ``doc`` has the OpenAI error shape, else None."""
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict) and "message" in doc["error"]:
        return dict(doc["error"])
    return None


def exact(rows: list[dict[str, Any]]) -> tuple[int, int]:
    scored = [
        r for r in rows if r["status"] == 200 and r.get("cached") is not None and r["predicted"] is not None
    ]
    return sum(1 for r in scored if r["predicted"] == r["cached"]), len(scored)
