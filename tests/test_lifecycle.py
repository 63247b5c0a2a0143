"""The services' shared lifecycle: phases, their transitions, start-up retries."""

from __future__ import annotations

import asyncio

import pytest

from kvconductor.lifecycle import InvalidTransition, Lifecycle, Phase, with_backoff


def test_a_start_up_runs_then_stops() -> None:
    life = Lifecycle()
    assert life.status == "starting"
    life.move(Phase.STARTING, "creating topics")
    assert life.status == "creating topics"
    life.move(Phase.RESTORING)
    assert life.status == "restoring snapshot"
    life.move(Phase.RUNNING)
    assert life.running and life.status == "running"
    life.move(Phase.STOPPING)
    life.move(Phase.STOPPED)
    assert life.status == "stopped"


def test_a_running_service_does_not_start_again() -> None:
    life = Lifecycle()
    life.move(Phase.RUNNING)
    for phase in (Phase.STARTING, Phase.WAITING, Phase.RESTORING, Phase.NOT_STARTED):
        with pytest.raises(InvalidTransition):
            life.move(phase)
    life.move(Phase.STOPPING)
    with pytest.raises(InvalidTransition):
        life.move(Phase.RUNNING)


def test_waiting_says_why_and_resumes_where_it_was() -> None:
    life = Lifecycle()
    life.move(Phase.STARTING, "creating topics")
    life.wait("creating topics: kafka unavailable")
    life.wait("creating topics: kafka unavailable")
    assert life.phase is Phase.WAITING
    assert life.status == "creating topics: kafka unavailable"
    life.resume()
    assert (life.phase, life.status) == (Phase.STARTING, "creating topics")


async def test_with_backoff_retries_until_the_step_succeeds() -> None:
    life = Lifecycle(Phase.NOT_STARTED)
    seen: list[str] = []
    failures = [OSError("refused")]

    async def attempt() -> int:
        if failures:
            raise failures.pop()
        seen.append(life.status)
        return 7

    result = await with_backoff(
        "starting",
        attempt,
        retry_on=(OSError,),
        lifecycle=life,
        waiting=lambda exc: f"waiting for kafka: {exc}",
        stopping=asyncio.Event(),
        on_retry=lambda exc: seen.append(f"retry {exc}"),
    )
    assert result == 7
    # The attempt sees the waiting text; success goes back to where it was.
    assert seen == ["retry refused", "waiting for kafka: refused"]
    assert life.phase is Phase.NOT_STARTED


async def test_with_backoff_gives_up_when_stopping_and_passes_other_errors() -> None:
    life = Lifecycle()
    stopping = asyncio.Event()
    stopping.set()

    async def down() -> None:
        raise OSError("refused")

    with pytest.raises(asyncio.CancelledError):
        await with_backoff(
            "x", down, retry_on=(OSError,), lifecycle=life, waiting=str, stopping=stopping
        )

    async def broken() -> None:
        raise ValueError("not a Kafka outage")

    with pytest.raises(ValueError):
        await with_backoff(
            "x", broken, retry_on=(OSError,), lifecycle=life, waiting=str, stopping=asyncio.Event()
        )


async def test_an_outage_while_running_leaves_the_phase_alone() -> None:
    life = Lifecycle()
    life.move(Phase.RUNNING)
    failures = [OSError("refused")]

    async def attempt() -> None:
        if failures:
            raise failures.pop()

    await with_backoff(
        "taking over", attempt, retry_on=(OSError,), lifecycle=life, waiting=str,
        stopping=asyncio.Event(),
    )  # fmt: skip
    assert life.status == "running"
