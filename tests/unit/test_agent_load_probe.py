"""Parsing engines' /metrics: a real vLLM's (recorded with the event captures) and SGLang's names."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest
from prometheus_client import Metric

from replica_agent.load_probe import MetricsParseError, parse_engine_metrics

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm_events"


@pytest.mark.skipif(not (DATA / "int_hashes.json").exists(), reason="no recorded vLLM capture")
def test_real_vllm_metrics() -> None:
    capture = json.loads((DATA / "int_hashes.json").read_text())
    load = parse_engine_metrics(capture["metrics"])
    assert load.engine == "vllm"
    assert load.block_size == capture["block_size"] == 32
    assert load.capacity_blocks == 64  # --kv-cache-memory-bytes 2 MiB: 64 blocks of 32 tokens
    assert load.prefix_queries > 0 and 0 < load.prefix_hits <= load.prefix_queries
    assert 0.0 <= load.kv_usage <= 1.0


def test_vllm_metrics_summed_over_engine_ranks() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 3.0',
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5',
            "# TYPE vllm:prefix_cache_queries counter",
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0',
            "# TYPE vllm:prefix_cache_hits counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0',
            "# TYPE vllm:cache_config_info gauge",
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0',
            "",
        ]
    )
    load = parse_engine_metrics(text)
    assert (load.running, load.waiting, load.kv_usage) == (5, 4, 0.5)
    assert (load.prefix_queries, load.prefix_hits) == (100, 40)
    assert (load.block_size, load.capacity_blocks) == (16, 1000)


def test_sglang_metrics() -> None:
    text = "\n".join(
        [
            "# TYPE sglang:num_running_reqs gauge",
            'sglang:num_running_reqs{model_name="m"} 7.0',
            "# TYPE sglang:num_queue_reqs gauge",
            'sglang:num_queue_reqs{model_name="m"} 2.0',
            "# TYPE sglang:token_usage gauge",
            'sglang:token_usage{model_name="m"} 0.3',
            "# TYPE sglang:cache_hit_rate gauge",
            'sglang:cache_hit_rate{model_name="m"} 0.6',
            "",
        ]
    )
    load = parse_engine_metrics(text)
    assert load.engine == "sglang"
    assert (load.running, load.waiting, load.kv_usage, load.cache_hit_rate) == (7, 2, 0.3, 0.6)
    assert load.block_size is None


def test_not_prometheus_text() -> None:
    with pytest.raises(MetricsParseError):
        parse_engine_metrics('vllm:num_requests_running{engine="0" 1.0\n')
    assert parse_engine_metrics("").engine == ""


def _histogram(name: str, buckets: int) -> list[str]:
    lines = [f"# HELP {name} a histogram the probe does not read", f"# TYPE {name} histogram"]
    for i in range(buckets):
        lines.append(f'{name}_bucket{{engine="0",le="{0.001 * 2**i}",model_name="m"}} {i}.0')
    return [*lines, f'{name}_bucket{{engine="0",le="+Inf",model_name="m"}} {buckets}.0']


@pytest.mark.skipif(not (DATA / "int_hashes.json").exists(), reason="no recorded vLLM capture")
def test_only_the_lines_read_reach_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real vLLM's /metrics is mostly histograms the probe does not read (639 lines, 12.8 ms to
    parse whole, 0.6 ms for its 9 lines read): the parser gets only the lines of the names read, and
    the load is the same as from the whole text, with more histograms or without."""
    import prometheus_client.parser

    import replica_agent.load_probe as probe

    text = json.loads((DATA / "int_hashes.json").read_text())["metrics"]
    seen: list[str] = []
    parse = prometheus_client.parser.text_string_to_metric_families

    def spy(body: str) -> Iterable[Metric]:
        seen.append(body)
        return parse(body)

    monkeypatch.setattr(probe, "text_string_to_metric_families", spy)
    load = parse_engine_metrics(text)
    more = parse_engine_metrics(text + "\n".join(_histogram("vllm:extra_seconds", 200)) + "\n")
    assert load == more
    assert all(line.startswith(probe._READ) for line in seen[0].splitlines())
    assert len(seen[0].splitlines()) < len(text.splitlines()) // 10
    # the whole text through the parser gives the same
    monkeypatch.setattr(probe, "_READ", ("",))  # every line "read"
    assert parse_engine_metrics(text) == load
