"""kvgate_tools.procs: a restarted child is found ready by what it printed this time."""

from __future__ import annotations

import sys
from pathlib import Path

from kvgate_tools.procs import ProcessGroup, Ready


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
