"""The first-byte wait (gateway/upstream_watch.py): deadlines kept by one watch task without a
timer per wait, short waits on their own timer, and the failover of waits on an ejected replica."""

from __future__ import annotations

import asyncio

import pytest

from gateway.replica_identity import ReplicaIdentity
from gateway.replica_record import ReplicaRecord
from gateway.upstream_watch import WATCH_INTERVAL_S, EjectionWatch


def _record(healthy: bool = True) -> ReplicaRecord:
    rec = ReplicaRecord(ReplicaIdentity("r0", "http://127.0.0.1:1", frozenset(), True))
    rec.health.healthy = healthy
    return rec


async def _waited(
    watch: EjectionWatch, rec: ReplicaRecord, timeout_s: float, sleep_s: float
) -> tuple[str, float]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        async with watch.first_byte(rec, timeout_s, lambda: True) as wait:
            await asyncio.sleep(sleep_s)
    except TimeoutError:
        return ("ejected" if wait.ejected else "timeout"), loop.time() - t0
    return "done", loop.time() - t0


@pytest.mark.parametrize("timeout_s", [0.05, 0.21, 0.35])
async def test_a_wait_expires_at_its_deadline(timeout_s: float) -> None:
    watch, rec = EjectionWatch(), _record()
    # a long wait keeps the watch asleep on its health-check interval meanwhile
    background = asyncio.create_task(_waited(watch, rec, 5.0, 1.0))
    await asyncio.sleep(0.13)  # added mid-interval
    how, took = await _waited(watch, rec, timeout_s, 5.0)
    # not on the watch's next health check (0.2, 0.4, 0.6 s after it started)
    assert how == "timeout" and timeout_s <= took < timeout_s + 0.04
    how, took = await background
    assert how == "done" and took == pytest.approx(1.0, abs=0.1)


async def test_a_wait_that_ends_in_time_is_not_expired_later() -> None:
    watch, rec = EjectionWatch(), _record()
    async with watch.first_byte(rec, 0.3, lambda: True) as ended:
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.4)  # its deadline passes after the block ended: the watch let it go
    assert not ended.expired and not ended.ejected
    assert (await _waited(watch, rec, 0.3, 0.1))[0] == "done"


async def test_a_wait_on_an_ejected_replica_fails_over_within_an_interval() -> None:
    watch, rec = EjectionWatch(), _record()
    task = asyncio.create_task(_waited(watch, rec, 60.0, 60.0))
    await asyncio.sleep(0.05)
    rec.health.healthy = False
    how, took = await task
    assert how == "ejected" and took < 0.05 + WATCH_INTERVAL_S + 0.05
