"""What the app asks of its part in a gateway of several processes (``kvgate serve --workers N``;
docs/architecture.md, "Workers"): the parent's link (gateway/workers.py) or a worker's
(gateway/local_hub_client.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.fleet import Fleet
from router_policies.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from gateway.app import GatewayApp


class AppLink(Protocol):
    """The app's part in a gateway of several processes (``kvgate serve --workers N``,
    gateway/workers.py): the parent, which owns the inventory and serves no API
    (``worker`` None), or HTTP worker number ``worker``, fed by the parent."""

    @property
    def worker(self) -> int | None: ...

    def make_fleet(self, config: GatewayConfig, index: PrefixIndex) -> Fleet: ...

    def attach(self, app: GatewayApp) -> None:
        """Wire into the built app (observers, sinks); called at the end of its construction."""
        ...

    def setup_web(self, web_app: web.Application) -> None: ...

    def reloaded(self) -> None:
        """The app applied a reload (the link tells the other processes)."""
        ...

    async def exposition(self) -> bytes:
        """The whole gateway's metrics (``/metrics`` in a worker)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
