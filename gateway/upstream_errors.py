"""The failures of the proxy's upstream client (gateway/upstream_client.py): connection errors, so
that the proxy's handling of OSError covers them."""

from __future__ import annotations


class UpstreamError(ConnectionError):
    pass


class ConnectError(UpstreamError):
    pass


class ConnectTimeout(UpstreamError):
    pass


class Disconnected(UpstreamError):
    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered  # some of the response had arrived


class BadResponse(UpstreamError):
    pass
