"""The hybrid-attention model of ``make e2e-vllm``: a tiny random-weight Gemma 3 (one
sliding-window layer of 64 tokens, one full-attention layer; ``scripts/make_tiny_model.py --arch
gemma3``), which vLLM runs with two KV-cache groups. One replica on core 0 (the Llama replicas
are stopped by then), an agent and a gateway of its own; the mixed and agent-session workloads,
one request at a time.

vLLM's hit for a hybrid model is the *deepest* key of the request that every group can serve
(a full-attention group the block, the window group the blocks its window needs), not the
longest run of held blocks: a request that shares a document with an earlier one but not its
last window misses entirely. Per request, before it is sent, three predictions are taken and
compared with the engine's ``cached_tokens``:

* ``index``: vLLM's rule applied to the gateway's keys for the replica (``/admin/index``): the
  inventory the agent streamed is exactly what the engine can reuse;
* ``rebuilt``: the same rule on the harness's own reconstruction from the engine's frames;
* ``header``: the gateway's own prediction, ``x-kvgate-matched-tokens``: its index matches this
  replica (hybrid, from the agent's EngineState) by the deepest reported key within the prompt's
  bound, and its speculative entries keep only a routed prompt's last block (docs/e2e-vllm.md).

After every request the gateway's keys must equal the reconstruction's reusable keys.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from e2e import http_client, vllm_replica, workload
from e2e.harness import KV_CACHE_BYTES, Harness, Replica, equal, exact
from e2e.kvgate_procs import Gateway, start_agent
from e2e.vllm_replica import BLOCK_SIZE
from kvgate_tools.procs import LowPorts, ProcessGroup
from router_policies.block_keys import block_keys

HYBRID_MODEL = "tiny-gemma3"
ROOT = Path(__file__).resolve().parent.parent


def ensure_model(vllm_python: Path, model_dir: Path) -> None:
    """Build the tiny Gemma 3 (seconds, offline) when it is missing."""
    if not (model_dir / "model.safetensors").exists():
        cmd = [str(vllm_python), str(ROOT / "scripts/make_tiny_model.py"), "--arch", "gemma3"]
        subprocess.run([*cmd, "--out", str(model_dir)], check=True, capture_output=True)


def prompt_tokens(url: str, req: workload.Req) -> list[int]:
    body: dict[str, Any] = {"model": HYBRID_MODEL}
    if "prompt" in req.body:
        body["prompt"] = req.body["prompt"]
    else:
        body.update({"messages": req.body["messages"], "add_generation_prompt": True})
    resp = http_client.post(url + "/tokenize", body)
    if resp.status != 200:
        raise RuntimeError(f"/tokenize: HTTP {resp.status}")
    tokens: list[int] = resp.json()["tokens"]
    return tokens


def deepest_hit(keys: list[int], reusable: set[int], max_blocks: int) -> int:
    """vLLM's hybrid hit in blocks: the deepest request key among the first ``max_blocks`` that
    the engine can reuse (HybridKVCacheCoordinator.find_longest_cache_hit, vllm 0.32)."""
    for j in range(min(max_blocks, len(keys)) - 1, -1, -1):
        if keys[j] in reusable:
            return j + 1
    return 0


def _fraction(rows: list[dict[str, Any]], field: str) -> tuple[int, int]:
    scored = [r for r in rows if r.get("cached") is not None]
    return sum(1 for r in scored if r.get(field) == r["cached"]), len(scored)


def run(vllm_python: Path, model_dir: Path, logs: Path, seed: int) -> dict[str, Any]:
    """Run the hybrid phase; returns its summary (the ``models`` entry and the details)."""
    ensure_model(vllm_python, model_dir)
    procs = ProcessGroup(logs / "hybrid")
    ports = LowPorts(random.Random(os.getpid() + 1))  # port choice only, as in run.py
    spec = vllm_replica.new_spec("g0", core=0, kv_cache_bytes=KV_CACHE_BYTES, ports=ports)
    replica = Replica("g0", spec, model=HYBRID_MODEL, hybrid=True)
    gateway = Gateway(procs, logs / "hybrid", HYBRID_MODEL, model_dir, [("g0", spec)], ports)
    h = Harness(procs, vllm_python, model_dir, [replica], gateway, model=HYBRID_MODEL)
    rows: list[dict[str, Any]] = []
    try:
        h.start_engine(replica)
        ready = h.wait_engine(replica)
        print(f"e2e: hybrid {HYBRID_MODEL} vLLM ready ({ready:.0f} s)", file=sys.stderr)
        gateway.start("kv_aware")
        start_agent(procs, "g0", spec, HYBRID_MODEL, gateway)
        gateway.wait_agents(["g0"])
        for req in workload.mixed(seed) + workload.agent_sessions(seed):
            tokens = prompt_tokens(spec.url, req)
            keys = block_keys(tokens, BLOCK_SIZE, HYBRID_MODEL)
            bound = (len(tokens) - 1) // BLOCK_SIZE
            index_keys = gateway.index_keys("g0") or set()
            rebuilt = replica.refresh().keys()
            row = h.send(req)
            row["index_predicted"] = deepest_hit(keys, index_keys, bound) * BLOCK_SIZE
            row["rebuilt_predicted"] = deepest_hit(keys, rebuilt, bound) * BLOCK_SIZE
            h.settle()
            row["index_equal_after"] = equal(h.wait_index_equal()["g0"])
            rows.append(row)
        final = h.wait_index_equal()
    finally:
        if replica.tap is not None:
            replica.tap.close()
        procs.stop_all()
    scored = rows[1:]  # the first request is warm-up, as in the Llama phases
    header_exact, total = exact(scored)
    index_exact, index_total = _fraction(scored, "index_predicted")
    rebuilt_exact, _ = _fraction(scored, "rebuilt_predicted")
    held = replica.held
    return {
        "model": {
            "name": HYBRID_MODEL,
            "hybrid": True,
            # the gateway's own prediction (x-kvgate-matched-tokens)
            "prediction_exact_fraction": round(header_exact / total, 4) if total else 0.0,
            "index_equal": all(r["index_equal_after"] for r in rows) and equal(final["g0"]),
            # vLLM's hybrid rule over the gateway's index (what the agent reported)
            "index_prediction_exact_fraction": round(index_exact / index_total, 4) if index_total else 0.0,
        },
        "details": {
            "rows": rows,
            "final_index": final,
            "scored": total,
            "hits": sum(1 for r in scored if r.get("cached")),
            "rebuilt_exact": rebuilt_exact,
            "removed_events": held.removed_events,
            "ready_s": round(ready, 1),
        },
    }
