"""Child processes the harness starts: each in its own process group, logged to a file, and
stopped (TERM, then KILL) by the owner that started it.

Invariant: every process the harness starts is registered in one ``ProcessSet`` before the
harness does anything else that could fail, and ``ProcessSet.stop_all`` runs in a ``finally``, so
a failing check never leaves an engine, agent or gateway behind. Processes stop in the reverse
of their start order (gateway, then agents, then engines), so that no consumer outlives its
producer and logs a burst of reconnect errors.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(rng: random.Random) -> int:
    """A TCP port free on 127.0.0.1 a moment ago, below the kernel's ephemeral range.

    Engines and the gateway come back at the same ports after a restart, and meanwhile agents and
    taps keep reconnecting to them. A connect to a free port inside the ephemeral range can be
    given that very port as its source and connect to itself, holding the port the restarted
    listener needs; below the range that cannot happen. ``rng`` is seeded by the caller (with the
    pid, so that concurrent runs try different ports); each port is checked free by binding it.
    """
    high = _ephemeral_low()
    low = max(1024, high - 12_768)
    for _ in range(500):
        port = rng.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        self.log_file.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """TERM the whole process group, KILL it after ``grace_s``; always reap the leader."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        # The leader may be gone while its children (vLLM's engine core) still run: KILL the group
        # regardless; the group id stays valid while any member lives.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        self.log_file.close()


@dataclass
class ProcessSet:
    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log_file = log_path.open("ab")
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        proc = subprocess.Popen(
            list(argv),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=str(cwd) if cwd else None,
            start_new_session=True,  # its own process group, so killpg reaches its children
        )
        child = Child(name, proc, log_path, log_file)
        self.children.append(child)
        return child

    def stop(self, child: Child) -> None:
        child.stop()
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        for child in reversed(list(self.children)):
            child.stop()
        self.children.clear()


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_http_ok(url: str, child: Child, deadline_s: float, interval_s: float = 0.25) -> float:
    """Poll ``url`` until it answers 2xx; return the seconds waited. Fails early if the child died."""
    t0 = time.monotonic()
    while True:
        if http_ok(url, timeout_s=min(2.0, max(0.2, interval_s * 4))):
            return time.monotonic() - t0
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}")
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"{child.name} not ready at {url} after {deadline_s:.0f} s:\n{child.tail()}")
        time.sleep(interval_s)
