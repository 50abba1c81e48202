"""An agent restarted beside a busy engine, its replay no longer reaching back, on an otherwise
cold fleet: the fault table's ``agent_restart_no_replay`` scenario run by itself (real
sim-engines, agents and gateway, kvgate_tools/local_fleet.py). Its replica's prefixes must keep
coming to it while the agent relearns them, or the index never reconverges: run alone, before
the gateway kept a snapshot's dropped entries as speculative ones
(``placement.replace_snapshot``), only 66-67 of the 200 recovery requests went there and the
index was still short of the engine after them; inside the full table it passed only because
earlier scenarios had filled the other replicas' caches (docs/agent.md, "Recovery without
replay")."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate_tools.faults import fleet_faults
from kvgate_tools.faults.fleet_faults import FleetCtx
from kvgate_tools.local_fleet import LocalFleet

pytestmark = pytest.mark.timeout(300)


def test_a_restarted_agents_replica_keeps_its_prefixes_on_a_cold_fleet(tmp_path: Path) -> None:
    with LocalFleet(fleet_faults.fleet_options(tmp_path / "fleet")) as fleet:
        result = fleet_faults.agent_restart_no_replay(FleetCtx(fleet))
    print(result.row())
    assert result.passed, result.notes
