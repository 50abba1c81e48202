"""Record the KV-event bytes SGLang's own code publishes, for tests/unit/test_sglang_events.py.

Runs in a virtualenv holding ``sglang`` (not kvgate's): SGLang's own ``RadixCache`` (built with
``RadixCache.create_simulated``, the constructor SGLang's tests use; no GPU, no model) caches a fixed
sequence of prompts (shared prefixes, a node split, cache_salt and LoRA namespaces where the version
has them, an eviction), and SGLang's own ``ZmqEventPublisher`` publishes each step's events on
loopback. This script records what a subscriber receives, byte for byte:

* ``live.msgpack``: every multipart message the SUB socket received ([topic, seq, payload]);
* ``replay.msgpack``: the frames the publisher's replay ROUTER sent back to a DEALER asking from
  seq 0 (the delimiter included, as a DEALER receives them);
* ``expected.json``: the version, page size, and every cached path of the radix tree at the end
  (token ids with their LoRA name and cache salt), from which a test recomputes the block keys.

    /work/wt/venvs/sglang/bin/python scripts/record_sglang_events.py tests/data/sglang_events
    PYTHONPATH=/work/wt/venvs/sglang-0.5.19 /work/wt/venvs/sglang/bin/python \\
        scripts/record_sglang_events.py tests/data/sglang_events

(the second form runs another SGLang version installed with ``pip install --no-deps --target``).
SGLang imports ``torchvision`` (multimodal configs) and, before 0.5.1x, ``sgl_kernel`` (CUDA kernels
of the host-memory pool) at module level; when the machine cannot load them (only CUDA builds are
on the index), an empty stand-in module is registered for those imports only: nothing on the
radix-cache or publisher path calls them. The package's ``__init__`` (transformers patches for
model loading) is not run either. See docs/agent.md
("SGLang") and docs/architecture.md.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import random
import sys
import time
import types
from array import array
from pathlib import Path
from typing import Any

MODEL = "sglang-recorded"
LORA_ID = "0123456789abcdef0123456789abcdef"  # a LoRARef.lora_id: 32 hex characters
LORA_NAME = "adapter-x"


class _AbsentModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for imports SGLang makes at module level but never uses on this path."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, name: str, _path: Any, _target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        class _Any(type):
            def __getattr__(cls, attr: str) -> Any:
                return cls

        anything = _Any("Absent", (), {})
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0"  # type: ignore[attr-defined]
        mod.__file__ = f"<absent {spec.name}>"
        mod.__getattr__ = lambda _attr: anything  # type: ignore[method-assign]
        return mod

    def exec_module(self, _module: types.ModuleType) -> None:
        return None


class _Allocator:
    """What the radix cache calls on eviction (freeing KV slots): nothing to free here."""

    device = "cpu"

    def free(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def free_segment(self, *_args: Any, **_kwargs: Any) -> None:
        return None


def _sglang(module: str) -> Any:
    """A module of the installed SGLang (imported at run time: kvgate's venv has no sglang)."""
    return importlib.import_module(f"sglang.srt.{module}")


def _usable(name: str) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    try:
        __import__(name)
    except Exception:
        return False
    return True


class Recorder:
    """One radix cache and one publisher of one SGLang version, at one page size."""

    def __init__(self, out: Path, page_size: int, variant: str) -> None:
        import zmq

        kv_events = _sglang("disaggregation.kv_events")
        radix = _sglang("mem_cache.radix_cache")
        RadixCache = radix.RadixCache

        self.out = out
        self.page_size = page_size
        self.KVEventBatch = kv_events.KVEventBatch
        sim = inspect.signature(RadixCache.create_simulated).parameters
        kwargs: dict[str, Any] = {"page_size": page_size, "enable_kv_cache_events": True}
        kwargs["mock_allocator"] = _Allocator()
        if variant == "dynamo":
            kwargs["dynamo_kv_event_format"] = True  # --kv-events-config '{"format": "dynamo"}'
        self.lora = "kv_event_lora_names" in sim
        if self.lora:
            names = _sglang("mem_cache.events").KvEventLoraNames()
            # what the scheduler does for a request naming the adapter
            names.register(types.SimpleNamespace(extra_key=LORA_ID, lora_id=LORA_ID), LORA_NAME)
            kwargs["kv_event_lora_names"] = names
        self.cache = RadixCache.create_simulated(**kwargs)
        if variant == "eagle":
            # what CacheInitParams(is_eagle=True) sets (speculative decoding with EAGLE: the tree
            # holds bigrams and events carry [token, next token] pairs); create_simulated has no
            # parameter for it
            self.cache.is_eagle = True
        self.RadixKey = radix.RadixKey
        self.salt = "cache_salt" in inspect.signature(radix.RadixKey.__init__).parameters
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        endpoint_id = f"{out.parent.name}-{out.name}"
        pub_ep = f"ipc:///tmp/kvgate-sglang-rec-{endpoint_id}.pub"
        replay_ep = f"ipc:///tmp/kvgate-sglang-rec-{endpoint_id}.replay"
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.publisher = kv_events.ZmqEventPublisher(
            attn_dp_rank=0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv-events"
        )
        self.sub.connect(pub_ep)
        self.replay_ep = replay_ep
        time.sleep(0.3)  # the SUB's subscription reaches the PUB before anything is published
        self.steps = 0

    def key(self, tokens: list[int], lora: bool = False, salt: str | None = None) -> Any:
        kw: dict[str, Any] = {"extra_key": LORA_ID if lora else None}
        if salt is not None:
            kw["cache_salt"] = salt
        ids: Any = array("q", tokens) if "array" in str(inspect.signature(self.RadixKey.__init__)) else tokens
        return self.RadixKey(ids, **kw)

    def insert(self, tokens: list[int], lora: bool = False, salt: str | None = None) -> None:
        self.cache.insert(
            _sglang("mem_cache.base_prefix_cache").InsertParams(key=self.key(tokens, lora, salt))
        )
        self.publish()

    def evict(self, tokens: int) -> None:
        self.cache.evict(_sglang("mem_cache.base_prefix_cache").EvictParams(num_tokens=tokens))
        self.publish()

    def publish(self) -> None:
        events = self.cache.take_events()
        if events:
            self.publisher.publish(self.KVEventBatch(ts=time.time(), events=events))
            self.steps += 1

    def paths(self) -> list[dict[str, Any]]:
        """Every cached node's path from the root: token ids and namespace."""
        out: list[dict[str, Any]] = []
        stack: list[tuple[Any, list[int]]] = [(self.cache.root_node, [])]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                if getattr(child, "evicted", False):
                    continue
                path = prefix + [int(t) for t in child.key.token_ids[: len(child.key)]]
                extra = child.key.extra_key
                out.append(
                    {
                        "tokens": path,
                        "lora_name": LORA_NAME if extra == LORA_ID else None,
                        "cache_salt": getattr(child.key, "cache_salt", None),
                    }
                )
                stack.append((child, path))
        return out

    def finish(self, version: str) -> None:
        import msgpack
        import zmq

        deadline = time.monotonic() + 5.0
        live: list[list[bytes]] = []
        while len(live) < self.steps and time.monotonic() < deadline:
            if self.sub.poll(100):
                live.append(self.sub.recv_multipart())
        if len(live) != self.steps:
            sys.exit(f"recorded {len(live)} live batches of {self.steps}")
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_ep)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replay: list[list[bytes]] = []
        while True:
            if not dealer.poll(5000):
                sys.exit("replay did not answer")
            frames = dealer.recv_multipart()
            replay.append(frames)
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "live.msgpack").write_bytes(msgpack.packb(live))
        (self.out / "replay.msgpack").write_bytes(msgpack.packb(replay))
        expected = {
            "sglang_version": version,
            "page_size": self.page_size,
            "model": MODEL,
            "salt": self.salt,
            "lora": self.lora,
            "paths": self.paths(),
        }
        (self.out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
        dealer.close(linger=0)
        self.sub.close(linger=0)
        self.publisher.shutdown()


def scenario(rec: Recorder, rng: random.Random) -> None:
    """Prompts sharing prefixes, a split, namespaces, an eviction, more prompts."""

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, 50_000) for _ in range(n)]

    a = fresh(64)
    rec.insert(a)
    rec.insert(a[:32] + fresh(40))  # splits a's node at 32
    rec.insert(a[:48] + fresh(16))
    if rec.salt:
        rec.insert(a[:40], salt="tenant-a")  # same tokens, another namespace
        rec.insert(a[:24] + fresh(24), salt="tenant-a")
    if rec.lora:
        rec.insert(a[:48], lora=True)
        if rec.salt:
            rec.insert(a[:32], lora=True, salt="tenant-b")
    rec.evict(24)  # the least recently used leaves go
    rec.insert(fresh(80))
    rec.insert(a)  # re-caches what the eviction took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory for <version>/page<N>/ recordings")
    ap.add_argument("--page-sizes", default="1,16")
    args = ap.parse_args()
    absent = tuple(name for name in ("torchvision", "sgl_kernel") if not _usable(name))
    if absent:
        sys.meta_path.insert(0, _AbsentModule(absent))
    from importlib.metadata import version as dist_version

    version = dist_version("sglang")
    # The package's __init__ patches transformers for model loading (and breaks on a transformers
    # its pins do not name); the radix cache and publisher need none of it: load the package
    # without running it.
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations is not None
    root = Path(next(iter(spec.submodule_search_locations)))
    # the sglang imported must be the version named by its metadata (PYTHONPATH installs)
    assert root.parent.name in {"site-packages", f"sglang-{version}"}, root
    package = types.ModuleType("sglang")
    package.__path__ = [str(root)]
    sys.modules["sglang"] = package
    radix = _sglang("mem_cache.radix_cache")
    runs = [(int(p), "") for p in args.page_sizes.split(",")]
    if "dynamo_kv_event_format" in inspect.signature(radix.RadixCache.create_simulated).parameters:
        runs += [(16, "dynamo"), (1, "eagle")]  # the event shapes of two more modes
    for ps, variant in runs:
        name = f"page{ps}-{variant}" if variant else f"page{ps}"
        rec = Recorder(args.out / version / name, ps, variant)
        scenario(rec, random.Random(ps))
        rec.finish(version)
        print(f"sglang {version} {name}: {rec.steps} batches -> {rec.out}")


if __name__ == "__main__":
    main()
