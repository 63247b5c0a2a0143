"""The HTTP API: cache-hit queries (contract section 4) and operations.

    app = make_app(conductor, metrics, ready=daemon.ready,
                   max_body_bytes=cfg.http.max_body_bytes,
                   auth_token=reveal(cfg.http.auth_token),
                   client_timeout_s=cfg.http.client_timeout_s)

Endpoints:

- `POST /query`, `POST /query_by_hash`: the contract's answer, exactly its
  fields (`{}` when nothing is listed); 400 `{"error": ...}` for malformed
  JSON, missing fields, wrong types or values the index cannot take. With
  `Content-Type: application/msgpack`, Mooncake Conductor's form instead
  (`conductor_wire`): its answer, and its 400 `{error, reason, field?,
  index?}` in msgpack.
- `POST /query_tiered_by_hash`: NVIDIA Dynamo's remote-indexer query
  (`dynamo_wire`), JSON; 501 when `index.local_hash_map` is 0 (off).
- `POST /register`, `POST /unregister`, `GET /services`, `GET /global_view`:
  `registration_http`'s routes over `registrations` (a `RegistrationLog`;
  None: 404).
- `GET /workers`: `{"workers": conductor.workers(), "pending": conductor.pending()}`.
- `GET /health`: 200 `{"status": "ok"}` while the event loop runs.
- `GET /ready`: 200 or 503 `{"ready": bool, "reason": str}` from `ready()`.
- `GET /metrics`: Prometheus text format.

Every error is `{"error": "..."}`, in msgpack for a request in the msgpack
form (and on the registration routes, `registration_http.msgpack_wire`) and
JSON otherwise: 400, 401 (bearer token missing or wrong, when `auth_token`
is set: on the queries, the registration routes and /workers only; with
`WWW-Authenticate: Bearer`), 404, 405 (with `Allow`), 408 (body
not received within `client_timeout_s`), 413 (body over `max_body_bytes`,
refused from its Content-Length before reading any of it, or once a chunked
body passes it), 500, 501 (`/query_tiered_by_hash` while the local hash map
is off), 503 (with `Retry-After`: more than
`BODY_BUDGET_FACTOR * max_body_bytes` of request bodies buffered at once).
A client that hangs up mid-request is counted in the metrics as 499.

Slow and idle clients: a connection must deliver each request's headers
within `idle_timeout_s` of connecting or of its previous answer, or it is
closed (aiohttp's keep-alive timer, which is the idle timeout as well as the
slow-header one), and then the body within `client_timeout_s` more, or it
gets 408. Answers 408 and 413 close the connection, and so does a
connection's `max_requests_per_connection`-th answer, which says
`Connection: close`. `Expect: 100-continue` is only answered with 100 when
the body would be read (token right, declared size within the limit).

The index is synchronous and fast, so handlers call it directly on the event
loop: no executor hop, and no index mutation can interleave with a query.

The daemon and replicas serve this app through `http_front.QuerySite`, whose
front answers plain queries with the same `token_answer` / `hash_answer`,
counters and bytes before aiohttp sees them, and hands every other request
here with its connection.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import structlog
from aiohttp import HttpVersion11, hdrs, web
from aiohttp.typedefs import Handler

from kvconductor.config import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_REQUESTS_PER_CONNECTION,
)
from kvconductor.http.auth import bearer_ok, header_bytes
from kvconductor.index.query import namespace_of
from kvconductor.obs.metrics import CONTENT_TYPE, Metrics
from kvconductor.registry.bodies import Context
from kvconductor.registry.routes import RegistrationRoutes, msgpack_wire
from kvconductor.wire.conductor import (
    MSGPACK,
    ConductorError,
    conductor_answer,
    message_body,
    read_conductor_hash_query,
    read_conductor_query,
)
from kvconductor.wire.conductor import error_body as conductor_error_body
from kvconductor.wire.dynamo import TieredQueryByHash, tiered_answer
from kvconductor.wire.engine_hashes import VllmProfile
from kvconductor.wire.query import (
    HashQuery,
    InvalidQuery,
    TokenQuery,
    read_token_query,
)

if TYPE_CHECKING:
    from kvconductor.index.conductor import Conductor
    from kvconductor.registry.log import RegistrationLog

log = structlog.get_logger(__name__)

JSON = "application/json"
# Routes that need the bearer token when one is configured.
PROTECTED = frozenset(
    {
        "query",
        "query_by_hash",
        "query_tiered_by_hash",
        "workers",
        "register",
        "unregister",
        "services",
        "global_view",
    }
)
# Request bodies buffered at once, in units of max_body_bytes: bounds memory
# under many concurrent (or slow) large uploads; past it new bytes get 503.
BODY_BUDGET_FACTOR = 4
# Answers after which the connection is closed: the rest of the body is unread.
_CLOSING = frozenset({408, 413})

_token_decoder = msgspec.json.Decoder(TokenQuery)
T = TypeVar("T")
_hash_decoder = msgspec.json.Decoder(HashQuery)
_tiered_decoder = msgspec.json.Decoder(TieredQueryByHash)
LOCAL_HASH_MAP_OFF = (
    "local block hashes are not indexed here: set index.local_hash_map "
    "(KVCONDUCTOR_INDEX_LOCAL_HASH_MAP) to serve /query_tiered_by_hash"
)
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


def error_body(message: str) -> bytes:
    return _encoder.encode({"error": message})


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=error_body(message),
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
        client_timeout_s: float,
        registrations: RegistrationLog | None = None,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_requests_per_connection: int = DEFAULT_MAX_REQUESTS_PER_CONNECTION,
    ) -> None:
        self.conductor = conductor
        self.registrations = registrations
        self.metrics = metrics
        self.ready_check = ready
        self.max_body_bytes = max_body_bytes
        self.client_timeout_s = client_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_requests_per_connection = max_requests_per_connection
        # Answers written on each open connection aiohttp serves (the query
        # front's count carried over at the hand-over); gone with the transport.
        self.answered: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.body_budget = BODY_BUDGET_FACTOR * max_body_bytes
        self.buffered = 0  # bytes of request bodies held right now
        self._token = auth_token.encode("utf-8") if auth_token else None
        self.latency_query = metrics.query_latency.labels("query")
        self.latency_hash = metrics.query_latency.labels("query_by_hash")
        self.latency_tiered = metrics.query_latency.labels("query_tiered_by_hash")
        self._requests: dict[tuple[str, int], Any] = {}

    async def count_answer(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer aiohttp writes: the connection's last one, at
        `max_requests_per_connection`, closes it. The hook runs after the
        headers are made, so `Connection: close` is set here too."""
        transport = request.transport
        if transport is None:
            return
        answered = self.answered.get(transport, 0) + 1
        self.answered[transport] = answered
        if answered >= self.max_requests_per_connection:
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    # -------------------------------------------------------- middleware

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.name
        endpoint = route if route is not None else "other"
        try:
            if route in PROTECTED and not self._authorized(request):
                raise ApiError(
                    401,
                    "missing or invalid bearer token",
                    {"WWW-Authenticate": 'Bearer realm="kvconductor"'},
                )
            response = await handler(request)
        except ConductorError as exc:
            response = web.Response(
                body=conductor_error_body(exc), status=400, content_type=MSGPACK
            )
        except ApiError as exc:
            response = self.error_response(request, exc.status, exc.message, exc.headers)
        except web.HTTPException as exc:
            response = self._http_exception(request, exc)
        except ConnectionError:
            # The client hung up mid-request: nobody reads this answer. Counted
            # as nginx's 499, not logged (a router's timeout is not our error).
            response = self.error_response(request, 499, "client closed the connection")
        except Exception:
            log.exception("http_handler_failed", path=_shorten(request.path))
            response = self.error_response(request, 500, "internal error")
        if response.status in _CLOSING:
            response.force_close()
        self.count(endpoint, response.status)
        return response

    def error_response(
        self,
        request: web.Request,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        """`{"error": message}` in the request's wire form."""
        if msgpack_wire(request):
            return web.Response(
                body=message_body(message), status=status, content_type=MSGPACK, headers=headers
            )
        return error_response(status, message, headers)

    def count(self, endpoint: str, status: int) -> None:
        # The labelled child is looked up once per pair: `labels()` takes a
        # lock and builds a key on every call.
        key = (endpoint, status)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.metrics.http_requests.labels(endpoint, str(status))
        counter.inc()

    def _authorized(self, request: web.Request) -> bool:
        return self.token_ok(header_bytes(request.headers.get(hdrs.AUTHORIZATION)))

    def token_ok(self, authorization: bytes | None) -> bool:
        """Whether an Authorization header's value carries the bearer token
        (always true when none is configured)."""
        return bearer_ok(authorization, self._token)

    def _declared_too_large(self, request: web.Request) -> bool:
        length = request.content_length
        return length is not None and length > self.max_body_bytes

    def body_timeout(self) -> ApiError:
        return ApiError(408, f"request body not received within {self.client_timeout_s:g} s")

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body too large (limit {self.max_body_bytes} bytes)")

    async def expect(self, request: web.Request) -> None:
        """`Expect: 100-continue`: invite the body only if it will be read; the
        handler then answers 401 or 413 without the client ever sending it."""
        if self._declared_too_large(request) or not self._authorized(request):
            return
        if request.version == HttpVersion11 and (
            request.headers.get(hdrs.EXPECT, "").lower() == "100-continue"
        ):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the answer proper has not started

    def _http_exception(self, request: web.Request, exc: web.HTTPException) -> web.Response:
        headers: dict[str, str] = {}
        if exc.status == 404:
            message = f"not found: {_shorten(request.path)}"
        elif exc.status == 405:
            message = f"method {request.method} not allowed on {_shorten(request.path)}"
            if "Allow" in exc.headers:
                headers["Allow"] = exc.headers["Allow"]
        elif exc.status == 413:
            message = self._too_large().message
        else:
            message = exc.reason
        return self.error_response(request, exc.status, message, headers)

    # ------------------------------------------------------------ queries

    async def _body(self, request: web.Request) -> bytes:
        """The whole body, within `max_body_bytes`, `client_timeout_s` and the
        shared budget of buffered bodies."""
        if self._declared_too_large(request):
            raise self._too_large()
        content = request.content
        if content.is_eof():
            # The usual case: the body came in with the headers and aiohttp
            # holds all of it. Taken without an await, so it never counts
            # against the budget, and without arming a timer (a cost per
            # query on the hot path).
            body = content.read_nowait()
            if len(body) > self.max_body_bytes:  # chunked
                raise self._too_large()
            return body
        chunks: list[bytes] = []
        held = 0
        try:
            async with asyncio.timeout(self.client_timeout_s):
                while chunk := await content.readany():
                    held += len(chunk)
                    self.buffered += len(chunk)
                    if held > self.max_body_bytes:  # chunked, or more than declared
                        raise self._too_large()
                    if self.buffered > self.body_budget:
                        raise ApiError(
                            503,
                            "too many request bodies in flight, retry shortly",
                            {"Retry-After": "1"},
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise self.body_timeout() from None
        finally:
            self.buffered -= held
        # Decoding and answering follow without an await: the bytes released
        # from the budget above are freed before another body is read.
        return b"".join(chunks)

    async def query(self, request: web.Request) -> web.Response:
        if msgpack_wire(request):
            return await self._answer(
                request, self.conductor_token_answer, self.latency_query, MSGPACK
            )
        return await self._answer(request, self.token_answer, self.latency_query)

    async def query_by_hash(self, request: web.Request) -> web.Response:
        if msgpack_wire(request):
            return await self._answer(
                request, self.conductor_hash_answer, self.latency_hash, MSGPACK
            )
        return await self._answer(request, self.hash_answer, self.latency_hash)

    async def query_tiered_by_hash(self, request: web.Request) -> web.Response:
        return await self._answer(request, self.tiered_answer, self.latency_tiered)

    def tiered_answer(self, body: bytes) -> bytes:
        # Off is how the daemon is configured, whatever the body says.
        if not self.conductor.local_hash_map_on:
            raise ApiError(501, LOCAL_HASH_MAP_OFF)
        req = _decode(_tiered_decoder, body)
        try:
            local = req.local_hashes()
        except InvalidQuery as exc:
            raise ApiError(400, f"invalid query: {exc}") from None
        return tiered_answer(
            *self.conductor.query_local_hashes(req.tenant(), req.model_name, local)
        )

    async def _answer(
        self,
        request: web.Request,
        answer: Callable[[bytes], bytes],
        latency: Any,
        content_type: str = JSON,
    ) -> web.Response:
        body = await self._body(request)
        start = perf_counter()
        try:
            return web.Response(body=answer(body), content_type=content_type)
        finally:
            latency.observe(perf_counter() - start)

    def conductor_token_answer(self, body: bytes) -> bytes:
        req, packed = read_conductor_query(body)
        return self._conductor_answer(req, packed)

    def conductor_hash_answer(self, body: bytes) -> bytes:
        return self._conductor_answer(read_conductor_hash_query(body), None)

    def _conductor_answer(self, req: TokenQuery | HashQuery, packed: bytes | None) -> bytes:
        try:
            hits = self.conductor.query_ranks(req, packed, self._profiles(req))
        except InvalidQuery as exc:
            raise ConductorError("invalid_value", str(exc)) from None
        registered: dict[str, set[int]] = {}
        if self.registrations is not None:
            registered = self.registrations.ranks(_context(req))
            if req.instance_id is not None:
                registered = {n: r for n, r in registered.items() if n == req.instance_id}
        return conductor_answer(hits, registered)

    def token_answer(self, body: bytes) -> bytes:
        read = read_token_query(body)
        if read is None:
            # The typed decoder says what is wrong, or takes it and the
            # index says why.
            return self._run(self._token_json, _decode(_token_decoder, body))
        req, packed = read
        return self._run(lambda r: self._token_json(r, packed), req)

    def _token_json(self, req: TokenQuery, packed: bytes | None = None) -> bytes:
        return self.conductor.query_json(req, packed, self._profiles(req))

    def _profiles(self, req: TokenQuery | HashQuery) -> tuple[VllmProfile, ...]:
        """The hash profiles registered for a token query's context, with
        which token-less holdings are found too (`tokenless`)."""
        regs = self.registrations
        if regs is None or not isinstance(req, TokenQuery) or not regs.any_profile():
            return ()
        return regs.profiles(_context(req))

    def hash_answer(self, body: bytes) -> bytes:
        return self._run(self.conductor.query_json, _decode(_hash_decoder, body))

    @staticmethod
    def _run(fn: Callable[[Any], bytes], req: TokenQuery | HashQuery) -> bytes:
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


def _context(req: TokenQuery | HashQuery) -> Context:
    key = namespace_of(req)
    return (key.tenant, key.model, key.lora_name or "", key.block_size)


def _decode(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid query: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON: {exc}") from None
    except RecursionError:  # msgspec skips unknown fields recursively
        raise ApiError(400, "malformed JSON: nested too deeply") from None


def make_app(
    conductor: Conductor,
    metrics: Metrics,
    *,
    ready: Callable[[], tuple[bool, str]],
    max_body_bytes: int,
    auth_token: str | None,
    client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    max_requests_per_connection: int = DEFAULT_MAX_REQUESTS_PER_CONNECTION,
    registrations: RegistrationLog | None = None,
) -> web.Application:
    """The aiohttp application serving the query API, registration (off
    without `registrations`: 404) and operations endpoints."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if not client_timeout_s > 0:
        raise ValueError(f"client_timeout_s must be positive, got {client_timeout_s}")
    if not idle_timeout_s > 0:
        raise ValueError(f"idle_timeout_s must be positive, got {idle_timeout_s}")
    if max_requests_per_connection < 1:
        raise ValueError(
            f"max_requests_per_connection must be at least 1, got {max_requests_per_connection}"
        )
    api = QueryApi(
        conductor,
        metrics,
        ready,
        max_body_bytes,
        auth_token,
        client_timeout_s,
        registrations,
        idle_timeout_s,
        max_requests_per_connection,
    )
    app = web.Application(
        client_max_size=max_body_bytes,
        middlewares=[api.middleware],
        # aiohttp closes a connection whose keep-alive timer fires while it
        # waits for a request's headers, from connect or from the last answer:
        # that is the header timeout (slowloris) as well as the idle one.
        handler_args={"keepalive_timeout": idle_timeout_s},
    )
    app[API_KEY] = api
    app.on_response_prepare.append(api.count_answer)
    app.router.add_post("/query", api.query, name="query", expect_handler=api.expect)
    app.router.add_post(
        "/query_by_hash", api.query_by_hash, name="query_by_hash", expect_handler=api.expect
    )
    app.router.add_post(
        "/query_tiered_by_hash",
        api.query_tiered_by_hash,
        name="query_tiered_by_hash",
        expect_handler=api.expect,
    )
    RegistrationRoutes(
        lambda: api.registrations,
        lambda: api.conductor.context_blocks(),
        "registration is off at this address (http.registrations_topic is empty)",
    ).add_to(app)
    app.router.add_get("/workers", api.workers, name="workers")
    app.router.add_get("/health", api.health, name="health")
    app.router.add_get("/ready", api.ready, name="ready")
    app.router.add_get("/metrics", api.metrics_text, name="metrics")
    return app
