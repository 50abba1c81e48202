"""The live bench replays only once kvgate's agents are connected (``bench/live_kvgate.py``,
``wait_agents``): an agent still starting shares the two cores with the first requests and
leaves the index empty while they are routed. Real processes: one sim-engine, ``kvgate serve``,
one ``kvgate agent``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import live_fleet, live_kvgate
from kvgate_tools.procs import ProcessGroup


def test_the_replay_waits_for_every_agent_and_no_longer(tmp_path: Path) -> None:
    args = argparse.Namespace(time_scale=0.25, cache_blocks=64)
    with ProcessGroup(tmp_path) as procs:
        fleet = live_fleet.start_fleet(procs, 1, args)
        http, inventory = live_kvgate.start_kvgate(procs, [u for u, *_ in fleet], tmp_path, {}, {})
        # no agent yet: the metrics' ``kvgate_inventory_streams_refused_created`` lines (a Unix
        # time each) once passed for connected streams
        with pytest.raises(TimeoutError):
            live_kvgate.wait_agents(http, 1, timeout_s=1.0)
        live_kvgate.start_agents(procs, fleet, inventory)
        live_kvgate.wait_agents(http, 1, timeout_s=30.0)
