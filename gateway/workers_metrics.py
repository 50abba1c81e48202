"""``/metrics`` of a gateway with several workers (docs/architecture.md, "Workers"): whichever
worker answers the scrape asks the parent, which gathers every worker's exposition and its own,
and merges them into one, each sample labelled ``worker`` (the worker's number, or ``parent`` for
the inventory owner's: agent streams, inventory and health). A scrape thus sees the whole gateway;
sum over ``worker`` for gateway-wide figures (``sum without (worker) (...)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

WORKER_LABEL = "worker"


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_expositions(texts: Mapping[str, bytes]) -> bytes:
    """One exposition of ``texts`` (worker name -> Prometheus text), every sample labelled with
    its worker; families of the same name are merged (one HELP and TYPE each)."""
    families: dict[str, Metric] = {}
    for worker, text in texts.items():
        for fam in text_string_to_metric_families(text.decode()):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples.extend(s._replace(labels={**s.labels, WORKER_LABEL: worker}) for s in fam.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)
