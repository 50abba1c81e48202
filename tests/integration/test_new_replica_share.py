"""A replica added to a warm fleet takes its share of new content (issue 11): the scenario of
``bench/new_replica.py`` (three warm replicas at concurrency 8, a fourth joins) through the
gateway's own Fleet, Router and index; the fourth must receive at least 15% of the next 300
requests."""

from __future__ import annotations

import pytest

from bench.new_replica import new_replica_share


@pytest.mark.parametrize("policy", ["kv_aware"])
def test_a_fourth_replica_joining_three_warm_ones_takes_its_share(policy: str) -> None:
    share = new_replica_share(policy)
    assert share >= 0.15, share


def test_round_robin_gives_the_fourth_replica_a_quarter() -> None:
    """The measure itself: a policy blind to caches gives the new replica exactly its turn."""
    assert new_replica_share("round_robin") == pytest.approx(0.25, abs=0.01)
