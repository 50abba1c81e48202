"""The held-out traces (bench/heldout_traces.py) are valid Mooncake-format traces the live bench
reads, deterministic per seed, with the reuse their families promise."""

from __future__ import annotations

from pathlib import Path

from bench.heldout_traces import BLOCK, write
from router_policies.sim.traces import load_trace


def test_the_same_seed_writes_the_same_valid_traces(tmp_path: Path) -> None:
    first = write(tmp_path / "a", 3)
    again = write(tmp_path / "b", 3)
    other = write(tmp_path / "c", 4)
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    assert [p.read_bytes() for p in first] != [p.read_bytes() for p in other]
    for path in first:
        trace = load_trace(path)  # the loader --trace uses: every field checked
        assert len(trace.requests) == 1500
        parent: dict[int, int | None] = {}
        stamps = [r.timestamp_ms for r in trace.requests]
        assert stamps == sorted(stamps)
        for r in trace.requests:
            assert len(r.hash_ids) == -(-r.input_length // BLOCK)
            for i, h in enumerate(r.hash_ids):  # prefix ids: one id, one parent
                assert parent.setdefault(h, r.hash_ids[i - 1] if i else None) == (
                    r.hash_ids[i - 1] if i else None
                )


def test_documents_and_transcripts_are_shared(tmp_path: Path) -> None:
    rag, agents, _ = (load_trace(p) for p in write(tmp_path, 5))
    heads = [r.hash_ids[0] for r in rag.requests]
    assert len(set(heads)) <= 40 < len(heads)  # questions about 40 documents
    assert len({r.hash_ids[-1] for r in rag.requests}) == len(rag.requests)  # each its own query
    # a turn resends its session's transcript: most prompts extend an earlier one
    earlier: set[tuple[int, ...]] = set()
    extended = 0
    for r in agents.requests:
        extended += any(tuple(r.hash_ids[:k]) in earlier for k in range(len(r.hash_ids) - 1, 2, -1))
        earlier.add(tuple(r.hash_ids))
    assert extended > len(agents.requests) // 2
