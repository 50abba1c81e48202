"""StepCosts (router_policies/sim/engine_types.py): every cost is a duration, so each one refuses a
negative value, naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from router_policies.sim.engine_types import StepCosts


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(StepCosts)])
def test_a_negative_cost_is_refused(name: str) -> None:
    ok = StepCosts(step_overhead_s=0.0, prefill_s_per_token=0.0)
    with pytest.raises(ValueError, match=f"^{name}: must be >= 0$"):
        dataclasses.replace(ok, **{name: -1e-9})


def test_the_costs_are_the_five_durations() -> None:
    # the check covers every field: a field that is not a duration would need its own rule
    assert [f.name for f in dataclasses.fields(StepCosts)] == [
        "step_overhead_s",
        "prefill_s_per_token",
        "prefill_s_per_token_ctx",
        "decode_s_per_seq",
        "decode_s_per_ctx_token",
    ]
