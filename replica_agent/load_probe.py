"""The load probe: reads the engine's Prometheus ``/metrics`` (docs/architecture.md, "Engine KV events and the agent stream").

vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(``vllm:gpu_cache_usage_perc`` before 0.8), ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (tokens), and the info gauge ``vllm:cache_config_info`` whose
labels carry ``block_size`` and ``num_gpu_blocks``. SGLang: ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:cache_hit_rate`` (a ratio, no counters).
Samples of several engine ranks (the ``engine`` label) are summed; usage takes the maximum.

Only those names' sample lines go to the Prometheus parser: a real vLLM's /metrics is ~640 lines,
mostly histograms, which took 12.8 ms a poll to parse whole and take 0.6 ms so (docs/performance.md,
"The agent's load probe"). A text with none of them is parsed whole, so a body that is not
Prometheus text is still an error; a malformed line of a metric not read no longer is.
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
# the sample lines read here start with one of these (other lines, e.g. the histograms that make
# most of an engine's /metrics, are not given to the parser: it costs ~20 us a line)
_READ = tuple(
    sorted(_RUNNING | _WAITING | _USAGE | _QUERIES | _HITS | {"sglang:cache_hit_rate", _CACHE_INFO})
)


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
    lines = text.splitlines()
    read = [line for line in lines if line.startswith(_READ)]
    # the engine is named by any of its samples, read here or not
    engine = "vllm" if any(line.startswith("vllm:") for line in lines) else ""
    if not engine and any(line.startswith("sglang:") for line in lines):
        engine = "sglang"
    try:
        # none read: the whole text, so that a body that is not Prometheus text is an error
        families = list(text_string_to_metric_families("\n".join(read) + "\n" if read else text))
    except Exception as exc:  # the parser raises ValueError and others on bad input
        raise MetricsParseError(f"engine /metrics is not Prometheus text: {exc}") from None
    for family in families:
        for sample in family.samples:
            name, value = sample.name, sample.value
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
