"""Cancellation at any await point: never swallowed, never leaves a waiter queued or a
channel wedged.

* A cancellation landing while redis-py connected a fresh connection was swallowed on Python
  3.10/3.11 (``asyncio.wait_for``): the task entered its critical section and ran on.
* Cancelled fair-lock and write-lock waiters stayed queued: a try-once on the free lock got
  ``LockNotAcquired``, a waiting acquirer needed 5 s.
* Cancelling an async waiter during SUBSCRIBE wedged that key's channel for the loop: every
  later waiter on the key stalled and polled.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from faults import FaultProxy

from lockaspect import LockClient, _policy
from lockaspect.testing import LockServer


class TestCancellationIsNeverSwallowed:
    def test_a_cancelled_acquire_on_fresh_connections_never_enters_its_body(
        self, make_client: Callable[..., LockClient]
    ) -> None:
        client = make_client()
        rng = random.Random(3)
        entered_after_cancel: list[int] = []

        async def one_round(round_: int) -> None:
            # A new event loop per round: fresh connections, connected while the tasks run.
            entered: set[int] = set()

            async def attempt(i: int) -> None:
                async with client.lock(f"fresh:{round_}:{i}"):
                    entered.add(i)

            tasks = [asyncio.create_task(attempt(i)) for i in range(20)]
            await asyncio.sleep(rng.uniform(0, 0.004))
            cancelled = {i for i, task in enumerate(tasks) if task.cancel()}
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for i in cancelled:
                if not isinstance(results[i], asyncio.CancelledError):
                    entered_after_cancel.append(i)

        for round_ in range(40):
            asyncio.run(one_round(round_))
        assert entered_after_cancel == []
        assert client.stats().held == 0


@pytest.fixture
def holder(make_client: Callable[..., LockClient]) -> LockClient:
    return make_client()


class TestCancelledWaitersLeaveTheQueue:
    @pytest.mark.parametrize("kind", ["fair", "write"])
    def test_a_storm_of_timed_out_waiters_leaves_nothing_queued(
        self, make_client: Callable[..., LockClient], holder: LockClient, raw: Any, kind: str
    ) -> None:
        client = make_client()
        rng = random.Random(5)

        def block(c: LockClient, wait: float) -> Any:
            return c.fair_lock("q", wait=wait) if kind == "fair" else c.rw_lock("q").write(wait=wait)

        async def wait_in_line() -> None:
            async with block(client, 30):
                raise AssertionError("the lock is held: nobody gets in")

        async def give_up() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(wait_in_line(), timeout=rng.uniform(0, 0.005))

        async def two_give_up() -> None:
            await asyncio.wait_for(asyncio.gather(give_up(), give_up()), 30)

        with block(holder, 0):
            for i in range(120):
                # Every other one on a new event loop: its first attempt connects afresh.
                if i % 2:
                    asyncio.run(give_up())
                else:
                    asyncio.run(two_give_up())
        ns = client.backend.lock_key("q")
        queues = [ns + ":fair", ns + ":rw:waiters"]
        assert [raw.llen(queue) for queue in queues] == [0, 0]
        assert raw.zcard(ns + ":rw:wq") == 0
        with block(client, 0):  # a try-once on the free lock: nobody queued stands in its way
            pass
        if kind == "write":
            with client.rw_lock("q").read():  # no stale waiting writer keeps readers out
                pass


class TestCancelledDuringSubscribe:
    @pytest.fixture
    def proxy(self, lock_server: LockServer) -> Iterator[FaultProxy]:
        with FaultProxy(("127.0.0.1", lock_server.port)) as proxy:
            yield proxy

    def test_a_waiter_cancelled_while_subscribing_does_not_wedge_the_channel(
        self,
        make_client: Callable[..., LockClient],
        holder: LockClient,
        proxy: FaultProxy,
        raw: Any,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # Without a release message a waiter would sleep for the holder's whole lease.
        monkeypatch.setattr(_policy, "NOTIFY_RECHECK", 60.0)
        client = make_client(url=proxy.url)
        got: list[int] = []

        async def main() -> None:
            async with client.lock("warm"):  # the lock connection exists; the subscriber not yet
                pass
            block = holder.lock("sub", lease=30)
            block.__enter__()

            async def wait(n: int) -> None:
                async with client.lock("sub", wait=20):
                    got.append(n)

            proxy.hold_new()  # the subscriber connection that W1 opens stalls in its handshake
            first = asyncio.create_task(wait(1))
            await asyncio.get_running_loop().run_in_executor(None, proxy.wait_for_connections, 2)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            proxy.release()
            second = asyncio.create_task(wait(2))
            queue = client.backend.queue_key("sub")
            while not raw.lrange(queue, 0, -1):  # W2 subscribed and queued for a wake-up
                await asyncio.sleep(0.01)
            block.__exit__(None, None, None)  # the release message must reach W2
            await asyncio.wait_for(second, 15)

        asyncio.run(main())
        assert got == [2]


class TestCancelledAfterTheGrant:
    def test_a_fair_waiter_cancelled_once_the_release_handed_it_the_lock_hands_it_on(
        self, make_client: Callable[..., LockClient], holder: LockClient, raw: Any
    ) -> None:
        """The release makes the first waiter the owner (FAIR_HANDOFF) and the waiter is
        cancelled before it reads its wake-up: it gives the lock back, to the next in line,
        instead of leaving it held by nobody for its lease."""
        first, second = make_client(), make_client()
        queue = holder.backend.fair_queue_key("g")
        entered: list[str] = []

        async def enter(client: LockClient, who: str) -> None:
            async with client.fair_lock("g", wait=30, lease=30):
                entered.append(who)

        async def subscribed(place: int) -> None:
            while True:  # bounded by the wait_for around the test
                ids = raw.lrange(queue, 0, -1)
                if len(ids) > place:
                    channel = holder.backend.lock_key("g") + ":wake:" + ids[place].decode()
                    if raw.pubsub_numsub(channel)[0][1] > 0:
                        return
                await asyncio.sleep(0.005)

        async def main() -> None:
            with holder.fair_lock("g", wait=0, lease=30):
                cancelled = asyncio.create_task(enter(first, "first"))
                await subscribed(0)
                served = asyncio.create_task(enter(second, "second"))
                await subscribed(1)
            # released, from the loop's thread: the first cannot read its wake-up yet
            assert raw.llen(queue) == 1, "the release took the first off the queue: it holds the lock"
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            await served

        asyncio.run(asyncio.wait_for(main(), 20))
        assert entered == ["second"]
        with holder.fair_lock("g", wait=0):  # nobody holds it, nobody queues
            pass
