"""The registration routes, served by the daemon and query replicas beside
the queries and by the bridge: `POST /register`, `POST /unregister`,
`GET /services`, `GET /global_view` (`registrations` has the bodies and rules).

Each speaks both forms, by the request's Content-Type: `application/msgpack`
is Mooncake Conductor's (answers and errors in msgpack, errors with
`reason`, `field`, `index`); any other type, or none, the bridge's JSON
form (answers and errors `{"error": ...}` in JSON), except that a body
that is not JSON under a type that is not JSON gets Conductor's 400
`unsupported_content_type` (in msgpack). Answers that come before a body is
read (405, 401, 413) and the `GET` routes' answers are msgpack, unless the
request is typed `application/json` or (a `GET`) accepts JSON only.

- `/register`: 200 `{"status": "registered successfully", "instance_id"}`
  once the registration, or its merge with the registered one of its
  stream (`bodies.merge_registrations`), is on the registrations topic (or
  the registered one already said it all); 400 for one that is invalid or
  contradicts a registered one; 403 at a query replica, which reads the
  registrations but never writes to Kafka (a registration that adds
  nothing is still 200 there); 409
  for a rank a bridge's config file defines; 503 while Kafka or the
  registrations are unavailable.
- `/unregister`: 200 `{"status": "unregistered successfully",
  "removed_instances": ["<instance>|<tenant>|<rank>"]}`, 404 `service not
  found: <key>`.
- `/services`: `{"count", "services": [...]}` in Conductor's casing.
- `/global_view`: `{"context_count", "contexts": [...]}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec
from aiohttp import hdrs, web
from aiokafka.errors import KafkaError

from kvconductor.registry.bodies import (
    ConductorRegister,
    ConductorUnregister,
    InvalidRegistration,
    ReadOnlyRegistrations,
    RegisterBody,
    RegistrationConflict,
    UnregisterBody,
    global_view,
    service_key,
    service_view,
)
from kvconductor.registry.publishers import StreamKey
from kvconductor.wire.conductor import MSGPACK, ConductorError, conductor_error, is_msgpack

A = TypeVar("A")
B = TypeVar("B")

JSON = "application/json"
# Routes whose native form is Conductor's: a request without a Content-Type
# (a GET, a 405) is answered in msgpack there.
MSGPACK_PATHS = frozenset({"/register", "/unregister", "/services", "/global_view"})
# Counted blocks per (tenant, model, LoRA or "", block size).
PrefixCounts = dict[tuple[str, str, str, int], int]


class Registrar(Protocol):
    """Where registrations are kept (`registration_log.RegistrationLog`)."""

    async def register(self, body: RegisterBody) -> StreamKey: ...

    def find(self, instance_id: str, tenant_id: str | None, dp_rank: int) -> StreamKey | None: ...

    async def unregister(self, key: StreamKey) -> None: ...

    def bodies(self) -> list[RegisterBody]: ...


def msgpack_wire(request: web.Request) -> bool:
    """Whether the answer to `request` is msgpack (see the module's rules)."""
    content_type = request.headers.get(hdrs.CONTENT_TYPE, "")
    if is_msgpack(content_type):
        return True
    if request.path not in MSGPACK_PATHS:
        return False
    if content_type:
        return request.content_type != JSON
    accept = request.headers.get(hdrs.ACCEPT, "")
    return not (JSON in accept and not is_msgpack(accept))


def encoded(payload: object, status: int, msgpack: bool) -> web.Response:
    if msgpack:
        return web.Response(
            body=msgspec.msgpack.encode(payload), status=status, content_type=MSGPACK
        )
    return web.Response(body=msgspec.json.encode(payload), status=status, content_type=JSON)


def reply(request: web.Request, payload: object, status: int = 200) -> web.Response:
    """`payload` in the request's form."""
    return encoded(payload, status, msgpack_wire(request))


def error_reply(request: web.Request, status: int, message: str) -> web.Response:
    return reply(request, {"error": message}, status)


def _refused(exc: ConductorError, what: str, msgpack: bool) -> web.Response:
    if msgpack or exc.reason == "unsupported_content_type":
        return encoded(exc.as_map(), 400, True)
    return encoded({"error": f"invalid {what}: {exc.message}"}, 400, False)


def _not_stored(exc: Exception, what: str, msgpack: bool) -> web.Response:
    """A write to the registrations topic that did not happen: 403 where
    nothing is written, 503 while Kafka does not take it."""
    if isinstance(exc, ReadOnlyRegistrations):
        return encoded({"error": str(exc)}, 403, msgpack)
    return encoded({"error": f"cannot store the {what}: {exc!r}"}, 503, msgpack)


T_REGISTER = msgspec.msgpack.Decoder(ConductorRegister)
T_UNREGISTER = msgspec.msgpack.Decoder(ConductorUnregister)
J_REGISTER = msgspec.json.Decoder(RegisterBody)
J_UNREGISTER = msgspec.json.Decoder(UnregisterBody)


class RegistrationRoutes:
    """The four routes over `registrar()` (None: registration is off, 404).
    `prefix_counts`: the blocks the index holds per context, for
    `/global_view` (a bridge has none)."""

    def __init__(
        self,
        registrar: Callable[[], Registrar | None],
        prefix_counts: Callable[[], PrefixCounts] = dict,
        disabled: str = "registrations are disabled",
    ) -> None:
        self.registrar = registrar
        self.prefix_counts = prefix_counts
        self.disabled = disabled

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/register", self.register, name="register")
        app.router.add_post("/unregister", self.unregister, name="unregister")
        app.router.add_get("/services", self.services, name="services")
        app.router.add_get("/global_view", self.global_view, name="global_view")

    async def _read(
        self,
        request: web.Request,
        conductor: msgspec.msgpack.Decoder[A],
        json: msgspec.json.Decoder[B],
        what: str,
    ) -> tuple[A | B, Registrar, bool] | web.Response:
        """The body as the request's form takes it, the registrar and whether
        the form is msgpack; or the answer refusing it."""
        content_type = request.headers.get(hdrs.CONTENT_TYPE, "")
        msgpack = is_msgpack(content_type)
        raw = await request.read()
        try:
            decoded = conductor.decode(raw) if msgpack else json.decode(raw)
        except msgspec.ValidationError as exc:
            return _refused(conductor_error(exc), what, msgpack)
        except msgspec.DecodeError as exc:
            if msgpack or request.content_type == JSON:
                return _refused(conductor_error(exc), what, msgpack)
            # Neither form: JSON is taken under any type (clients that never
            # set one), so only a body that is not JSON tells.
            unsupported = ConductorError(
                "unsupported_content_type", "Content-Type must be application/msgpack"
            )
            return _refused(unsupported, what, msgpack)
        registrar = self.registrar()
        if registrar is None:
            return encoded({"error": self.disabled}, 404, msgpack)
        return decoded, registrar, msgpack

    async def register(self, request: web.Request) -> web.Response:
        got = await self._read(request, T_REGISTER, J_REGISTER, "registration")
        if isinstance(got, web.Response):
            return got
        decoded, registrar, msgpack = got
        body = decoded.body() if isinstance(decoded, ConductorRegister) else decoded
        try:
            key = await registrar.register(body)
        except InvalidRegistration as exc:
            return _refused(
                ConductorError(exc.reason, str(exc), exc.field), "registration", msgpack
            )
        except RegistrationConflict as exc:
            return encoded({"error": str(exc)}, 409, msgpack)
        except (ReadOnlyRegistrations, KafkaError, TimeoutError) as exc:
            return _not_stored(exc, "registration", msgpack)
        return encoded({"status": "registered successfully", "instance_id": key.id}, 200, msgpack)

    async def unregister(self, request: web.Request) -> web.Response:
        got = await self._read(request, T_UNREGISTER, J_UNREGISTER, "unregistration")
        if isinstance(got, web.Response):
            return got
        body, registrar, msgpack = got
        target = service_key(body.instance_id, body.tenant_id, body.dp_rank)
        key = registrar.find(body.instance_id, body.tenant_id, body.dp_rank)
        if key is None:
            return encoded({"error": f"service not found: {target}"}, 404, msgpack)
        try:
            await registrar.unregister(key)
        except (ReadOnlyRegistrations, KafkaError, TimeoutError) as exc:
            return _not_stored(exc, "unregistration", msgpack)
        answer = {"status": "unregistered successfully", "removed_instances": [target]}
        return encoded(answer, 200, msgpack)

    async def services(self, request: web.Request) -> web.Response:
        registrar = self.registrar()
        if registrar is None:
            return error_reply(request, 404, self.disabled)
        views = [service_view(b) for b in registrar.bodies()]
        return reply(request, {"count": len(views), "services": views})

    async def global_view(self, request: web.Request) -> web.Response:
        registrar = self.registrar()
        if registrar is None:
            return error_reply(request, 404, self.disabled)
        return reply(request, global_view(registrar.bodies(), self.prefix_counts()))
