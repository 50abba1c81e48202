"""Admin endpoints (docs/architecture.md), behind the admin bearer token
(``auth.admin_token_env``; unset: open).

* ``POST /admin/reload``: reread the config file; the new policy and settings swap in atomically,
  an invalid file is refused with its error (400) and the running config stays.
* ``POST /admin/explain[?endpoint=chat|completions]``: the decision for a request body (every
  replica's match and score) without forwarding it and without any side effect: the policy
  decides without committing, the featurizer caches nothing, records no text as seen and
  defers no encode, and the index is only read. Without ``endpoint``, the body's prompt field
  (``messages`` or ``prompt``) names it (``gateway.request.endpoint_of``).
* ``GET /admin/replicas``: the fleet as the gateway sees it.
* ``GET /admin/index``: the index summary; ``?replica=ID``: that replica's precise keys.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from aiohttp import web

from gateway.fleet import Fleet
from gateway.openai_errors import RequestError, error_response, error_response_of
from gateway.request import endpoint_of, parse_json, request_of
from gateway.routing import Router, RoutingState
from router_policies.policy import NoReplicaError
from router_policies.prefix_index import PrefixIndex


class Reloader(Protocol):
    def reload(self) -> str | None:
        """Reload the config; None on success, else the error (the running config stays)."""
        ...


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


class Admin:
    def __init__(
        self,
        state: Callable[[], RoutingState],
        token: Callable[[], str | None],
        reloader: Reloader,
        router: Router,
        fleet: Fleet,
        index: PrefixIndex,
    ) -> None:
        self._state = state
        self._token = token
        self._reloader = reloader
        self._router = router
        self._fleet = fleet
        self._index = index

    def routes(self) -> list[web.RouteDef]:
        g = self._guard
        return [
            web.post("/admin/reload", g(self.reload)),
            web.post("/admin/explain", g(self.explain)),
            web.get("/admin/replicas", g(self.replicas)),
            web.get("/admin/index", g(self.index)),
        ]

    def _guard(
        self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def guarded(request: web.Request) -> web.StreamResponse:
            token = self._token()
            if token is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    return error_response(401, "admin endpoints need 'Authorization: Bearer <admin token>'")
            return await handler(request)

        return guarded

    async def reload(self, _request: web.Request) -> web.StreamResponse:
        err = self._reloader.reload()
        if err is not None:
            return error_response(
                400, f"config rejected, the running config stays: {err}", code="invalid_config"
            )
        st = self._state()
        return _json({"status": "reloaded", "policy": st.policy.name})

    async def explain(self, request: web.Request) -> web.StreamResponse:
        state = self._state()
        try:
            body = parse_json(await request.read())
            endpoint = endpoint_of(request.query.get("endpoint"), body)
            session = request.headers.get(state.config.proxy.session_header)
            req = request_of(endpoint, body, session)
            features, info = await state.featurizer.featurize(req, explain=True)
        except RequestError as exc:
            return error_response_of(exc)
        match = self._router.match(features)
        try:
            choice = self._router.decide(state, features, match)
        except NoReplicaError:
            decision: dict[str, Any] | None = None
            snapshot = self._fleet.snapshot(self._fleet.candidates(features.model), features, match)
        else:
            d = choice.decision
            decision = {
                "replica": d.replica,
                "reason": d.reason,
                "matched_blocks": d.matched_blocks,
                "predicted_cached_tokens": choice.predicted_tokens,
            }
            snapshot = choice.snapshot
        scores = choice.decision.scores if decision is not None else {}
        terms = choice.decision.terms if decision is not None else {}
        return _json(
            {
                "model": features.model,
                "policy": state.policy.name,
                "prompt_tokens": features.prompt_tokens,
                "block_size": features.block_size,
                "blocks": len(features.block_keys),
                "session_id": features.session_id,
                "tokenization": {
                    "mode": info.mode,
                    "approximate": info.approximate,
                    "fallback_reason": info.fallback_reason,
                    "deferred_chars": info.deferred_chars,
                },
                "decision": decision,
                "replicas": [
                    {
                        "id": r.id,
                        "healthy": r.healthy,
                        "matched_blocks": r.matched_blocks,
                        "matched_tokens": r.matched_blocks * features.block_size,
                        "evicted_blocks": r.evicted_blocks,
                        "match_score": r.match_score,
                        "score": scores.get(r.id),
                        "terms": terms.get(r.id),
                        "in_flight_requests": r.in_flight_requests,
                        "pending_prefill_tokens": r.pending_prefill_tokens,
                        "in_flight_shared_tokens": r.in_flight_shared_tokens,
                        "pending_age_ms": r.pending_age_ms,
                        "engine_running": r.engine_running,
                        "engine_waiting": r.engine_waiting,
                        "kv_usage": r.kv_usage,
                    }
                    for r in snapshot.replicas
                ],
            }
        )

    async def replicas(self, _request: web.Request) -> web.StreamResponse:
        return _json({"replicas": [rec.describe() for rec in self._fleet.records()]})

    async def index(self, request: web.Request) -> web.StreamResponse:
        replica = request.query.get("replica")
        if replica is not None:
            if replica not in self._index.replicas:
                return error_response(404, f"unknown replica {replica!r}", param="replica")
            return _json({"replica": replica, "keys": sorted(self._index.precise_keys(replica))})
        cfg = self._index.config
        return _json(
            {
                "keys": len(self._index),
                "entries": self._index.entries,
                "max_total_blocks": cfg.max_total_blocks,
                "max_blocks_per_replica": cfg.max_blocks_per_replica,
                "replicas": self._index.stats(),
            }
        )
