"""The bridge's HTTP API.

- `POST /register`: a Mooncake RFC #1403 registration body (see `registry`);
  200 `{"status": "registered successfully", "instance_id": ...}` once the
  registration is on the registrations topic; 400 for a body that cannot be
  relayed, 409 when the config file already defines that publisher rank,
  503 while Kafka or the registrations are unavailable.
- `POST /unregister`: `{"instance_id", "dp_rank", ...}` (RFC #1403's other
  fields are accepted and ignored); 200 `{"status": "unregistered
  successfully", "removed_instances": ["<id>|<tenant>|<rank>"]}`, 404 when
  no such registration exists.
- `GET /publishers`: the streams this bridge relays and every registration.
- `GET /health`: 200 while the bridge relays and Kafka takes its records,
  503 otherwise; JSON with the details either way.
- `GET /metrics`: Prometheus text format.

With `bridge.auth_token` set, `/register`, `/unregister` and `/publishers`
need `Authorization: Bearer <token>`. Errors are JSON `{"error": ...}`.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler
from aiokafka.errors import KafkaError

from kvconductor.bridge.metrics import CONTENT_TYPE
from kvconductor.bridge.records import StreamKey
from kvconductor.bridge.registry import (
    InvalidRegistration,
    RegisterBody,
    RegistrationConflict,
    UnregisterBody,
)

if TYPE_CHECKING:
    from kvconductor.bridge.app import Bridge

JSON = "application/json"
MAX_BODY_BYTES = 64 * 1024
PROTECTED = frozenset({"register", "unregister", "publishers"})

_encoder = msgspec.json.Encoder()
_register = msgspec.json.Decoder(RegisterBody)
_unregister = msgspec.json.Decoder(UnregisterBody)


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(payload), status=status, content_type=JSON)


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


def make_app(bridge: Bridge, auth_token: str | None = None) -> web.Application:
    metrics = bridge.metrics

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        name = request.match_info.route.name or "unknown"
        if auth_token is not None and name in PROTECTED:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {auth_token}".encode()):
                metrics.http_requests.labels(name, "401").inc()
                return _error(401, "missing or wrong bearer token")
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            metrics.http_requests.labels(name, str(exc.status)).inc()
            return _error(exc.status, exc.reason)
        metrics.http_requests.labels(name, str(response.status)).inc()
        return response

    async def read(request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise web.HTTPRequestEntityTooLarge(
                max_size=MAX_BODY_BYTES, actual_size=request.content_length or 0
            ) from None

    async def register(request: web.Request) -> web.Response:
        raw = await read(request)
        try:
            body = _register.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(400, f"invalid registration: {exc}")
        registry = bridge.registry
        if registry is None:
            return _error(404, "registrations are disabled (bridge.registrations = false)")
        try:
            key = await bridge.register(body)
        except InvalidRegistration as exc:
            return _error(400, f"invalid registration: {exc}")
        except RegistrationConflict as exc:
            return _error(409, str(exc))
        except (KafkaError, TimeoutError) as exc:
            return _error(503, f"cannot store the registration: {exc!r}")
        return _json({"status": "registered successfully", "instance_id": key.id})

    async def unregister(request: web.Request) -> web.Response:
        raw = await read(request)
        try:
            body = _unregister.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _error(400, f"invalid unregistration: {exc}")
        if bridge.registry is None:
            return _error(404, "registrations are disabled (bridge.registrations = false)")
        key = StreamKey(body.instance_id, body.dp_rank)
        tenant = body.tenant_id or "default"
        try:
            found = await bridge.registry.unregister(key)
        except (KafkaError, TimeoutError) as exc:
            return _error(503, f"cannot store the unregistration: {exc!r}")
        if not found:
            return _error(404, f"service not found: {key.id}|{tenant}|{key.rank}")
        return _json(
            {
                "status": "unregistered successfully",
                "removed_instances": [f"{key.id}|{tenant}|{key.rank}"],
            }
        )

    async def publishers(request: web.Request) -> web.Response:
        return _json(bridge.describe())

    async def health(request: web.Request) -> web.Response:
        ok, detail = bridge.health()
        return _json(detail, 200 if ok else 503)

    async def metrics_text(request: web.Request) -> web.Response:
        bridge.sink.update_gauges()
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(middlewares=[middleware], client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/register", register, name="register")
    app.router.add_post("/unregister", unregister, name="unregister")
    app.router.add_get("/publishers", publishers, name="publishers")
    app.router.add_get("/health", health, name="health")
    app.router.add_get("/metrics", metrics_text, name="metrics")
    return app
