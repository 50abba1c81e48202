"""LoRA-aware routing on real vLLM (``make e2e-vllm``, after the hybrid model; docs/e2e-vllm.md).

Two tiny-Llama replicas with ``--enable-lora`` (``l0`` on core 0 starts with the adapter ``sql``
loaded by ``--lora-modules``, ``l1`` on core 1 without), runtime loading on
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), an agent beside each (polling ``/v1/models``) and a
gateway whose model lists ``lora_adapters: [sql]`` (``lora_fallback: any``). The adapter is
``scripts/make_tiny_lora.py``'s (rank 8, random, offline). Phases, one request at a time:

1. ``l0`` only: every request naming ``sql`` must go to ``l0``;
2. ``sql`` loaded on ``l1`` and unloaded from ``l0`` (``/v1/load_lora_adapter``,
   ``/v1/unload_lora_adapter``): the gateway's view (``/admin/replicas`` ``lora_adapters``) must
   follow each change, and every request must then go to ``l1``;
3. a stale view: both agents paused (SIGSTOP), ``sql`` loaded on ``l0`` and unloaded from ``l1``,
   4 of phase 2's prompts sent: the gateway, which believes only ``l1`` has the adapter, routes
   each to ``l1``, vLLM answers 404 and the gateway retries before the first byte, on ``l0`` (no
   holder it knows of is left, so ``lora_fallback: any``); the agents resumed, the view follows.

Pass: phases 1 and 2 every request answered 200 by a replica that had the adapter; phase 3 every
request answered 200 by ``l0`` after exactly one retried 404 each; the adapter view followed
every load and unload.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from e2e import http_client, vllm_replica, workload
from e2e.harness import KV_CACHE_BYTES, MODEL, int_or_none
from e2e.kvgate_procs import Gateway, start_agent
from kvgate_tools.procs import LowPorts, ProcessGroup

ADAPTER = "sql"
ROOT = Path(__file__).resolve().parent.parent
MODELS_INTERVAL_S = 1.0  # the agents' /v1/models poll (their default)
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "2")


def ensure_adapter(vllm_python: Path, model_dir: Path, adapter_dir: Path) -> None:
    if not (adapter_dir / "adapter_model.safetensors").exists():
        cmd = [str(vllm_python), str(ROOT / "scripts/make_tiny_lora.py"), "--base", str(model_dir)]
        subprocess.run([*cmd, "--out", str(adapter_dir)], check=True, capture_output=True)


def _adapters(gateway: Gateway) -> dict[str, set[str] | None]:
    return {
        rid: None if r.get("lora_adapters") is None else set(r["lora_adapters"])
        for rid, r in gateway.replicas_state().items()
    }


def wait_view(gateway: Gateway, want: dict[str, bool], deadline_s: float = 30.0) -> float:
    """Seconds until the gateway's adapter view has ``sql`` exactly on the replicas ``want``
    says (raises past the deadline)."""
    t0 = time.monotonic()
    while True:
        view = _adapters(gateway)
        if all((ADAPTER in (view.get(rid) or set())) == has for rid, has in want.items()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"gateway adapter view {view} never became {want}")
        time.sleep(0.05)


def engine_adapter(url: str, load: bool, path: Path) -> None:
    body: dict[str, Any] = {"lora_name": ADAPTER}
    if load:
        body["lora_path"] = str(path)
    resp = http_client.post(url + ("/v1/load_lora_adapter" if load else "/v1/unload_lora_adapter"), body)
    if resp.status != 200:
        raise RuntimeError(
            f"{url}: {'load' if load else 'unload'} {ADAPTER}: HTTP {resp.status} {resp.body!r}"
        )


def send(gateway: Gateway, req: workload.Req, phase: str, holders: set[str]) -> dict[str, Any]:
    resp = http_client.post(gateway.url + req.path(), req.with_model(ADAPTER), timeout_s=120.0)
    row: dict[str, Any] = {
        "phase": phase,
        "tag": req.tag,
        "status": resp.status,
        "replica": resp.headers.get("x-kvgate-replica"),
        "predicted": int_or_none(resp.headers.get("x-kvgate-matched-tokens")),
        "holders": sorted(holders),
    }
    if resp.status == 200:
        row["cached"] = http_client.cached_tokens(resp.json().get("usage"))
    else:
        row["body"] = resp.body[:300].decode(errors="replace")
    return row


def retried_404(gateway: Gateway) -> float:
    text = http_client.get(gateway.url + "/metrics").body.decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("kvgate_retries_total{") and 'reason="404"' in line
    )


def run(vllm_python: Path, model_dir: Path, logs: Path, seed: int) -> dict[str, Any]:
    adapter_dir = model_dir.parent / (model_dir.name + "-lora")
    ensure_adapter(vllm_python, model_dir, adapter_dir)
    procs = ProcessGroup(logs / "lora")
    ports = LowPorts(random.Random(os.getpid() + 2))  # port choice only, as in run.py
    specs = [
        vllm_replica.new_spec(f"l{i}", core=i, kv_cache_bytes=KV_CACHE_BYTES, ports=ports) for i in (0, 1)
    ]
    gateway = Gateway(
        procs,
        logs / "lora",
        MODEL,
        model_dir,
        [(s.name, s) for s in specs],
        ports,
        model_extra={"lora_adapters": [ADAPTER], "lora_fallback": "any"},
    )
    rows: list[dict[str, Any]] = []
    follow: dict[str, float] = {}
    try:
        children = []
        for s in specs:
            argv = [*vllm_replica.launch_argv(vllm_python, model_dir, MODEL, s), *LORA_FLAGS]
            if s.name == "l0":
                argv += ["--lora-modules", f"{ADAPTER}={adapter_dir}"]
            env = vllm_replica.env(s) | {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
            children.append(procs.spawn(f"{s.name}-vllm", argv, extra_env=env))
        for s, child in zip(specs, children, strict=True):
            ready = vllm_replica.wait_ready(procs, f"{s.name}-vllm", child, s)
            print(f"e2e: lora {s.name} vLLM ready ({ready:.0f} s)", file=sys.stderr)
        gateway.start("kv_aware")
        agents = [
            start_agent(procs, s.name, s, MODEL, gateway, "--models-interval", str(MODELS_INTERVAL_S))
            for s in specs
        ]
        gateway.wait_agents([s.name for s in specs])
        follow["initial"] = wait_view(gateway, {"l0": True, "l1": False})
        reqs = workload.mixed(seed + 3, docs=3, questions=3, sessions=3, turns=3)
        half = len(reqs) // 2
        rows += [send(gateway, r, "only_l0", {"l0"}) for r in reqs[:half]]
        engine_adapter(specs[1].url, True, adapter_dir)
        follow["load_l1"] = wait_view(gateway, {"l0": True, "l1": True})
        engine_adapter(specs[0].url, False, adapter_dir)
        follow["unload_l0"] = wait_view(gateway, {"l0": False, "l1": True})
        rows += [send(gateway, r, "only_l1", {"l1"}) for r in reqs[half:]]
        # A stale view, made certain: both agents paused (SIGSTOP: no poll, the streams stay
        # open), the adapter moved from l1 to l0 behind the gateway's back. The gateway routes to
        # l1, the only holder it knows of; l1 answers 404; the retry excludes l1 and, no holder
        # being left, takes the fallback ('any'): l0, which has it.
        before = retried_404(gateway)
        for a in agents:
            os.kill(a.pid, signal.SIGSTOP)
        try:
            engine_adapter(specs[0].url, True, adapter_dir)
            engine_adapter(specs[1].url, False, adapter_dir)
            t_stale = time.monotonic()
            for r in reqs[half : half + 4]:
                rows.append(send(gateway, r, "stale_view", {"l0"}))
            stale_s = time.monotonic() - t_stale
            retried = retried_404(gateway) - before
        finally:
            for a in agents:
                os.kill(a.pid, signal.SIGCONT)
        follow["after_pause"] = wait_view(gateway, {"l0": True, "l1": False})
    finally:
        procs.stop_all()
    synced = [r for r in rows if r["phase"] != "stale_view"]
    stale = [r for r in rows if r["phase"] == "stale_view"]
    scored = [r for r in synced if r.get("cached") is not None and r["predicted"] is not None]
    summary = {
        "requests": len(rows),
        "routed_to_holder": sum(1 for r in synced if r["status"] == 200 and r["replica"] in r["holders"]),
        "synced_requests": len(synced),
        "stale_answered_by_holder": sum(1 for r in stale if r["status"] == 200 and r["replica"] == "l0"),
        "stale_requests": len(stale),
        "stale_window_s": round(stale_s, 2),
        "retried_404": retried,
        "view_follow_s": {k: round(v, 2) for k, v in follow.items()},
        "prediction_exact": sum(1 for r in scored if r["predicted"] == r["cached"]),
        "prediction_scored": len(scored),
    }
    summary["pass"] = (
        summary["routed_to_holder"] == len(synced) > 0
        and summary["stale_answered_by_holder"] == len(stale)
        and retried == len(stale)  # each went to l1 first: one retried 404 each
    )
    return {"summary": summary, "rows": rows}


def main() -> int:
    """This check alone: ``python -m e2e.lora_check [--vllm-python P] [--model DIR]``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm/bin/python")
    ap.add_argument("--model", type=Path, default=ROOT / "models/tiny-llama")
    ap.add_argument("--out", type=Path, default=ROOT / "out")
    args = ap.parse_args()
    result = run(args.vllm_python, args.model, args.out / "e2e-vllm-logs", 0)
    print(json.dumps(result["summary"], indent=1))
    return 0 if result["summary"]["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
