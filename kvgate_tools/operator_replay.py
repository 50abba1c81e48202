"""Replay the seeded agent workload (kvgate_tools/demo_workload.py) through a gateway with session
and tenant headers, for the operator view's tests and ``make whatif-demo`` (docs/operators.md).

Each session runs closed-loop (a turn is sent after the previous answer and its think time); the
tenant is the workload's own (the system prompt names it: "agent T of tenant T").
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import aiohttp

from kvgate_tools.demo_workload import Session

_TENANT = re.compile(r"of tenant (\d+)\.")


def tenant_of(s: Session) -> str:
    system = s.turns[0].body["messages"][0]["content"]
    m = _TENANT.search(system)
    return f"tenant-{m.group(1)}" if m else "default"


@dataclass
class ReplayResult:
    requests: int
    errors: int
    wall_s: float
    ttft_s: list[float]  # request sent -> first response bytes, of the answered requests


async def replay_sessions(
    gateway_url: str, sessions: list[Session], tenant_header: str = "x-tenant-id", timeout_s: float = 120.0
) -> ReplayResult:
    url = f"{gateway_url}/v1/chat/completions"
    counts = {"requests": 0, "errors": 0}
    ttfts: list[float] = []
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s), connector=aiohttp.TCPConnector(limit=256)
    ) as http:
        t_start = time.perf_counter()

        async def run_session(s: Session) -> None:
            headers = {"x-session-id": s.session_id, tenant_header: tenant_of(s)}
            await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t_start)))
            for turn in s.turns:
                if turn.think_s:
                    await asyncio.sleep(turn.think_s)
                counts["requests"] += 1
                t0 = time.perf_counter()
                try:
                    async with http.post(url, json=turn.body, headers=headers) as resp:
                        first = await resp.content.readany()
                        ttft = time.perf_counter() - t0
                        while first:
                            first = await resp.content.readany()
                        counts["errors"] += resp.status != 200
                        if resp.status == 200:
                            ttfts.append(ttft)
                except (TimeoutError, aiohttp.ClientError):
                    counts["errors"] += 1

        await asyncio.gather(*(run_session(s) for s in sessions))
        return ReplayResult(counts["requests"], counts["errors"], time.perf_counter() - t_start, ttfts)
