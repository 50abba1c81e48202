"""Prometheus metrics declared as data: an owner of metrics (the request path's, the inventory
server's, the shared state's) is a ``MetricSet`` whose class lists its metrics as ``Metric``
attributes; each instance creates them on the registry the app owns (no global default
registry). See docs/architecture.md, "Measuring ourselves".
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)


class Metric(Generic[M]):
    """One metric of a ``MetricSet``: its type, name, help text, label names and, for a histogram,
    its buckets. On an instance of the set, the attribute is that instance's metric (the
    instance's own attribute, set by ``MetricSet.__init__``, hides this descriptor: reading it
    costs a plain attribute lookup)."""

    def __init__(
        self,
        kind: type[M],
        name: str,
        doc: str,
        labels: tuple[str, ...] = (),
        buckets: tuple[float, ...] | None = None,
    ) -> None:
        assert (buckets is not None) == (kind is Histogram), f"{name}: buckets iff a histogram"
        # name, help text, label names: the metric type's first three arguments
        self.kind: type[M] = kind
        self.spec = (name, doc, labels)
        self.buckets = buckets

    def create(self, registry: CollectorRegistry) -> M:
        extra: dict[str, Any] = {} if self.buckets is None else {"buckets": self.buckets}
        metric: M = self.kind(*self.spec, registry=registry, **extra)
        return metric

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Metric[M]: ...
    @overload
    def __get__(self, obj: object, owner: type[Any]) -> M: ...
    def __get__(self, obj: object | None, owner: type[Any]) -> Metric[M] | M:
        if obj is None:
            return self
        raise AttributeError("a MetricSet's metrics exist once MetricSet.__init__ has created them")


class MetricSet:
    """Creates, on ``registry``, every ``Metric`` its class (and its bases) declares."""

    def __init__(self, registry: CollectorRegistry) -> None:
        for klass in type(self).__mro__:
            for attr, spec in vars(klass).items():
                if isinstance(spec, Metric) and attr not in self.__dict__:
                    self.__dict__[attr] = spec.create(registry)
