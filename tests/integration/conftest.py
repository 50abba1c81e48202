"""Fixtures of the integration tests; the helpers live in ``gateway_harness``."""

from tests.integration.gateway_harness import procs

__all__ = ["procs"]
