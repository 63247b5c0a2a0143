"""The HTTP API: cache-hit queries (contract section 4) and operations.

    app = make_app(conductor, metrics, ready=daemon.ready,
                   max_body_bytes=cfg.http.max_body_bytes,
                   auth_token=reveal(cfg.http.auth_token))

Endpoints:

- `POST /query`, `POST /query_by_hash`: the contract's answer, exactly its
  fields (`{}` when nothing is listed); 400 `{"error": ...}` for malformed
  JSON, missing fields, wrong types or values the index cannot take.
- `GET /workers`: `{"workers": conductor.workers(), "pending": conductor.pending()}`.
- `GET /health`: 200 `{"status": "ok"}` while the event loop runs.
- `GET /ready`: 200 or 503 `{"ready": bool, "reason": str}` from `ready()`.
- `GET /metrics`: Prometheus text format.

Every error is JSON `{"error": "..."}`: 400, 401 (bearer token missing or
wrong, when `auth_token` is set: on /query, /query_by_hash and /workers
only), 404, 405 (with `Allow`), 413 (body over `max_body_bytes`), 500.

The index is synchronous and fast, so handlers call it directly on the event
loop: no executor hop, and no index mutation can interleave with a query.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from kvconductor.metrics import CONTENT_TYPE, Metrics
from kvconductor.query_wire import HashQuery, InvalidQuery, QueryResponse, TokenQuery

if TYPE_CHECKING:
    from kvconductor.core import Conductor

log = structlog.get_logger(__name__)

JSON = "application/json"
# Routes that need the bearer token when one is configured.
PROTECTED = frozenset({"query", "query_by_hash", "workers"})

_token_decoder = msgspec.json.Decoder(TokenQuery)
_hash_decoder = msgspec.json.Decoder(HashQuery)
_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    """Raised by handlers; answered as JSON `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(payload), status=status, content_type=JSON)


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_encoder.encode({"error": message}),
        status=status,
        content_type=JSON,
        headers=headers,
    )


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class QueryApi:
    """The handlers. `conductor` may be swapped (e.g. after a restore) via
    `app[API_KEY].conductor = ...`."""

    def __init__(
        self,
        conductor: Conductor,
        metrics: Metrics,
        ready: Callable[[], tuple[bool, str]],
        max_body_bytes: int,
        auth_token: str | None,
    ) -> None:
        self.conductor = conductor
        self.metrics = metrics
        self.ready_check = ready
        self.max_body_bytes = max_body_bytes
        self._token = auth_token.encode("utf-8") if auth_token else None
        self._latency_query = metrics.query_latency.labels("query")
        self._latency_hash = metrics.query_latency.labels("query_by_hash")

    # -------------------------------------------------------- middleware

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.name
        endpoint = route if route is not None else "other"
        try:
            if self._token is not None and route in PROTECTED:
                self._authorize(request)
            response = await handler(request)
        except ApiError as exc:
            response = error_response(exc.status, exc.message, exc.headers)
        except web.HTTPException as exc:
            response = self._http_exception(request, exc)
        except Exception:
            log.exception("http_handler_failed", path=_shorten(request.path))
            response = error_response(500, "internal error")
        self.metrics.http_requests.labels(endpoint, str(response.status)).inc()
        return response

    def _authorize(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, credential = header.partition(" ")
        given = credential.strip().encode("utf-8")
        assert self._token is not None
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self._token):
            raise ApiError(
                401,
                "missing or invalid bearer token",
                {"WWW-Authenticate": 'Bearer realm="kvconductor"'},
            )

    def _http_exception(self, request: web.Request, exc: web.HTTPException) -> web.Response:
        headers: dict[str, str] = {}
        if exc.status == 404:
            message = f"not found: {_shorten(request.path)}"
        elif exc.status == 405:
            message = f"method {request.method} not allowed on {_shorten(request.path)}"
            if "Allow" in exc.headers:
                headers["Allow"] = exc.headers["Allow"]
        elif exc.status == 413:
            message = f"request body too large (limit {self.max_body_bytes} bytes)"
        else:
            message = exc.reason
        return error_response(exc.status, message, headers)

    # ------------------------------------------------------------ queries

    async def _body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            raise ApiError(413, f"request body too large (limit {self.max_body_bytes} bytes)")
        return await request.read()  # raises 413 past client_max_size when chunked

    async def query(self, request: web.Request) -> web.Response:
        return await self._answer(
            request, _token_decoder, self.conductor.query, self._latency_query
        )

    async def query_by_hash(self, request: web.Request) -> web.Response:
        return await self._answer(
            request, _hash_decoder, self.conductor.query_by_hash, self._latency_hash
        )

    async def _answer(
        self,
        request: web.Request,
        decoder: msgspec.json.Decoder[Any],
        method: Callable[[Any], QueryResponse],
        latency: Any,
    ) -> web.Response:
        body = await self._body(request)
        start = perf_counter()
        try:
            try:
                req = decoder.decode(body)
            except msgspec.ValidationError as exc:
                raise ApiError(400, f"invalid query: {exc}") from None
            except msgspec.DecodeError as exc:
                raise ApiError(400, f"malformed JSON: {exc}") from None
            answer = self._run(method, req)
            return web.Response(body=_encoder.encode(answer), content_type=JSON)
        finally:
            latency.observe(perf_counter() - start)

    @staticmethod
    def _run(fn: Callable[[Any], QueryResponse], req: TokenQuery | HashQuery) -> QueryResponse:
        try:
            return fn(req)
        except InvalidQuery as exc:
            raise ApiError(400, str(exc)) from None

    # --------------------------------------------------------- operations

    async def workers(self, request: web.Request) -> web.Response:
        return json_response(
            {"workers": self.conductor.workers(), "pending": self.conductor.pending()}
        )

    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        try:
            ok, reason = self.ready_check()
        except Exception as exc:
            log.exception("ready_check_failed")
            ok, reason = False, f"readiness check failed: {type(exc).__name__}"
        return json_response({"ready": ok, "reason": reason}, 200 if ok else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


API_KEY = web.AppKey("kvconductor_api", QueryApi)


def make_app(
    conductor: Conductor,
    metrics: Metrics,
    *,
    ready: Callable[[], tuple[bool, str]],
    max_body_bytes: int,
    auth_token: str | None,
) -> web.Application:
    """The aiohttp application serving the query API and operations endpoints."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    api = QueryApi(conductor, metrics, ready, max_body_bytes, auth_token)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[api.middleware])
    app[API_KEY] = api
    app.router.add_post("/query", api.query, name="query")
    app.router.add_post("/query_by_hash", api.query_by_hash, name="query_by_hash")
    app.router.add_get("/workers", api.workers, name="workers")
    app.router.add_get("/health", api.health, name="health")
    app.router.add_get("/ready", api.ready, name="ready")
    app.router.add_get("/metrics", api.metrics_text, name="metrics")
    return app
