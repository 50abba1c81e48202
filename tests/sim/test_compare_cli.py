"""``kvgate compare`` as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

GOOD = {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}


def kvgate(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "compare", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        check=False,
    )


def small_trace(tmp_path: Path) -> Path:
    lines = []
    for i in range(40):
        sess = i % 5
        n = 3 + i // 5
        ids = [0, *[1000 * sess + j for j in range(1, n)]]
        lines.append(
            json.dumps(
                {"timestamp": i * 100, "input_length": n * 512 - 10, "output_length": 20, "hash_ids": ids}
            )
        )
    p = tmp_path / "small.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "round_robin,nope"], "unknown policy 'nope'"),
        (["--policies", "kv_aware[balance_absolute=3]"], "kv_aware.balance_absolute"),
        (["--policies", "kv_aware[balance_abs=-3]"], "kv_aware.balance_abs"),
        (["--cache-blocks", "-5"], "--cache-blocks: expected a positive integer, got -5"),
        (["--replicas", "0"], "--replicas: expected a positive integer, got 0"),
        (["--loads", "0.5,-1"], "--loads: expected positive numbers"),
        (["--profile", "gpu9000"], "--profile: unknown profile 'gpu9000'"),
        (["--cache-blocks", "2"], "--cache-blocks: 2 blocks per replica cannot hold request 1"),
    ],
)
def test_bad_flags_exit_2_with_the_field_named(tmp_path: Path, args: list[str], message: str) -> None:
    res = kvgate("--trace", str(small_trace(tmp_path)), *args)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_malformed_trace_line_exits_2_naming_the_line(tmp_path: Path) -> None:
    p = tmp_path / "trace.jsonl"
    bad = {**GOOD, "input_length": "many"}
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    res = kvgate("--trace", str(p))
    assert res.returncode == 2
    assert "trace.jsonl:2: input_length: expected a positive integer" in res.stderr
    assert "Traceback" not in res.stderr


def test_same_command_and_seed_give_byte_identical_json(tmp_path: Path) -> None:
    trace = small_trace(tmp_path)
    outs = []
    for k in range(2):
        out = tmp_path / f"run{k}.json"
        args = ["--trace", str(trace), "--loads", "0.5,1.0", "--seed", "3", "--json", str(out)]
        if k == 0:
            args += ["--plot", str(tmp_path / "plot.png")]
        res = kvgate(*args)
        assert res.returncode == 0, res.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    doc = json.loads(outs[0])
    assert 0 < doc["oracle_hit_rate"] <= 1
    assert len(doc["runs"]) == 8
    assert set(doc["runs"][0]) == {
        "policy",
        "load",
        "hit_rate",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "throughput_rps",
        "max_over_mean_load",
    }
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the table is printed too
    res = kvgate("--trace", str(trace), "--loads", "1.0", "--policies", "kv_aware[balance_abs=8]")
    assert res.returncode == 0
    assert "kv_aware[balance_abs=8]" in res.stdout and "oracle hit rate" in res.stdout


def test_a_different_seed_changes_a_generated_workload(tmp_path: Path) -> None:
    a = kvgate(
        "--workload", "groups", "--loads", "0.8", "--policies", "kv_aware", "--json", str(tmp_path / "a")
    )
    b = kvgate(
        "--workload",
        "groups",
        "--loads",
        "0.8",
        "--policies",
        "kv_aware",
        "--seed",
        "1",
        "--json",
        str(tmp_path / "b"),
    )
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert (tmp_path / "a").read_bytes() != (tmp_path / "b").read_bytes()
