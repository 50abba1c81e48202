"""The parts of the workers' load exchange and TTFT fit that need no process
(docs/architecture.md, "Workers"): each worker's view of a replica's queue, its own flights plus
what the parent relays of the others', equals one process's view of every flight; a worker's
published TTFT fit equals the parent's."""

from __future__ import annotations

import random

import orjson

from gateway.local_hub_codec import decode_json
from gateway.local_hub_load import LoadReporter, LoadTable, remote_loads
from gateway.replica_identity import ReplicaIdentity
from gateway.replica_load import NO_REMOTE_LOAD, combined_queue
from gateway.replica_record import ReplicaRecord
from gateway.workers_ttft import RelayedTtftModel, decode_observation, fit_frame
from router_policies.flights import FlightCounters
from router_policies.ttft.features import TtftInputs
from router_policies.ttft.model import TtftModel
from router_policies.ttft.params import DEFAULT_PRIOR
from tests.flight_walk import walk

BLOCK = 16


def _record() -> ReplicaRecord:
    return ReplicaRecord(ReplicaIdentity("r", "http://r", frozenset(), static=True))


def test_each_worker_sees_the_queue_one_process_would() -> None:
    workers = [_record(), _record(), _record()]
    reporters = [LoadReporter() for _ in workers]
    whole = FlightCounters()  # one process routing every flight
    table = LoadTable()
    for step, _, now in walk(7, workers, whole):
        for w, (rec, reporter) in enumerate(zip(workers, reporters, strict=True)):
            table.update(w, decode_json(orjson.dumps(reporter.report([rec]))))  # as framed
        for w, rec in enumerate(workers):
            remote = remote_loads(decode_json(orjson.dumps(table.others(w))), lambda _r: BLOCK)
            load = remote.get("r", NO_REMOTE_LOAD)
            pairs, shared, age = combined_queue(rec.flights, load, now)
            assert shared == whole.shared_tokens, (step, w)
            assert age == whole.pending_age_ms(now), (step, w)
            assert abs(pairs - whole.pending_prefill_pairs) < 1e-6, (step, w)
            assert load.requests + rec.flights.requests == whole.requests
    # a worker gone takes its flights' keys with it
    for w in range(len(workers)):
        table.drop(w)
    assert table.others(None) == {}


def test_a_worker_routes_on_the_parents_fit_of_every_workers_first_tokens() -> None:
    rng = random.Random(3)
    owner = TtftModel(DEFAULT_PRIOR)
    sent: list[bytes] = []
    workers = [RelayedTtftModel(DEFAULT_PRIOR, sent.append) for _ in range(2)]
    for model in (owner, *workers):
        model.set_prior("r", DEFAULT_PRIOR)
    for _ in range(60):
        inputs = TtftInputs(
            rng.randint(0, 5000), rng.randint(0, 8), rng.randint(0, 90000), rng.randint(1, 4000), 0
        )
        assert rng.choice(workers).observe_first_token("r", inputs, rng.uniform(5, 500))
        for data in sent:  # the parent, in arrival order
            replica, inputs, observed = decode_observation(data[5:])
            assert owner.observe_first_token(replica, inputs, observed)
            for w in workers:
                w.publish(fit_frame(owner, replica)[5:])
        sent.clear()
        for w in workers:
            assert w.params("r") == owner.params("r")
            assert w.prior_error("r") == owner.prior_error("r")
    assert owner.params("r").observations == 60
    assert not workers[0].observe_first_token("r", TtftInputs(0, 0, 0, 1, 0), float("nan"))
    workers[0].set_prior("r", DEFAULT_PRIOR)  # as the parent's set_prior restarts its fit
    assert workers[0].params("r") == DEFAULT_PRIOR
