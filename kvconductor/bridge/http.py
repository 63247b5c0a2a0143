"""The bridge's HTTP API.

- `POST /register`, `POST /unregister`, `GET /services`, `GET /global_view`:
  registrations in Mooncake Conductor's msgpack form or the bridge's JSON
  form (`kvconductor.registry.routes`, the daemon serves the same); 404
  while `bridge.registrations = false`; 409 when the config file already
  defines that publisher rank.
- `GET /publishers`: the streams this bridge relays and every registration.
- `GET /health`: 200 while the bridge relays and Kafka takes its records,
  503 otherwise; JSON with the details either way.
- `GET /metrics`: Prometheus text format.

With `bridge.auth_token` set, `/register`, `/unregister`, `/services`,
`/global_view` and `/publishers` need `Authorization: Bearer <token>`.
Errors are `{"error": ...}`, in msgpack for requests in the msgpack form.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from kvconductor.bridge.metrics import CONTENT_TYPE, BridgeMetrics
from kvconductor.http.auth import bearer_ok, header_bytes
from kvconductor.registry.routes import Registrar, RegistrationRoutes, error_reply


class BridgeControl(Protocol):
    """What the bridge's routes read of the running bridge (`bridge.app.Bridge`)."""

    @property
    def metrics(self) -> BridgeMetrics: ...

    @property
    def registry(self) -> Registrar | None: ...

    def describe(self) -> dict[str, object]: ...

    def health(self) -> tuple[bool, dict[str, object]]: ...

    def update_gauges(self) -> None: ...


JSON = "application/json"
MAX_BODY_BYTES = 64 * 1024
PROTECTED = frozenset({"register", "unregister", "services", "global_view", "publishers"})

_encoder = msgspec.json.Encoder()


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(payload), status=status, content_type=JSON)


def make_app(bridge: BridgeControl, auth_token: str | None = None) -> web.Application:
    metrics = bridge.metrics
    token = None if auth_token is None else auth_token.encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        name = request.match_info.route.name or "unknown"
        authorization = header_bytes(request.headers.get("Authorization"))
        if name in PROTECTED and not bearer_ok(authorization, token):
            metrics.http_requests.labels(name, "401").inc()
            return error_reply(request, 401, "missing or wrong bearer token")
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            metrics.http_requests.labels(name, str(exc.status)).inc()
            return error_reply(request, exc.status, exc.reason)
        metrics.http_requests.labels(name, str(response.status)).inc()
        return response

    async def publishers(request: web.Request) -> web.Response:
        return _json(bridge.describe())

    async def health(request: web.Request) -> web.Response:
        ok, detail = bridge.health()
        return _json(detail, 200 if ok else 503)

    async def metrics_text(request: web.Request) -> web.Response:
        bridge.update_gauges()
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(middlewares=[middleware], client_max_size=MAX_BODY_BYTES)
    RegistrationRoutes(
        lambda: bridge.registry,
        disabled="registrations are disabled (bridge.registrations = false)",
    ).add_to(app)
    app.router.add_get("/publishers", publishers, name="publishers")
    app.router.add_get("/health", health, name="health")
    app.router.add_get("/metrics", metrics_text, name="metrics")
    return app
