"""The live bench's CPU per request (``bench/live.py``: ``router_cpu_s``): what the processes
``start_router`` started used, the router's (with its children) apart from kvgate's agents, on
real processes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.live import router_cpu_s
from kvgate_tools.procs import ProcessGroup

SPIN = "import time\nwhile True:\n    sum(range(10_000))\n"
# a router whose work is done by a child process: the child's CPU is the router's
PARENT = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {SPIN!r}])\ntime.sleep(60)\n"
IDLE = "import time\ntime.sleep(60)\n"


def test_the_routers_tree_is_charged_apart_from_its_agents(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as procs:
        procs.spawn("engine0", [sys.executable, "-c", IDLE])  # started before the router: not its
        ours = len(procs.started)
        procs.spawn("kvgate", [sys.executable, "-c", PARENT])
        procs.spawn("agent0", [sys.executable, "-c", IDLE])
        procs.spawn("agent1", [sys.executable, "-c", SPIN])
        time.sleep(0.5)  # the child is started
        before = router_cpu_s(procs.started[ours:])
        time.sleep(1.0)
        after = router_cpu_s(procs.started[ours:])
        router, agents = after[0] - before[0], after[1] - before[1]
        # the router's own process sleeps: what it used is its child's spinning; agent1 spins
        assert router > 0.05 and agents > 0.05
        procs.stop_all()
        gone = router_cpu_s(procs.started[ours:])
    assert gone == (0.0, 0.0)  # exited processes count nothing
