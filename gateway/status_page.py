"""The status page the gateway serves: ``GET /status`` (HTML) and ``GET /status/status.js``
(docs/operators.md, "Status page").

The page and its script are static files (gateway/static/), served without a token; the script
reads ``GET /admin/report`` and ``GET /admin/replicas`` with the admin token taken from the URL
fragment (``/status#token=...``, never sent to the server as part of the URL) and draws the fleet,
health, hit rate and prediction audit per replica, savings, cache lifetime against session turn
gaps, and the recent decisions with their explain. Files are read once, at start-up.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).resolve().parent / "static"


class StatusPage:
    def __init__(self, static: Path = STATIC) -> None:
        self._html = (static / "status.html").read_bytes()
        self._js = (static / "status.js").read_bytes()

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/status", self.page), web.get("/status/status.js", self.script)]

    async def page(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=self._html,
            content_type="text/html",
            charset="utf-8",
            headers={"content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'"},
        )

    async def script(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(body=self._js, content_type="application/javascript", charset="utf-8")
