"""The featurizer's counters on /metrics (gateway/metrics.py ``_StateCollector``): every
``kvgate_tokenize_*`` metric reads a key of ``Featurizer.cache_stats`` (the collector defaults a
missing key to 0, so a misspelt name would export a constant 0), and every key is exported."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gateway.config import parse_config
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from router_policies.prefix_index import PrefixIndex
from tests.unit.test_features_deferred import closing, make


async def test_every_tokenize_metric_is_a_featurizer_stat_and_every_stat_is_exported() -> None:
    cfg = parse_config(
        {"models": [{"name": "m", "block_size": 16}], "replicas": [{"id": "a", "url": "http://a:1"}]}
    )
    index = PrefixIndex(cfg.index)
    async with closing(make()) as (fz,):
        keys = list(fz.cache_stats())
        # distinct non-zero values: an exported 0 is a name with no stat behind it
        values = {k: i + 1 for i, k in enumerate(keys)}
        registry = CollectorRegistry()
        GatewayMetrics(registry, index, Fleet(cfg, index), lambda: values)
        exported: dict[str, float] = {}
        for family in registry.collect():
            if family.name.startswith("kvgate_tokenize_"):
                (sample,) = [s for s in family.samples if not s.name.endswith("_created")]
                exported[family.name.removeprefix("kvgate_tokenize_")] = sample.value
    assert "deferred_expired" in exported and "deferred_lulls" in exported
    # the families of the segment cache are named kvgate_tokenize_cache_<key>
    named = {k.removeprefix("cache_"): v for k, v in exported.items()}
    assert set(named) == set(keys)
    assert all(named[k] == values[k] for k in keys)
