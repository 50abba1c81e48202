"""Record a real vLLM's KV-event bytes, replay answers, /tokenize and /metrics outputs into
``tests/data/vllm_events/`` for the agent's decoding tests.

    .venv/bin/python -m e2e.capture --name int_hashes
    .venv/bin/python -m e2e.capture --name digest_hashes --digest-hashes
    .venv/bin/python -m e2e.capture --name hybrid_gemma3 --model models/tiny-gemma3   # served as tiny-gemma3

One replica is started on core 0 with a 2 MiB KV budget (64 blocks of 32 tokens), so the
workload (completions sharing prefixes, then multi-turn chats with a system prompt, then a prefix
cache reset) produces BlockStored, BlockRemoved and AllBlocksCleared. Every frame is saved raw, as
hex, with the requests that caused it and the engine's answers, so a test can replay the exact
bytes and check what it decodes against what the engine reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from e2e import http_client, vllm_replica
from e2e.event_tap import EventTap, Frame, HeldBlocks, decode_payload, replay
from e2e.workload import Corpus
from kvgate_tools.procs import LowPorts, ProcessGroup

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"


def _frame_json(f: Frame) -> dict[str, Any]:
    return {"topic": f.topic.decode(errors="replace"), "seq": f.seq, "payload_hex": f.payload.hex()}


def _requests(seed: int) -> list[tuple[str, dict[str, Any]]]:
    c = Corpus.load(seed)
    doc = c.text(300)
    gen = {"max_tokens": 3, "temperature": 0.0, "seed": 0}
    out: list[tuple[str, dict[str, Any]]] = []
    for q in range(3):
        out.append(("/v1/completions", {"prompt": f"{doc}\n\nQuestion {q}: {c.text(30)}\nAnswer:", **gen}))
    system = "You are a terse assistant. " + c.text(80)
    msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
    for t in range(3):
        msgs.append({"role": "user", "content": f"Turn {t}: {c.text(60)}"})
        out.append(("/v1/chat/completions", {"messages": [dict(m) for m in msgs], **gen}))
        msgs.append({"role": "assistant", "content": c.text(30)})
    # Distinct long prompts overflow the 64-block budget and force BlockRemoved events.
    for i in range(4):
        out.append(("/v1/completions", {"prompt": f"Filler {i}. {c.text(600)}", **gen}))
    # The first document again: partly evicted by now, so a partial hit and new stores.
    out.append(("/v1/completions", {"prompt": f"{doc}\n\nQuestion 0: again\nAnswer:", **gen}))
    return out


def capture(python: Path, model_dir: Path, out_dir: Path, name: str, int_hashes: bool, seed: int) -> Path:
    model_name = MODEL if model_dir.name == "tiny-llama" else model_dir.name
    procs = ProcessGroup(ROOT / "out/capture-logs" / name)
    spec = vllm_replica.new_spec(
        "vllm-capture",
        core=0,
        kv_cache_bytes=2 * 1024 * 1024,
        ports=LowPorts(random.Random(os.getpid())),
        int_hashes=int_hashes,
        max_model_len=1024,
    )
    tap: EventTap | None = None
    try:
        proc = vllm_replica.spawn(procs, spec.name, python, model_dir, model_name, spec)
        tap = EventTap(spec.events_endpoint)
        ready_s = vllm_replica.wait_ready(procs, spec.name, proc, spec)
        print(f"vLLM ready after {ready_s:.1f} s on {spec.url}", file=sys.stderr)
        records: list[dict[str, Any]] = []
        tokenized: list[dict[str, Any]] = []
        for path, body in _requests(seed):
            full = {"model": model_name, **body}
            before = len(tap.snapshot())
            resp = http_client.post(spec.url + path, full)
            tap.wait_quiet(0.4)
            after = len(tap.snapshot())
            data = resp.json()
            records.append(
                {
                    "path": path,
                    "request": full,
                    "status": resp.status,
                    "usage": data.get("usage"),
                    "cached_tokens": http_client.cached_tokens(data.get("usage")),
                    "frames": [before, after],  # indexes into "frames" this request produced
                }
            )
            tok_body: dict[str, Any] = {"model": model_name}
            if "prompt" in body:
                tok_body["prompt"] = body["prompt"]
            else:
                tok_body.update({"messages": body["messages"], "add_generation_prompt": True})
            tok = http_client.post(spec.url + "/tokenize", tok_body)
            tokenized.append({"request": tok_body, "status": tok.status, "response": tok.json()})
        metrics = http_client.get(spec.url + "/metrics").body.decode()
        frames_before_reset = len(tap.snapshot())
        reset = http_client.post(spec.url + "/reset_prefix_cache", None)
        # AllBlocksCleared arrives only with the next engine step: send one more request.
        last = http_client.post(
            spec.url + "/v1/completions", {"model": model_name, "prompt": "After the reset.", "max_tokens": 2}
        )
        tap.wait_quiet(0.6)
        frames = tap.snapshot()
        replay_all = replay(spec.replay_endpoint, 0)
        mid = frames[len(frames) // 2].seq if frames else 0
        replay_mid = replay(spec.replay_endpoint, mid)
        replay_future = replay(spec.replay_endpoint, (frames[-1].seq + 100) if frames else 100)
        held = HeldBlocks(model_name, vllm_replica.BLOCK_SIZE)
        held.apply_frames(frames[:frames_before_reset])
        counts: dict[str, int] = {}
        for f in frames:
            for ev in decode_payload(f.payload)[1]:
                counts[ev["type"]] = counts.get(ev["type"], 0) + 1
        doc = {
            "about": "Raw KV-event frames of a real vLLM, captured by e2e/capture.py; see README.md.",
            "vllm_version": vllm_replica.vllm_version(python),
            "captured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": model_name,
            "block_size": vllm_replica.BLOCK_SIZE,
            "kv_cache_bytes": spec.kv_cache_bytes,
            "int_block_hashes": int_hashes,
            "launch_flags": vllm_replica.argv(
                Path("python"), Path("models") / model_dir.name, model_name, spec
            )[1:],
            "launch_env": vllm_replica.env(spec),
            "event_counts": counts,
            "frames": [_frame_json(f) for f in frames],
            "requests": records,
            "tokenize": tokenized,
            "reset_prefix_cache": {"status": reset.status, "then_request_status": last.status},
            "frames_before_reset": frames_before_reset,
            "held_blocks_before_reset": len(held.engine),
            "replay": {
                "from_0": [_frame_json(f) for f in replay_all],
                "from_mid": {"start_seq": mid, "answers": [_frame_json(f) for f in replay_mid]},
                "from_future": {
                    "start_seq": (frames[-1].seq + 100) if frames else 100,
                    "answers": [_frame_json(f) for f in replay_future],
                },
            },
            "metrics": metrics,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        out_path = out_dir / f"{name}.json"
        out_path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out_path}: {len(frames)} frames, events {counts}", file=sys.stderr)
        return out_path
    finally:
        if tap is not None:
            tap.close()
        procs.stop_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", type=Path, default=ROOT / ".venv-vllm/bin/python")
    ap.add_argument("--model", type=Path, default=ROOT / "models/tiny-llama")
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/vllm_events")
    ap.add_argument("--name", default="int_hashes")
    ap.add_argument("--digest-hashes", action="store_true", help="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    capture(args.python, args.model, args.out, args.name, not args.digest_hashes, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
