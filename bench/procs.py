"""Processes the benchmarks start: each is owned by a ``Procs`` group that stops them all, in the
reverse order of starting (clients of a process stop before it), on exit or error.

Also reads a process tree's CPU time from /proc (utime + stime of the process, its threads, and
its live descendants), which is how the benchmarks charge CPU seconds to a gateway.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

_TICK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def threads_cpu_s(pid: int, name: str) -> float:
    """CPU seconds used so far by the threads of ``pid`` whose OS name is ``name``."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() != name:
                continue
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2 :].split()
        total += (int(rest[11]) + int(rest[12])) / _TICK
    return total


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root`` and its live descendants."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                parents[int(entry)], cpu[int(entry)] = st
    total = 0.0
    for pid, c in cpu.items():
        p = pid
        while p and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += c
    return total


class Procs:
    """A group of child processes; ``with Procs() as procs: ...`` stops every one on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def __enter__(self) -> Procs:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        ready_pattern: str | None = None,
        ready_url: str | None = None,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> tuple[subprocess.Popen[bytes], re.Match[str] | None]:
        """Start ``cmd`` with stdout/stderr in ``log_dir/name.log``; wait until a line matches
        ``ready_pattern`` or ``ready_url`` answers 200."""
        proc = self.spawn(name, cmd, env)
        return proc, self.wait_ready(name, proc, ready_pattern, ready_url, timeout_s)

    def spawn(
        self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` without waiting (start several, then ``wait_ready`` each: they boot in
        parallel)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{name}.log").open("wb") as f:
            proc = subprocess.Popen(
                list(cmd),
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=ROOT,  # ``python -m bench.x`` resolves from the repository root
                start_new_session=True,
            )
        self.started.append((name, proc))
        return proc

    def wait_ready(
        self,
        name: str,
        proc: subprocess.Popen[bytes],
        ready_pattern: str | None = None,
        ready_url: str | None = None,
        timeout_s: float = 60.0,
    ) -> re.Match[str] | None:
        log = self.log_dir / f"{name}.log"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}; see {log}:\n{log.read_text()[-3000:]}"
                )
            if ready_pattern is not None:
                m = re.search(ready_pattern, log.read_text(errors="replace"))
                if m:
                    return m
            elif ready_url is not None:
                try:
                    with urllib.request.urlopen(ready_url, timeout=1) as r:
                        if r.status == 200:
                            return None
                except OSError:
                    pass
            else:
                return None
            time.sleep(0.05)
        raise RuntimeError(f"{name} not ready after {timeout_s}s; see {log}:\n{log.read_text()[-3000:]}")

    def stop(self, proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.started = [(n, p) for n, p in self.started if p is not proc]

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every process, newest first (clients before the servers they use), then wait
        for each; one still alive after ``timeout_s`` gets SIGKILL."""
        procs = [p for _n, p in reversed(self.started)]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.started = []
