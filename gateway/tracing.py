"""OpenTelemetry spans per request, exported over OTLP/gRPC when ``telemetry.otlp_endpoint`` is
set. Without an endpoint no tracer exists and the request path creates no span at all.

The tracer provider belongs to the app (never installed as the global provider), which shuts it
down last so that the final spans are flushed.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


class Tracing:
    def __init__(self, endpoint: str | None, service_name: str = "kvgate") -> None:
        self._provider: TracerProvider | None = None
        self.tracer: Any = None
        if endpoint:
            provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
            insecure = not endpoint.startswith("https://")
            provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure))
            )
            self._provider = provider
            self.tracer = provider.get_tracer("kvgate.gateway")

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self.tracer = None
