"""The TTFT fit's budget (router_policies.ttft_feed.FitBudget): every first token is an audit
sample; the fit takes them all at live rates and bursts, and at most its rate when a replica
answers faster than that, chosen at dispatch."""

from __future__ import annotations

import pytest

from gateway.workers_ttft import RelayedTtftModel
from router_policies.placement import Dispatch, FitBudget, FlightCounters, TtftFeed, TtftSample
from router_policies.policy import ReplicaState
from router_policies.ttft.params import DEFAULT_PRIOR


def test_a_replica_below_the_rate_and_a_burst_up_to_the_bucket_are_fitted_whole() -> None:
    b = FitBudget(rate_per_s=100.0, burst=100.0)
    assert all(b.take("r", i / 50) for i in range(1000))  # 50 a second for 20 s
    burst = [b.take("s", 7.0) for _ in range(101)]  # 101 at one instant on a fresh replica
    assert burst[:100] == [True] * 100 and burst[100] is False
    assert not b.take("s", 7.005) and b.take("s", 7.02)  # a hundredth of a second refills one fit


@pytest.mark.parametrize("rate", [500.0, 2000.0])
def test_above_the_rate_the_fit_takes_the_rate_and_the_burst_and_no_more(rate: float) -> None:
    b = FitBudget(rate_per_s=100.0, burst=100.0)
    seconds = 10
    taken = sum(b.take("r", i / rate) for i in range(int(rate * seconds)))
    assert 100 * seconds <= taken <= 100 * seconds + 100 + 1


def test_a_clock_going_back_adds_nothing() -> None:
    b = FitBudget(rate_per_s=1.0, burst=1.0)
    assert b.take("r", 10.0) and not b.take("r", 5.0) and not b.take("r", 10.5) and b.take("r", 11.0)


def test_the_budget_keeps_at_most_max_replicas() -> None:
    b = FitBudget(rate_per_s=1.0, burst=1.0, max_replicas=2)
    assert b.take("a", 0.0) and b.take("b", 0.0) and b.take("c", 0.0)
    assert b.take("a", 0.0)  # "a" was the least recent: dropped, it starts with a full bucket again
    assert not b.take("c", 0.0)


def test_every_first_token_is_a_sample_and_only_the_budgeted_ones_are_fitted() -> None:
    samples: list[TtftSample] = []
    feed = TtftFeed(listener=samples.append, budget=FitBudget(rate_per_s=10.0, burst=5.0))
    state = ReplicaState("r", pending_prefill_tokens=2000)
    flights = [
        feed.flight(FlightCounters(), Dispatch(state, 1000, 400, 16, 50), start=i / 100) for i in range(300)
    ]
    fitted = sum(f.probe is not None and f.probe.fit for f in flights)
    for i, f in enumerate(flights):
        f.first_byte(i / 100 + 0.05)
    assert len(samples) == 300  # the audit hears every first token
    assert (
        feed.params("r").observations == fitted and 5 + 30 - 1 <= fitted <= 5 + 30 + 1
    )  # 3 s at 10 a second
    # at a rate within the budget every first token is fitted, as without one
    feed2 = TtftFeed(budget=FitBudget(rate_per_s=10.0, burst=5.0))
    for i in range(50):
        feed2.flight(FlightCounters(), Dispatch(state, 1000, 400, 16, 50), start=i / 5).first_byte(
            i / 5 + 0.05
        )
    assert feed2.params("r").observations == 50


def test_a_worker_relays_only_the_budgeted_first_tokens_to_the_parent() -> None:
    """With ``--workers``, a first token the budget left unfitted is not sent to the parent's fit."""
    sent: list[bytes] = []
    feed = TtftFeed(
        RelayedTtftModel(DEFAULT_PRIOR, sent.append), budget=FitBudget(rate_per_s=10.0, burst=5.0)
    )
    state = ReplicaState("r")
    flights = [
        feed.flight(FlightCounters(), Dispatch(state, 1000, 0, 16, 50), start=i / 100) for i in range(100)
    ]
    for i, f in enumerate(flights):
        f.first_byte(i / 100 + 0.01)
    fitted = sum(f.probe is not None and f.probe.fit for f in flights)
    assert len(sent) == fitted < 100
