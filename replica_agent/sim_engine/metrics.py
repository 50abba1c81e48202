"""Prometheus metrics under vLLM's names and labels (vllm/v1/metrics/loggers.py).

Gauges and prefix-cache counters are read from the replica model at scrape time (a collector, no
copy to keep in sync); the TTFT histogram and token counters are updated as requests progress.
Every metric carries vLLM's labels ``model_name`` and ``engine`` (the data-parallel rank, "0"),
but ``vllm:cache_config_info``, which carries ``engine`` only, as vLLM's does.
One registry per engine instance: no module-level state.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router_policies.sim.replica_model import ReplicaModel

# vLLM's buckets for vllm:time_to_first_token_seconds, with boundaries added between them (at most
# ~1.35x apart from 30 ms to 10 s) so that a benchmark can read a p99 from them
# (bench/live_metrics.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.13, 0.17, 0.2, 0.25, 0.3,
    0.4, 0.5, 0.6, 0.75, 1.0, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _ModelCollector(Collector):
    def __init__(self, model: ReplicaModel, labels: dict[str, str]) -> None:
        self._model = model
        self._names = list(labels)
        self._values = list(labels.values())

    def collect(self) -> Iterator[Metric]:
        m = self._model.metrics()
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", m.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=self._names)
            g.add_metric(self._values, value)
            yield g
        counters = (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             m.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             m.prefix_cache_hits),
        )  # fmt: skip
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=self._names)
            c.add_metric(self._values, value)
            yield c
        # vLLM's info gauge: the cache configuration in labels (engine label only, value 1).
        cfg = self._model.config
        info = {
            "engine": self._values[self._names.index("engine")],
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_gpu_blocks": str(cfg.num_blocks),
            "num_cpu_blocks": "None",
            "kv_cache_size_tokens": str(cfg.num_blocks * cfg.block_size),
        }
        g = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        g.add_metric(list(info.values()), 1.0)
        yield g


class EngineMetrics:
    def __init__(self, model: ReplicaModel, model_name: str, engine: str = "0") -> None:
        labels = {"model_name": model_name, "engine": engine}
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_ModelCollector(model, labels))
        names = list(labels)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self._prompt = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=self.registry
        ).labels(**labels)
        self._generation = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=self.registry
        ).labels(**labels)
        self._preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemptions from the engine.",
            names,
            registry=self.registry,
        ).labels(**labels)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=self.registry,
        ).labels(**labels, finished_reason="length")

    def preempted(self, count: int) -> None:
        self._preemptions.inc(count)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def request_finished(self, prompt_tokens: int, generated: int) -> None:
        self._prompt.inc(prompt_tokens)
        self._generation.inc(generated)
        self._success.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
