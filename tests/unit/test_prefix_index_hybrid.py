"""The index's match for hybrid replicas (vLLM hybrid-attention engines): the deepest held key of
the request within the prompt's bound, beside the leading run of plain replicas."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router_policies.prefix_index import IndexConfig, PrefixIndex


def test_hybrid_replica_matches_its_deepest_key_within_the_bound() -> None:
    ix = PrefixIndex()
    for r in ("plain", "hyb"):
        ix.add_replica(r)
        ix.store(r, [1, 3])  # the same keys: a leading run of 1, a deepest key at position 3
    ix.set_hybrid("hyb", True)
    assert ix.is_hybrid("hyb") and not ix.is_hybrid("plain")
    assert dict(ix.match([1, 2, 3, 4]).blocks) == {"plain": 1, "hyb": 3}
    assert dict(ix.match([1, 2, 3, 4], max_blocks=2).blocks) == {"plain": 1, "hyb": 1}
    assert dict(ix.match([1, 2, 3, 4], max_blocks=0).blocks) == {"plain": 1}
    assert dict(ix.match([2, 3]).blocks) == {"hyb": 2}  # no leading block needed
    assert ix.match([2, 3]).scores["hyb"] == 2.0
    ix.set_hybrid("hyb", False)
    assert dict(ix.match([1, 2, 3, 4]).blocks) == {"plain": 1, "hyb": 1}


def test_hybrid_slots_beyond_the_first_mask_word_and_a_removed_replica() -> None:
    ix = PrefixIndex(IndexConfig(max_replicas=200))
    names = [f"r{i}" for i in range(130)]
    for r in names:
        ix.add_replica(r)
    ix.set_hybrid("r70", True)
    ix.set_hybrid("r129", True)
    ix.store("r70", [5])
    ix.store("r129", [5, 9])
    ix.store("r3", [7, 5])
    assert dict(ix.match([7, 5, 9]).blocks) == {"r70": 2, "r129": 3, "r3": 2}
    ix.remove_replica("r70")
    ix.add_replica("new")  # takes r70's slot: not hybrid
    ix.store("new", [5])
    assert dict(ix.match([7, 5, 9]).blocks) == {"r129": 3, "r3": 2}


def test_a_hybrid_replicas_precise_report_supersedes_its_approximate_entries() -> None:
    ix = PrefixIndex()
    for r in ("plain", "hyb"):
        ix.add_replica(r)
        ix.touch_approximate(r, [1, 2, 3], now=0.0)
    ix.set_hybrid("hyb", True)
    assert dict(ix.match([1, 2, 3]).blocks) == {"plain": 3, "hyb": 3}
    ix.store("plain", [7])
    ix.store("hyb", [7])  # the engine's report after the routed request: the guesses go
    assert ix.approximate_keys("plain") == [3, 2, 1] and ix.approximate_keys("hyb") == []
    assert dict(ix.match([1, 2, 3]).blocks) == {"plain": 3}
    ix.touch_approximate("hyb", [3], now=1.0)
    ix.remove("hyb", [7])  # a removal is a report too
    assert ix.approximate_keys("hyb") == [] and ix.entries == 3 + 1


@settings(max_examples=60, deadline=None)
@given(
    held=st.sets(st.integers(1, 12), max_size=12),
    request=st.lists(st.integers(1, 12), min_size=1, max_size=12, unique=True),
    bound=st.integers(0, 14),
)
def test_hybrid_match_equals_the_deepest_key_rule(held: set[int], request: list[int], bound: int) -> None:
    ix = PrefixIndex()
    ix.add_replica("h")
    ix.set_hybrid("h", True)
    ix.store("h", sorted(held))
    deepest = max((j + 1 for j, k in enumerate(request[:bound]) if k in held), default=0)
    assert ix.match(request, max_blocks=bound).blocks.get("h", 0) == deepest
