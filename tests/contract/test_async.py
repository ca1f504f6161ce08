"""The lock contract for asyncio tasks, on every store and every kind it declares (see
conftest). Each test runs its own event loop (``asyncio.run``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from lockaspect import ConfigurationError, KeyTemplateError, LockClient, LockLost, LockNotAcquired, current_lease

from .conftest import ALL_KINDS, EXCLUSIVE, block, fence, force_release, skip_if_session_bound, skip_unless_served

BOUND = 20.0  # seconds: how long a broken store may hang a test


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, BOUND * 3))


async def try_now(client: LockClient, kind: str, key: str) -> bool:
    try:
        async with block(client, kind, key, wait=0):
            return True
    except LockNotAcquired:
        return False


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_mutual_exclusion(client: LockClient, kind: str) -> None:
    """Tasks contending for one key are never inside together, and every one gets in."""
    skip_unless_served(client, kind)
    inside, most, entered = [0], [0], [0]

    async def worker() -> None:
        for _ in range(10):
            async with block(client, kind, "mx", wait=BOUND):
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                entered[0] += 1
                await asyncio.sleep(0.001)  # part of the workload: lets the others run
                inside[0] -= 1

    async def main() -> None:
        await asyncio.gather(*(worker() for _ in range(4)))

    run(main())
    assert (most[0], entered[0]) == (1, 40)


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_sync_and_async_exclude_each_other(client: LockClient, kind: str) -> None:
    """A lock held by a thread keeps a task out, and the other way round."""
    skip_unless_served(client, kind)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        taken, done = threading.Event(), threading.Event()

        def hold() -> None:
            with block(client, kind, "both"):
                taken.set()
                done.wait(BOUND)

        holder = threading.Thread(target=hold)
        holder.start()
        assert await loop.run_in_executor(None, taken.wait, BOUND)
        assert not await try_now(client, kind, "both")
        done.set()
        await loop.run_in_executor(None, holder.join, BOUND)
        async with block(client, kind, "both"):
            taken: list[bool] = []
            thread = threading.Thread(target=lambda: taken.append(_sync_try(client, kind, "both")))
            thread.start()
            await asyncio.get_running_loop().run_in_executor(None, thread.join, BOUND)
            assert taken == [False]

    run(main())


def _sync_try(client: LockClient, kind: str, key: str) -> bool:
    try:
        with block(client, kind, key, wait=0):
            return True
    except LockNotAcquired:
        return False


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_reentry_along_the_call_chain(make_client: Callable[..., LockClient], kind: str) -> None:
    """A nested block in the same task re-enters; another client's task does not get in (a
    task the holder creates shares its context, and so its locks)."""
    client, other = make_client(), make_client()
    skip_unless_served(client, kind)

    async def main() -> None:
        async with block(client, kind, "re") as outer:
            async with block(client, kind, "re") as inner:
                assert fence(inner, "re") == fence(outer, "re")
                if kind != "multi":
                    assert current_lease() is inner
            if kind != "read":
                assert not await asyncio.create_task(try_now(other, kind, "re"))
        assert await try_now(client, kind, "re")

    run(main())


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_fencing_tokens_strictly_increase(client: LockClient, kind: str) -> None:
    skip_unless_served(client, kind)

    async def main() -> list[int]:
        tokens = []
        for _ in range(4):
            async with block(client, kind, "fence") as lease:
                tokens.append(fence(lease, "fence"))
        return tokens

    tokens = run(main())
    assert tokens == sorted(set(tokens))


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_fixed_lease_expires(make_client: Callable[..., LockClient], kind: str) -> None:
    """A fixed lease ends by itself: the next caller gets it with a larger fencing token; the
    old lease reports ``lost`` and its block raises ``LockLost``."""
    holder, other = make_client(), make_client()
    skip_unless_served(holder, kind)
    skip_if_session_bound(holder.backend, "a fixed lease does not end the hold while its session lives")

    async def main() -> None:
        taken, done = asyncio.Event(), asyncio.Event()
        seen: list[Any] = []

        async def hold() -> None:
            async with block(holder, kind, "exp", lease=0.3) as lease:
                seen.append(lease)
                taken.set()
                await done.wait()

        task = asyncio.create_task(hold())
        await taken.wait()
        async with block(other, kind, "exp", wait=BOUND) as lease:
            assert fence(lease, "exp") > fence(seen[0], "exp")
            assert seen[0].lost
        done.set()
        with pytest.raises(LockLost):
            await task

    run(main())


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_watchdog_keeps_the_lock_past_its_lease(make_client: Callable[..., LockClient], kind: str) -> None:
    holder, other = make_client(), make_client()
    skip_unless_served(holder, kind)

    async def main() -> None:
        async with block(holder, kind, "wd") as lease:
            with pytest.raises(LockNotAcquired):
                async with block(other, kind, "wd", wait=1.5):
                    pass
            assert not lease.lost

    run(main())


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_lost_lease_signal(client: LockClient, kind: str) -> None:
    """Deleted behind its back: ``on_lost`` runs, ``lost`` is true, the block raises ``LockLost``."""
    skip_unless_served(client, kind)

    async def main() -> None:
        called = asyncio.Event()

        async def hold() -> None:
            async with block(client, kind, "lost", on_lost=lambda lease: called.set()) as lease:
                force_release(client.backend, "lost")
                await called.wait()
                assert lease.lost

        with pytest.raises(LockLost):
            await hold()

    run(main())


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_waiter_woken_by_release(make_client: Callable[..., LockClient], kind: str) -> None:
    holder, waiter = make_client(), make_client()
    skip_unless_served(holder, kind)

    async def main() -> list[str]:
        order: list[str] = []
        started = asyncio.Event()

        async def wait_for_it() -> None:
            started.set()
            async with block(waiter, kind, "wake", wait=BOUND):
                order.append("acquired")

        async with block(holder, kind, "wake"):
            task = asyncio.create_task(wait_for_it())
            await started.wait()
            order.append("released")
        await task
        return order

    assert run(main()) == ["released", "acquired"]


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_wait_runs_out(make_client: Callable[..., LockClient], kind: str) -> None:
    holder, other = make_client(), make_client()
    skip_unless_served(holder, kind)

    async def main() -> None:
        async with block(holder, kind, "busy"):
            for wait in (0, 0.2):
                with pytest.raises(LockNotAcquired):
                    async with block(other, kind, "busy", wait=wait):
                        pass
        assert await try_now(other, kind, "busy")

    run(main())


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_cancelled_waiter_leaves_nothing_behind(make_client: Callable[..., LockClient], kind: str) -> None:
    """A waiter cancelled while it waits leaves no trace: once the holder releases, a
    try-once caller gets the lock at once (a fair queue keeps no dead place)."""
    holder, waiter, next_caller = make_client(), make_client(), make_client()
    skip_unless_served(holder, kind)

    async def main() -> None:
        async with block(holder, kind, "cancel"):
            task = asyncio.create_task(_enter(block(waiter, kind, "cancel", wait=None)))
            # Let it make its first attempt and start waiting; whenever the cancel lands, the
            # property below must hold.
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await try_now(next_caller, kind, "cancel")

    run(main())


async def _enter(context: Any) -> None:
    async with context:
        pass


@pytest.mark.parametrize("kind", ["lock", "fair", "semaphore", "read", "write"])
def test_bad_input(client: LockClient, kind: str) -> None:
    """Malformed options and keys raise their exact error (before any I/O)."""

    async def main() -> None:
        cases: list[tuple[type[BaseException], Callable[[], Any]]] = [
            (KeyTemplateError, lambda: block(client, kind, "")),
            (ConfigurationError, lambda: block(client, kind, "k", lease=-1)),
            (ConfigurationError, lambda: block(client, kind, "k", wait=-1)),
        ]
        for error, make in cases:
            with pytest.raises(error) as info:
                async with make():
                    pass
            assert type(info.value) is error

    run(main())


def test_multi_lock_release_with_a_stolen_key(make_client: Callable[..., LockClient]) -> None:
    """See the sync suite's test of that name: ``LockLost`` for the stolen key, the rest
    released, the thief's hold of the stolen key left alone. The thief takes it in a task of
    its own: a store that reports the loss at once (ZooKeeper's watch) cancels the body."""
    client, thief, other = make_client(), make_client(), make_client()
    skip_unless_served(client, "multi")

    async def main() -> None:
        go, taken, done = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def steal() -> None:
            await go.wait()
            async with thief.lock("st:b", wait=BOUND):
                taken.set()
                await done.wait()

        thief_task = asyncio.create_task(steal())

        async def steal_one() -> None:
            async with client.multi_lock(["st:a", "st:b"]):
                force_release(client.backend, "st:b")
                go.set()
                try:
                    await taken.wait()
                except asyncio.CancelledError:  # the loss, reported at once: leave once stolen
                    await asyncio.wait_for(taken.wait(), BOUND)
                    raise

        with pytest.raises(LockLost) as caught:
            await steal_one()
        assert caught.value.key in ("st:a", "st:b")  # a SESSION_BOUND store reports the set lost
        assert await try_now(other, "lock", "st:a")
        assert not await try_now(other, "lock", "st:b")
        done.set()
        await asyncio.wait_for(thief_task, BOUND)
        assert await try_now(other, "lock", "st:b")

    run(main())


def test_multi_lock_release_wakes_a_waiter_on_each_key(make_client: Callable[..., LockClient]) -> None:
    """Leaving an ``async with`` multi-key block hands each key to the task waiting for it."""
    waiting = threading.Semaphore(0)

    def observe(event: Any) -> None:
        if event.name == "waiting":
            waiting.release()

    holder, waiter = make_client(), make_client(observers=[observe])
    skip_unless_served(holder, "multi")

    async def main() -> list[str]:
        got: list[str] = []

        async def take(key: str) -> None:
            async with waiter.lock(key, wait=BOUND):
                got.append(key)

        async with holder.multi_lock(["wm:a", "wm:b"]):
            tasks = [asyncio.create_task(take(key)) for key in ("wm:a", "wm:b")]
            for _ in tasks:
                while not waiting.acquire(blocking=False):
                    await asyncio.sleep(0.01)  # polls the observer's count; bounded by run()
            assert got == []
        await asyncio.gather(*tasks)
        return sorted(got)

    assert run(main()) == ["wm:a", "wm:b"]
