"""Passive ejection by failed requests (gateway/replica_health.py): a replica whose /health
answers while its requests time out is held out for ``health.ejection_s``."""

from __future__ import annotations

from gateway.config import HealthConfig
from gateway.replica_health import ReplicaHealth

CFG = HealthConfig(unhealthy_after=2, healthy_after=1, ejection_s=5.0)


def _healthy() -> ReplicaHealth:
    h = ReplicaHealth()
    h.check_result(True, "", CFG, 0.0)
    assert h.healthy
    return h


def test_failed_requests_between_good_checks_eject_for_the_ejection_time() -> None:
    h = _healthy()
    h.proxy_failure("no first byte in 3s", False, CFG, 1.0)
    h.check_result(True, "", CFG, 1.5)  # its /health still answers
    assert h.healthy
    h.proxy_failure("no first byte in 3s", False, CFG, 4.0)
    assert not h.healthy and h.unhealthy_since == 4.0
    h.check_result(True, "", CFG, 5.0)
    h.check_result(True, "", CFG, 8.9)
    assert not h.healthy  # held out until 4.0 + 5.0
    h.check_result(True, "", CFG, 9.0)
    assert h.healthy and h.unhealthy_since is None


def test_a_successful_request_resets_the_request_streak() -> None:
    h = _healthy()
    h.proxy_failure("timeout", False, CFG, 1.0)
    h.proxy_success()
    h.proxy_failure("timeout", False, CFG, 2.0)
    assert h.healthy


def test_a_connect_error_still_ejects_at_once_and_checks_restore_it() -> None:
    h = _healthy()
    h.proxy_failure("connection refused", True, CFG, 1.0)
    assert not h.healthy
    h.check_result(True, "", CFG, 1.5)
    assert h.healthy  # not held out: nothing listened, now something does
