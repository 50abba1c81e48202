"""``kvgate agent`` refuses bad flags with a clear message and exit code 2 (no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.cli import main

BASE = ["agent", "--replica-id", "r0", "--engine-url", "http://127.0.0.1:1", "--events", "tcp://127.0.0.1:2",
        "--gateway", "127.0.0.1:3"]  # fmt: skip


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (["--events", "127.0.0.1:2"], "--events: expected a ZMQ endpoint"),
        (["--replay", "http://x"], "--replay: expected a ZMQ endpoint"),
        (["--gateway", "nohost"], "--gateway: expected HOST:PORT"),
        (["--engine-url", "127.0.0.1:1"], "--engine-url: expected http(s)"),
        (["--block-size", "0"], "--block-size: must be positive"),
        (["--reconnect-max", "0"], "--reconnect-max: must be positive"),
        (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca: cannot read"),
        (["--nice", "20"], "--nice: must be in [0, 19]"),
        (["--nice", "-1"], "--nice: must be in [0, 19]"),
    ],
)
def test_bad_flags(override: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, *override]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err


def _nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads niceness from /proc")
@pytest.mark.parametrize(("flags", "added"), [([], 10), (["--nice", "3"], 3), (["--nice", "0"], 0)])
def test_the_agent_lowers_its_cpu_priority(flags: list[str], added: int) -> None:
    """A real ``kvgate agent`` process (its engine and gateway absent: it keeps retrying) runs
    at its parent's niceness plus ``--nice`` (default 10)."""
    cmd = [sys.executable, "-m", "gateway.cli", *BASE, "--log-level", "ERROR", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        want = min(19, os.nice(0) + added)
        deadline = time.monotonic() + 30
        while _nice_of(proc.pid) != want and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the agent exited"
        assert _nice_of(proc.pid) == want
        time.sleep(0.5)  # its start-up done (connect attempts under way): still there
        assert _nice_of(proc.pid) == want
    finally:
        proc.terminate()
        proc.wait(timeout=10)
