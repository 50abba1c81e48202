"""The demo's agent workload is seeded and has the shape the demo relies on; the demo's CLI
refuses bad flags with exit code 2 and no traceback."""

from __future__ import annotations

import itertools
import subprocess
import sys

from kvgate_tools.demo_workload import AgentWorkloadSpec, agent_sessions


def test_same_seed_same_sessions_and_transcripts_grow() -> None:
    spec = AgentWorkloadSpec(sessions=6, seed=3)
    a, b = agent_sessions("m", spec), agent_sessions("m", spec)
    assert a == b
    assert [s.turns[-1].body for s in a] == [s.turns[-1].body for s in b]
    assert agent_sessions("m", AgentWorkloadSpec(sessions=6, seed=4)) != a
    for s in a:
        msgs = [t.body["messages"] for t in s.turns]
        # every turn resends the previous transcript (plus the reply) and adds one user message
        for prev, cur in itertools.pairwise(msgs):
            assert cur[: len(prev)] == prev
            assert cur[-1]["role"] == "user" and cur[-2]["role"] == "assistant"
        assert s.turns[0].think_s == 0.0
    starts = [s.start_s for s in a]
    assert starts == sorted(starts)


def test_demo_rejects_bad_flags() -> None:
    for args in (["--policies", "nope"], ["--replicas", "0"]):
        res = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "demo", *args], capture_output=True, text=True, timeout=120
        )
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr
        assert "error:" in res.stderr


def test_an_empty_plot_path_means_no_plot() -> None:
    # Path("") is "." and truthy: the chart was once saved as "./.png" (a file committed by mistake)
    import argparse

    from kvgate_tools.demo import configure

    p = argparse.ArgumentParser()
    configure(p)
    assert not p.parse_args(["--plot", ""]).plot
    assert str(p.parse_args([]).plot) == "out/demo.png"
