"""Starting and retiring aiokafka clients, for the daemon, the bridge and the tools."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol, TypeVar


class Client(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


C = TypeVar("C", bound=Client)


async def started(make: Callable[[], C]) -> C:
    """A client from `make`, started; stopped again if it fails to start
    (aiokafka leaves tasks and connections of a failed start open)."""
    client = make()
    try:
        await client.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await client.stop()
        raise
    return client


async def retire(client: Client, grace_s: float) -> None:
    """Stop a client a successor replaced, within `grace_s`: one aiokafka
    gave up on may not stop cleanly."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.stop(), grace_s)
