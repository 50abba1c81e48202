"""The soak (docs/faults.md): multi-turn chat sessions through a live fleet (2 sim-engines,
agents, ``kvgate serve``) for a given duration, sampling the gateway's RSS and open fds.

Sessions: request ``i`` belongs to session ``i % SESSIONS``; each session's conversation grows by
one user/assistant turn per request up to ``TURNS`` turns, then a new session (new id, new system
prompt) starts, so the traffic keeps bringing new content while each prompt stays bounded.

Must hold: every request answered 200 (0 errors), RSS slope ~0 after warm-up (<= SLOPE_MB_PER_MIN,
a least-squares fit), open fds bounded (peak within FD_SLACK of the warm-up level).
"""

from __future__ import annotations

import time
from pathlib import Path

from kvgate_tools.faults.common import Call, Load, Result, Sampler
from kvgate_tools.faults.fleet_faults import CLIENT_BOUND_S
from kvgate_tools.local_fleet import FleetOptions, LocalFleet

SESSIONS = 8
TURNS = 12
SLOPE_MB_PER_MIN = 2.0
FD_SLACK = 32
# The gateway's caches are bounded in bytes with defaults of 64-256 MiB, which this traffic would
# take longer than the soak to fill: small budgets fill during the warm-up, so that growth after it
# is what no bound holds (a leak).
SMALL_BUDGETS = {
    "proxy": {"tokenize_cache_bytes": 8 << 20},
    "operator": {"lifetime": {"max_tracked_blocks": 16_384, "session_bytes": 2 << 20}},
}
WARMUP_FRACTION = 0.5  # caches fill during the first half; the slope is judged on the second


def session_call(base: str, i: int) -> Call:
    sid, n = i % SESSIONS, i // SESSIONS
    epoch, turn = divmod(n, TURNS)
    system = f"Session {epoch}-{sid}. " + " ".join(f"ctx{epoch}-{sid}-{j}" for j in range(40))
    messages = [{"role": "system", "content": system}]
    for t in range(turn + 1):
        messages.append(
            {"role": "user", "content": f"Turn {t}: " + " ".join(f"q{(t * 7 + j) % 89}" for j in range(15))}
        )
        if t < turn:
            messages.append({"role": "assistant", "content": f"Answer {t} for session {epoch}-{sid}."})
    body = {"model": "kvgate-tiny", "messages": messages, "max_tokens": 8, "stream": i % 2 == 0}
    return Call(base, body, headers={"x-session-id": f"s{epoch}-{sid}"}, timeout_s=CLIENT_BOUND_S)


def slope_mb_per_min(samples: list[tuple[float, float, int]]) -> float:
    """Least-squares slope of RSS over time."""
    if len(samples) < 3:
        return 0.0
    ts = [s[0] for s in samples]
    ys = [s[1] for s in samples]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    cov = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True))
    return 0.0 if var == 0 else cov / var * 60.0


def soak(tmp: Path, duration_s: float) -> Result:
    opts = FleetOptions(replicas=2, cache_blocks=1024, log_dir=tmp, extra_config=SMALL_BUDGETS)
    with (
        LocalFleet(opts) as fleet,
        Sampler(fleet.gateway_proc().pid, interval_s=1.0) as s,
        Load(lambda i: session_call(fleet.gateway_url, i), 4) as load,
    ):
        time.sleep(duration_s)
    tally = load.tally
    t0 = s.samples[0][0] if s.samples else 0.0
    steady = [x for x in s.samples if x[0] - t0 >= duration_s * WARMUP_FRACTION]
    slope = slope_mb_per_min(steady)
    fds_warm = steady[0][2] if steady else 0
    fds_peak = max((x[2] for x in steady), default=0)
    errors = tally.sent - tally.counts["ok"]
    step = max(1, len(s.samples) // 10)
    series = ", ".join(f"{x[1]:.0f}" for x in s.samples[::step])
    ok = tally.sent > 0 and errors == 0 and slope <= SLOPE_MB_PER_MIN and fds_peak <= fds_warm + FD_SLACK
    notes = (
        f"{duration_s:.0f} s, {tally.sent} requests in {SESSIONS} concurrent sessions; RSS slope "
        f"{slope:+.2f} MB/min after warm-up (bound {SLOPE_MB_PER_MIN}); RSS MB over the run: {series}; "
        f"fds {fds_warm}->peak {fds_peak}; errors {errors}"
    )
    return Result("soak_sessions", tally, None, s.peak_rss_mb, ok, notes)
