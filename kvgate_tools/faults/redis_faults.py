"""Redis killed and restarted under two gateways sharing state (docs/faults.md, docs/shared-state.md):
gateway A holds the agents' streams, gateway B follows A's index through Redis; load on both.

Must hold: 0 lost, and both gateways' indexes equal the engines' caches <= 5 s after Redis is back.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import yaml

from kvgate_tools.faults.common import Call, Load, Result, Sampler, Tally, chat_body, wait_exact
from kvgate_tools.faults.fleet_faults import CLIENT_BOUND_S, clean, prompt
from kvgate_tools.local_fleet import FleetOptions, LocalFleet
from kvgate_tools.procs import ProcessGroup, Ready, free_port
from kvgate_tools.redis_server import RedisServer, shared_fleet_config

REDIS_DOWN_S = 3.0


def start_b(fleet: LocalFleet, group: ProcessGroup, tmp: Path) -> str:
    """Gateway B: A's config on its own ports, without agents."""
    cfg = fleet.gateway_config()
    port = free_port()
    cfg["listen"] = {"http": f"127.0.0.1:{port}", "inventory": f"127.0.0.1:{free_port()}"}
    path = tmp / "gateway-b.yaml"
    path.write_text(yaml.safe_dump(cfg))
    url = f"http://127.0.0.1:{port}"
    env = {"KVGATE_ADMIN_TOKEN": fleet.opts.admin_token}
    group.start(
        "gateway-b",
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        Ready(url=url + "/ready"),
        env,
    )
    return url


def redis_restart_two_gateways(tmp: Path) -> Result:
    tmp.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(tmp)
    redis.start()
    tally = Tally()
    try:
        opts = FleetOptions(
            replicas=2, cache_blocks=2048, extra_config=shared_fleet_config(redis), log_dir=tmp
        )
        with LocalFleet(opts) as fleet, ProcessGroup(tmp) as group:
            b_url = start_b(fleet, group, tmp)
            gateways = [fleet.gateway_url, b_url]

            def make(i: int) -> Call:
                return Call(
                    gateways[i % 2], chat_body(prompt(i), stream=i % 3 == 0), timeout_s=CLIENT_BOUND_S
                )

            warm = wait_exact(fleet, [0, 1], 15.0, gateways)
            with Sampler(fleet.gateway_proc().pid) as s, Load(make, 4, tally):
                time.sleep(2.0)
                assert redis.proc is not None
                redis.proc.send_signal(signal.SIGKILL)
                redis.stop()
                time.sleep(REDIS_DOWN_S)
                redis.start()
                back = time.monotonic()
                time.sleep(1.0)
            rec = wait_exact(fleet, [0, 1], 15.0, gateways)
            reconverge = None if rec is None else time.monotonic() - back
    finally:
        redis.stop()
    ok = clean(tally) and reconverge is not None and reconverge <= 5.0
    notes = f"both exact before the fault: {warm is not None}; Redis down {REDIS_DOWN_S} s under load; reconverge from its restart (1 s of load)"
    return Result("redis_restart_two_gateways", tally, reconverge, s.peak_rss_mb, ok, notes)
