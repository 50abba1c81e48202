"""The load probe: reads the engine's Prometheus ``/metrics`` (docs/architecture.md, "Engine KV events and the agent stream").

vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(``vllm:gpu_cache_usage_perc`` before 0.8), ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (tokens), and the info gauge ``vllm:cache_config_info`` whose
labels carry ``block_size`` and ``num_gpu_blocks``. SGLang: ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:cache_hit_rate`` (a ratio, no counters).
Samples of several engine ranks (the ``engine`` label) are summed; usage takes the maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_RUNNING = {"vllm:num_requests_running", "sglang:num_running_reqs"}
_WAITING = {"vllm:num_requests_waiting", "sglang:num_queue_reqs"}
_USAGE = {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"}
_QUERIES = {"vllm:prefix_cache_queries_total"}
_HITS = {"vllm:prefix_cache_hits_total"}
_CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    engine: str  # "vllm", "sglang" or "" when no known metric was found
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    cache_hit_rate: float | None = None  # SGLang's own ratio
    block_size: int | None = None  # from vllm:cache_config_info
    capacity_blocks: int | None = None


class MetricsParseError(ValueError):
    pass


def _int_label(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name)
    if raw is None or not raw.isdigit():
        return None
    return int(raw)


def parse_engine_metrics(text: str) -> EngineLoad:
    running = waiting = queries = hits = 0
    usage = 0.0
    hit_rate: float | None = None
    block_size: int | None = None
    capacity: int | None = None
    engine = ""
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError and others on bad input
        raise MetricsParseError(f"engine /metrics is not Prometheus text: {exc}") from None
    for family in families:
        for sample in family.samples:
            name = sample.name
            if name.startswith("vllm:"):
                engine = "vllm"
            elif name.startswith("sglang:"):
                engine = engine or "sglang"
            else:
                continue
            value = sample.value
            if name in _RUNNING:
                running += int(value)
            elif name in _WAITING:
                waiting += int(value)
            elif name in _USAGE:
                usage = max(usage, float(value))
            elif name in _QUERIES:
                queries += int(value)
            elif name in _HITS:
                hits += int(value)
            elif name == "sglang:cache_hit_rate":
                hit_rate = float(value)
            elif name == _CACHE_INFO:
                block_size = _int_label(sample.labels, "block_size") or block_size
                blocks = _int_label(sample.labels, "num_gpu_blocks")
                if blocks is not None:
                    capacity = (capacity or 0) + blocks
    return EngineLoad(
        engine=engine,
        running=running,
        waiting=waiting,
        kv_usage=min(max(usage, 0.0), 1.0),
        prefix_queries=queries,
        prefix_hits=hits,
        cache_hit_rate=hit_rate,
        block_size=block_size,
        capacity_blocks=capacity,
    )
