"""A replica's health state machine (docs/architecture.md, "Fleet").

Fed by the active checker (``gateway.health``) and passively by the proxy, through ``Fleet``: a
replica that fails ``health.unhealthy_after`` times in a row is ejected, and comes back after
``health.healthy_after`` consecutive successful checks. A connect error ejects at once: nothing
listens at that address. The first check result of an unknown replica decides at once.

Requests failing in a row (``health.unhealthy_after`` of them, e.g. first-byte timeouts of a slow
or stuck engine whose ``/health`` still answers) eject it too, as Envoy's outlier detection does:
they are counted apart from the checks (``request_fail_streak``, reset only by a request that
succeeds), and such an ejection lasts at least ``health.ejection_s`` whatever the checks say, so
that a replica answering its checks but not its requests is held out instead of taking traffic
back after every good check (found by ``make faults``, ``engine_slow``).

Invariants: the methods below are the only writers of a ``ReplicaHealth``; ``unhealthy_since`` is
set iff the replica is checked and unhealthy; at most one of ``ok_streak`` and ``fail_streak`` is
non-zero; only an ejection sets ``ejected_until``, to a time in the future, and no check result
makes the replica healthy before then (a new address, ``unknown``, lifts it: a new process).
"""

from __future__ import annotations

from gateway.config import HealthConfig


class ReplicaHealth:
    __slots__ = (
        "checked",
        "ejected_until",
        "fail_streak",
        "failures",
        "healthy",
        "last_error",
        "ok_streak",
        "request_fail_streak",
        "unhealthy_since",
    )

    def __init__(self) -> None:
        self.healthy = False
        self.checked = False  # at least one health result arrived
        self.unhealthy_since: float | None = None  # monotonic time it last became unhealthy
        self.ok_streak = 0
        self.fail_streak = 0
        self.last_error = ""
        self.failures = 0  # proxied attempts that failed (a statistic)
        self.request_fail_streak = 0  # proxied attempts failed in a row (checks do not reset it)
        self.ejected_until = 0.0  # checks cannot restore the replica before this (monotonic) time

    def unknown(self) -> None:
        """A new address is a new process: unknown until checked."""
        self.checked = False
        self.healthy = False
        self.unhealthy_since = None
        self.ejected_until = 0.0

    def assume_healthy(self) -> None:
        """An agent runs beside a live engine; the active checks confirm or eject it."""
        self.healthy = True
        self.checked = True
        self.unhealthy_since = None

    def check_result(self, ok: bool, error: str, config: HealthConfig, now: float) -> None:
        if not self.checked:
            self.checked = True
            self.healthy = ok and now >= self.ejected_until  # ejected for its requests: held out
            self.unhealthy_since = None if self.healthy else now
            self.ok_streak, self.fail_streak = (1, 0) if ok else (0, 1)
            self.last_error = error
            return
        self._result(ok, error, config, now)

    def proxy_success(self) -> None:
        self.fail_streak = 0
        self.request_fail_streak = 0

    def proxy_failure(self, error: str, connect: bool, config: HealthConfig, now: float) -> None:
        self.failures += 1
        if not connect:
            self.request_fail_streak += 1
            if self.request_fail_streak >= config.unhealthy_after:
                self.request_fail_streak = 0
                self.ejected_until = now + config.ejection_s
                if self.healthy:
                    self.unhealthy_since = now
                self.healthy = False
                self.ok_streak = 0
                self.last_error = error
                return
            self._result(False, error, config, now)
            return
        # nothing listens there: eject now rather than after unhealthy_after more requests
        if self.healthy:
            self.unhealthy_since = now
        self.healthy = False
        self.ok_streak = 0
        self.fail_streak = max(self.fail_streak + 1, config.unhealthy_after)
        self.last_error = error

    def _result(self, ok: bool, error: str, config: HealthConfig, now: float) -> None:
        self.checked = True
        if ok:
            self.ok_streak += 1
            self.fail_streak = 0
            held_out = now < self.ejected_until  # ejected for its requests: checks wait
            if not self.healthy and self.ok_streak >= config.healthy_after and not held_out:
                self.healthy = True
                self.unhealthy_since = None
                self.last_error = ""
            return
        self.fail_streak += 1
        self.ok_streak = 0
        self.last_error = error
        if self.healthy and self.fail_streak >= config.unhealthy_after:
            self.healthy = False
            self.unhealthy_since = now
        elif not self.healthy and self.unhealthy_since is None:
            self.unhealthy_since = now  # a failed request was its first result: checked, unhealthy
