"""gateway/asyncio_tasks.TaskSet: a task is held from its start until done; ``stop`` ends them all,
those started while it stops too, and reports an error a task raised instead of ending."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.asyncio_tasks import TaskSet


async def _until_cancelled(then: Callable[[], object]) -> None:
    """Waits forever; ``then()`` runs as it ends (cancelled)."""
    try:
        await asyncio.Event().wait()
    finally:
        then()


def _logged(log: list[str], name: str) -> Callable[[], object]:
    return lambda: log.append(name)


async def test_tasks_are_held_until_done_and_stop_cancels_the_rest() -> None:
    tasks, log = TaskSet(), list[str]()
    quick = tasks.start(asyncio.sleep(0), name="quick")
    slow = tasks.start(_until_cancelled(_logged(log, "slow")))
    await quick
    await asyncio.sleep(0)  # the done callback runs
    assert len(tasks) == 1 and not slow.done()
    await tasks.stop()
    assert slow.cancelled() and log == ["slow"] and len(tasks) == 0


async def test_a_task_started_while_stopping_is_ended_too() -> None:
    tasks, log = TaskSet(), list[str]()
    # e.g. a channel's cleanup starting one more task as it ends
    tasks.start(_until_cancelled(lambda: tasks.start(_until_cancelled(_logged(log, "late")))))
    await asyncio.sleep(0)
    await tasks.stop()
    assert log == ["late"] and len(tasks) == 0


async def test_an_error_instead_of_cancellation_propagates_after_all_ended() -> None:
    tasks, log = TaskSet(), list[str]()

    def fail() -> None:
        raise RuntimeError("cleanup failed")

    tasks.start(_until_cancelled(fail))
    tasks.start(_until_cancelled(_logged(log, "other")))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await tasks.stop()
    assert log == ["other"] and len(tasks) == 0


async def test_adopted_tasks_are_held_and_stopped() -> None:
    tasks, log = TaskSet(), list[str]()
    task = asyncio.get_running_loop().create_task(_until_cancelled(_logged(log, "adopted")))
    tasks.adopt(task)
    await asyncio.sleep(0)
    await tasks.stop()
    assert task.cancelled() and log == ["adopted"]
