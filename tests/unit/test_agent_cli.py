"""``kvgate agent`` refuses bad flags with a clear message and exit code 2 (no traceback)."""

from __future__ import annotations

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
    ],
)
def test_bad_flags(override: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, *override]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err
