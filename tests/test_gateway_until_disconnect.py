"""``until_disconnect`` (the wait for a first token or a whole answer, watched for the client going away) and ``each``
(one step per generation): results, errors and disconnects each end the right way, and nothing is left running.
Real asyncio tasks; the client is a stand-in ASGI ``receive`` the test controls."""

from __future__ import annotations

import asyncio

import pytest

from gateway.generation import ClientGone, each, until_disconnect


class _Client:
    """An HTTP request whose ``receive`` waits until the test says the client left."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.receiving = 0

    async def receive(self) -> dict:
        self.receiving += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}


def _leftover_tasks() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


def test_a_finished_wait_returns_its_result_and_stops_watching_the_client() -> None:
    async def main() -> None:
        client = _Client()

        async def work() -> str:
            await asyncio.sleep(0.01)
            return "first token"

        assert await until_disconnect(client, work()) == "first token"  # type: ignore[arg-type]
        assert client.receiving == 1
        await asyncio.sleep(0)  # the watcher was cancelled, not awaited: it unwinds in the next turn
        assert _leftover_tasks() == set()

    asyncio.run(main())


def test_a_failed_wait_raises_its_own_error() -> None:
    async def main() -> None:
        async def work() -> str:
            await asyncio.sleep(0.01)
            raise ValueError("refused")

        with pytest.raises(ValueError, match="refused"):
            await until_disconnect(_Client(), work())  # type: ignore[arg-type]
        assert _leftover_tasks() == set()

    asyncio.run(main())


def test_a_client_that_leaves_cancels_the_wait() -> None:
    async def main() -> None:
        client = _Client()
        cancelled = asyncio.Event()

        async def work() -> str:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return "never"

        asyncio.get_running_loop().call_later(0.02, client.gone.set)
        with pytest.raises(ClientGone):
            await until_disconnect(client, work())  # type: ignore[arg-type]
        assert cancelled.is_set(), "the work went on after its client left"
        assert _leftover_tasks() == set()

    asyncio.run(main())


def test_each_runs_one_generation_in_the_callers_task_and_several_side_by_side() -> None:
    async def main() -> None:
        ran_in: list[asyncio.Task | None] = []

        async def step(g: int) -> None:
            ran_in.append(asyncio.current_task())
            await asyncio.sleep(0.01)

        await each([0], step)  # type: ignore[list-item]
        assert ran_in == [asyncio.current_task()]
        ran_in.clear()
        await each([0, 1, 2], step)  # type: ignore[list-item]
        assert len(ran_in) == 3 and asyncio.current_task() not in ran_in

        async def failing(g: int) -> None:
            if g == 1:
                raise RuntimeError("one failed")
            await asyncio.sleep(30)

        with pytest.raises(RuntimeError, match="one failed"):
            await each([0, 1], failing)  # type: ignore[list-item]
        assert _leftover_tasks() == set()  # the other was cancelled and has unwound

    asyncio.run(main())
