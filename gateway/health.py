"""Active health checks: ``GET {url}/health`` on every replica each ``health.interval_s``.

Owned by the app: ``start()`` runs one round before returning (so the gateway knows which
replicas are up before it accepts traffic), then a background loop; ``stop()`` cancels the loop
and waits for it. A round checks every replica concurrently, each bounded by ``health.timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from gateway.asyncio_tasks import cancel_and_wait
from gateway.config import HealthConfig
from gateway.fleet import Fleet

log = logging.getLogger("kvgate.health")


class HealthChecker:
    def __init__(
        self, fleet: Fleet, session: aiohttp.ClientSession, config: Callable[[], HealthConfig]
    ) -> None:
        self._fleet = fleet
        self._session = session
        self._config = config  # read each round, so a reload applies to the next one
        self._task: asyncio.Task[None] | None = None

    async def _check(self, replica: str, url: str, timeout_s: float) -> None:
        try:
            async with self._session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                await resp.read()
                ok = resp.status == 200
                error = "" if ok else f"/health returned {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, error = False, f"/health failed: {type(exc).__name__}: {exc}"
        rec = self._fleet.get(replica)
        was = rec.health.healthy if rec else None
        self._fleet.check_result(replica, ok, error)  # the fleet is the health machine's caller
        if rec is not None and self._fleet.get(replica) is rec and rec.health.healthy != was:
            if rec.health.healthy:
                log.info("replica %s is healthy", replica)
            else:
                log.warning("replica %s is unhealthy: %s", replica, error)

    async def run_round(self) -> None:
        cfg = self._config()
        recs = self._fleet.records()
        if recs:
            await asyncio.gather(*(self._check(r.id, r.identity.url, cfg.timeout_s) for r in recs))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._config().interval_s)
            try:
                await self.run_round()
            except Exception:  # a bug in one round must not end health checking
                log.exception("health round failed")

    async def start(self) -> None:
        await self.run_round()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvgate-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
