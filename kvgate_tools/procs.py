"""Child processes for the demo, the tests' harness and the benchmarks: one supervisor
(docs/architecture.md).

Invariants:
- every child starts in its own session (``start_new_session``), so that its process group holds
  it and whatever it forks, and ``stop_group`` reaches them all: SIGTERM to the group, a grace
  period, then SIGKILL to the group even when the leader has already exited (its children may
  not have), and the leader is always reaped;
- a ``ProcessGroup`` registers a child before it returns it, and ``stop_all`` (run by ``with``
  on every exit path) stops its children newest first: a client of a server was started after it,
  so it stops before it and does not log a burst of reconnect errors.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import select
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago (the kernel's pick, inside the ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def low_free_port(rng: random.Random | None = None) -> int:
    """A TCP port free on 127.0.0.1 a moment ago, below the kernel's ephemeral range.

    For a process that restarts at the same address while its clients keep reconnecting: a connect
    to a free port inside the ephemeral range can be given that very port as its source and connect
    to itself, holding the port the restarted listener needs; below the range that cannot happen.
    Without ``rng`` the pick comes from the OS's randomness, so concurrent runs try different ports;
    each port is checked free by binding it.
    """
    return _draw_low_port(rng or random.SystemRandom(), frozenset())


@dataclass
class LowPorts:
    """The ports of one run's processes, drawn as ``low_free_port`` draws them, none drawn twice.

    A port is checked free when it is drawn, but the process that binds it may start much later:
    two draws of a run before either process starts could pick the same port (the e2e's LoRA check
    once lost a replica's API port to the other replica's engine, which had bound it for its KV
    events). Invariant: ``take`` never returns a port in ``given``, and adds what it returns.
    """

    rng: random.Random
    given: set[int] = field(default_factory=set)

    def take(self) -> int:
        port = _draw_low_port(self.rng, frozenset(self.given))
        self.given.add(port)
        return port


def _draw_low_port(pick: random.Random, avoid: frozenset[int]) -> int:
    high = _ephemeral_low()
    low = max(1024, high - 12_768)
    for _ in range(500):
        port = pick.randrange(low, high)
        if port in avoid:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def stop_group(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
    """Send ``sig`` to ``proc``'s process group, SIGKILL the group after ``grace_s``; reap the leader."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    # the leader may be gone while its children still run: the group id stays valid while any lives
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def read_line(proc: subprocess.Popen[bytes], pattern: str, timeout_s: float = 30.0) -> re.Match[str]:
    """The first line of ``proc``'s piped stdout matching ``pattern`` (its readiness line)."""
    assert proc.stdout is not None, "read_line needs a child started with stdout_pipe=True"
    end = time.monotonic() + timeout_s
    buf = b""
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before printing {pattern!r}: {buf!r}")
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if not ready:
            continue
        buf += os.read(proc.stdout.fileno(), 4096)
        for line in buf.decode(errors="replace").splitlines():
            m = re.search(pattern, line)
            if m:
                return m
    raise TimeoutError(f"no line matching {pattern!r} after {timeout_s}s: {buf!r}")


@dataclass(frozen=True)
class Ready:
    """How to tell a child is ready: a regular expression its log matches, or a URL answering 2xx
    (neither: ready once started)."""

    pattern: str | None = None
    url: str | None = None
    timeout_s: float = 60.0


def interrupt_on_signal(_signum: int, _frame: FrameType | None) -> None:
    """A signal handler that acts as Ctrl-C: scripts unwind their ``with`` and ``finally``
    blocks (stopping their children), and pytest ends the session, tearing its fixtures down,
    rather than counting one failed test and going on."""
    raise KeyboardInterrupt


@dataclass
class ProcessGroup:
    """The owner of a set of child processes; ``with ProcessGroup(log_dir) as group:`` stops each.

    A child's stdout and stderr go to ``log_dir/<name>.log``, or, with ``stdout_pipe``, stdout to a
    pipe the caller reads (``read_line``) and stderr to the log. ``env`` replaces the environment
    (default: this process's), ``extra_env`` is added to it; children start in ``cwd``.
    """

    log_dir: Path
    cwd: Path = REPO_ROOT
    started: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    _log_start: dict[str, int] = field(default_factory=dict)  # a log's size when its child started
    _owns_sigterm: bool = field(default=False, init=False)  # __enter__ installed the SIGTERM handler

    def __enter__(self) -> ProcessGroup:
        # SIGTERM (a CI job's timeout, `kill`) would end this process without ``__exit__``, and
        # the children, each in its own session, would run on: while the group is entered, SIGTERM
        # unwinds like Ctrl-C (main thread only, and only where nobody handles it already)
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, interrupt_on_signal)
            self._owns_sigterm = True
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._owns_sigterm:  # a second SIGTERM must not cut the children's stop short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self.stop_all()
        finally:
            if self._owns_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self._owns_sigterm = False

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def spawn(
        self,
        name: str,
        cmd: Sequence[str],
        env: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        stdout_pipe: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` without waiting (start several, then ``wait_ready`` each: they boot in
        parallel)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        full_env = {**(os.environ if env is None else env), **(extra_env or {})}
        with self.log_path(name).open("ab") as log:
            # a restarted child appends to its log: ``wait_ready`` reads from here on only
            self._log_start[name] = log.tell()
            proc = subprocess.Popen(
                list(cmd),
                stdout=subprocess.PIPE if stdout_pipe else log,
                stderr=log if stdout_pipe else subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=self.cwd,
                start_new_session=True,  # its own process group, so that stop_group reaches its children
            )
        self.started.append((name, proc))
        return proc

    def start(
        self, name: str, cmd: Sequence[str], ready: Ready, extra_env: Mapping[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], re.Match[str] | None]:
        """``spawn`` then ``wait_ready``: the process and the match of ``ready.pattern`` (if any)."""
        proc = self.spawn(name, cmd, extra_env=extra_env)
        return proc, self.wait_ready(name, proc, ready)

    def tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, name: str, proc: subprocess.Popen[bytes], ready: Ready) -> re.Match[str] | None:
        """Poll until ``ready`` holds; fails early, with the log's tail, if the child exits."""
        log = self.log_path(name)
        deadline = time.monotonic() + ready.timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {log}:\n{self.tail(name)}")
            if ready.pattern is not None:
                with log.open("rb") as f:
                    f.seek(self._log_start.get(name, 0))
                    m = re.search(ready.pattern, f.read().decode(errors="replace"))
                if m:
                    return m
            elif ready.url is None or http_ok(ready.url):
                return None
            time.sleep(0.05)
        raise RuntimeError(f"{name} not ready after {ready.timeout_s}s; see {log}:\n{self.tail(name)}")

    def stop(self, proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> int:
        """Stop one child (see ``stop_group``) and forget it; its exit status."""
        stop_group(proc, grace_s=grace_s)
        self.started = [(n, p) for n, p in self.started if p is not proc]
        return proc.returncode

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child, newest first, then wait for each; one still alive after ``grace_s``
        (counted once for all) gets SIGKILL with its group."""
        procs = [p for _n, p in reversed(self.started)]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            stop_group(proc, grace_s=max(0.1, deadline - time.monotonic()))
        self.started = []
