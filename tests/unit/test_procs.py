"""kvgate_tools.procs: a restarted child is found ready by what it printed this time; one run's
ports are never drawn twice."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate_tools.procs import REPO_ROOT, LowPorts, ProcessGroup, Ready, low_free_port


def test_a_restarted_child_is_ready_on_its_new_output(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        for port in (1111, 2222):
            cmd = [
                sys.executable,
                "-c",
                f"import time; print('listening port={port}', flush=True); time.sleep(30)",
            ]
            proc, m = group.start("child", cmd, Ready(pattern=r"port=(\d+)"))
            assert m is not None and m.group(1) == str(port)  # not the first run's line, still in the log
            group.stop(proc)
        assert (tmp_path / "child.log").read_text().count("listening") == 2  # one log, appended


class _Replay(random.Random):
    """Draws the given values in order: the same port drawn twice in a row, then others."""

    def __init__(self, values: list[int]) -> None:
        super().__init__(0)
        self.values = values

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:
        value = self.values.pop(0)
        assert stop is not None and start <= value < stop and step == 1  # the range low_free_port draws from
        return value


def test_a_run_never_draws_the_same_port_twice_even_when_unbound() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        busy = low_free_port()
        s.bind(("127.0.0.1", busy))
        free = sorted({low_free_port() for _ in range(6)} - {busy})[:2]
        ports = LowPorts(_Replay([free[0], free[0], busy, free[0], free[1]]))
        first = ports.take()
        # The first port again (not bound by anyone yet), then a bound port: both skipped.
        second = ports.take()
    assert (first, second) == (free[0], free[1])
    assert ports.given == set(free)


def test_sigterm_stops_the_children_of_an_entered_group(tmp_path: Path) -> None:
    """A process killed with SIGTERM inside ``with ProcessGroup`` stops its children on the way out
    (they run in sessions of their own: without the handler they would outlive it)."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from kvgate_tools.procs import ProcessGroup\n"
        f"with ProcessGroup(Path({str(tmp_path)!r})) as group:\n"
        "    child = group.spawn('sleeper', [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "    print(child.pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO_ROOT, text=True)
    assert owner.stdout is not None
    child = int(owner.stdout.readline())
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=30) == -signal.SIGINT  # unwound as from Ctrl-C, not killed by SIGTERM
    with pytest.raises(ProcessLookupError):  # stopped and reaped by the owner, not left running
        os.kill(child, 0)


def test_an_entered_group_leaves_sigterm_as_it_found_it(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with ProcessGroup(tmp_path):
        pass
    assert signal.getsignal(signal.SIGTERM) == before
