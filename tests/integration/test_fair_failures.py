"""A fair waiter whose attempt fails with a transient store error (a reset connection, a
failover) keeps its turn, and a release that hands the lock to a token it gave up does not
leave the lock held by nobody. On the memory store (FAIR_HANDOFF, like Redis), with the
failure raised by the store at the chosen moment; the engine's decisions are the same for
every store that hands over."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from lockaspect import LockClient, LockNotAcquired
from lockaspect.backends.base import AcquireRequest, AcquireResult
from lockaspect.backends.memory.store import AsyncMemoryStore, MemoryStore
from lockaspect.errors import BackendError

#: Longer than any wait below: a lock left held by a token nobody has outlasts the wait.
LONG_LEASE = 120.0
BOUND = 30.0  # a hang guard, not a speed expectation


class FailingStore(MemoryStore):
    """A memory store whose ``fail(request)`` hook may run something, then fail the attempt
    (transient) before it reaches the store; the async twin shares it."""

    fail: Callable[[AcquireRequest], bool] = staticmethod(lambda request: False)

    def acquire(self, request: AcquireRequest) -> AcquireResult:
        if self.fail(request):
            raise BackendError("injected: connection reset", key=request.keys[0], transient=True)
        return super().acquire(request)

    def asyncio_twin(self) -> AsyncMemoryStore:
        outer = self

        class _Twin(AsyncMemoryStore):
            async def acquire(self, request: AcquireRequest) -> AcquireResult:
                if outer.fail(request):
                    raise BackendError("injected: connection reset", key=request.keys[0], transient=True)
                return await super().acquire(request)

        return _Twin(self._shared, self.namespace)


def _waiters(store: MemoryStore, key: str) -> int:
    return sum(state.waiters for state in store.describe(key) if state.kind == "fair")


def test_a_release_that_hands_the_lock_to_a_token_given_up_passes_it_on() -> None:
    """The waiter queued (its token registered with its place); its next attempt fails while
    the holder releases, which makes that registered token the owner. The waiter gave the
    token up (the failed attempt's undo may still arrive): it gives it back, and takes the
    lock with its new token, long before the lease of the given-up token would end."""
    store = FailingStore()
    client = LockClient(store)
    holding, release, released = threading.Event(), threading.Event(), threading.Event()
    attempts: list[str] = []

    def holder() -> None:
        with client.lock("k", fair=True, lease=LONG_LEASE):
            holding.set()
            release.wait(BOUND)
        released.set()

    def fail(request: AcquireRequest) -> bool:
        if request.kind != "fair" or request.waiter is None or threading.current_thread() is holder_thread:
            return False
        attempts.append(request.token)
        if len(attempts) == 2:  # the queued waiter's next attempt: the holder releases meanwhile
            release.set()
            assert released.wait(BOUND)
            return True
        return False

    store.fail = fail  # type: ignore[method-assign]
    holder_thread = threading.Thread(target=holder)
    holder_thread.start()
    assert holding.wait(BOUND)
    try:
        with client.lock("k", fair=True, wait=10.0, lease=LONG_LEASE) as lease:
            assert lease.token not in attempts[:2]
            assert [state.held_by[0].token for state in store.describe("k") if state.holders] == [lease.token]
    finally:
        release.set()
        holder_thread.join(BOUND)
        client.close()


@pytest.mark.parametrize("runner", ["thread", "asyncio"])
def test_a_waiter_whose_first_attempt_failed_keeps_its_turn(runner: str) -> None:
    """W1 comes second, after the holder; its first attempt fails. It still queues (a place of
    its own, taken afresh), so W2, queued after it, gets the lock after it."""
    store = FailingStore()
    client = LockClient(store)
    failed_once: list[bool] = []

    def fail(request: AcquireRequest) -> bool:
        if request.kind == "fair" and not failed_once and threading.current_thread().name == "w1":
            failed_once.append(True)
            return True
        return False

    store.fail = fail  # type: ignore[method-assign]
    order: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def holder() -> None:
        with client.lock("k", fair=True, lease=LONG_LEASE):
            holding.set()
            release.wait(BOUND)

    def w1() -> None:
        if runner == "thread":
            with client.lock("k", fair=True, wait=BOUND, lease=LONG_LEASE):
                order.append("w1")
            return

        async def main() -> None:
            async with client.lock("k", fair=True, wait=BOUND, lease=LONG_LEASE):
                order.append("w1")
            await client.aclose()

        asyncio.run(main())

    def w2() -> None:
        with client.lock("k", fair=True, wait=BOUND, lease=LONG_LEASE):
            order.append("w2")

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert holding.wait(BOUND)
    first = threading.Thread(target=w1, name="w1")
    first.start()
    _until(lambda: failed_once and _waiters(store, "k") == 1, "w1 to queue after its failed attempt")
    second = threading.Thread(target=w2)
    second.start()
    _until(lambda: _waiters(store, "k") == 2, "w2 to queue behind w1")
    release.set()
    for thread in (threads[0], first, second):
        thread.join(BOUND)
    client.close()
    assert order == ["w1", "w2"]


def _until(condition: Callable[[], Any], what: str) -> None:
    done = threading.Event()
    for _ in range(3000):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_wait_of_a_waiter_that_keeps_failing_runs_out_and_leaves_nothing() -> None:
    store = FailingStore()
    client = LockClient(store)
    store.fail = lambda request: request.kind == "fair" and request.waiter is not None  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            with client.lock("k", fair=True, wait=0.3):
                pass
        except (LockNotAcquired, BackendError) as exc:
            errors.append(exc)

    with client.lock("k", fair=True, lease=LONG_LEASE):
        thread = threading.Thread(target=waiter)
        thread.start()
        thread.join(BOUND)
    assert len(errors) == 1
    assert _waiters(store, "k") == 0
    assert not [state for state in store.describe("k") if state.holders]
    client.close()
