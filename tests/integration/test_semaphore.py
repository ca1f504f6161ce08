"""Semaphores with expiring permits, against real servers: at most N holders across
processes, permits of dead holders coming back when their lease ends, explicit permit
changes, re-entry, the watchdog, sync and async, and bad input."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lockaspect import (
    ConfigurationError,
    LockClient,
    LockLost,
    LockNotAcquired,
    current_lease,
    distributed_semaphore,
)
from lockaspect.testing import LockServer

LIVENESS = 30.0  # deadlock guard, not a speed expectation

WORKER = """
import sys, time
import redis
from lockaspect import LockClient

url, namespace, permits, sections = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
raw = redis.Redis.from_url(url)
with LockClient.from_url(url, namespace=namespace) as client:
    for _ in range(sections):
        with client.semaphore("pool", permits=permits, wait=None):
            inside = raw.incr(namespace + "inside")
            if inside > permits:
                raw.rpush(namespace + "violations", inside)
            raw.rpush(namespace + "peaks", inside)
            time.sleep(0.002)
            raw.decr(namespace + "inside")
            raw.incr(namespace + "sections")
"""

HOLDER = """
import sys, time
from lockaspect import LockClient

url, namespace = sys.argv[1], sys.argv[2]
client = LockClient.from_url(url, namespace=namespace, watchdog_lease=1.0)
with client.semaphore("dies", permits=1):
    print("held", flush=True)
    time.sleep(600)
"""


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + LIVENESS
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def client(lock_server: LockServer, namespace: str) -> Iterator[LockClient]:
    with LockClient.from_url(lock_server.url, namespace=namespace, watchdog_lease=1.0) as made:
        yield made


def hold_in_thread(client: LockClient, key: str, permits: int) -> tuple[threading.Event, threading.Thread]:
    """Hold a permit on a thread of its own until the returned event is set."""
    held, done = threading.Event(), threading.Event()

    def run() -> None:
        with client.semaphore(key, permits=permits):
            held.set()
            done.wait(LIVENESS)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert held.wait(LIVENESS)
    return done, thread


class TestAcrossProcesses:
    def test_never_more_holders_than_permits(self, lock_server: LockServer, namespace: str) -> None:
        """Four processes, 30 sections each, 2 permits: no section ever saw a third holder."""
        raw = lock_server.redis()
        procs = [
            subprocess.Popen([sys.executable, "-c", WORKER, lock_server.url, namespace, "2", "30"]) for _ in range(4)
        ]
        for proc in procs:
            assert proc.wait(LIVENESS * 3) == 0
        assert raw.lrange(namespace + "violations", 0, -1) == []
        assert int(raw.get(namespace + "sections")) == 120
        assert max(int(x) for x in raw.lrange(namespace + "peaks", 0, -1)) <= 2

    def test_permit_of_a_killed_holder_comes_back_when_its_lease_ends(
        self, lock_server: LockServer, namespace: str, client: LockClient
    ) -> None:
        """kill -9 a process holding the only permit: it stays taken until its 1 s lease ends, then a waiter gets it."""
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, lock_server.url, namespace], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "held"
            assert client.permits("dies") == (1, 1)
            with pytest.raises(LockNotAcquired), client.semaphore("dies", permits=1):
                pytest.fail("the permit is held")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(LIVENESS)
            if proc.stdout is not None:
                proc.stdout.close()
        with client.semaphore("dies", permits=1, wait=LIVENESS) as permit:
            assert permit.permits == 1
            assert client.permits("dies") == (1, 1)
        assert client.permits("dies") == (1, 0)


class TestPermits:
    def test_n_holders_then_busy_then_a_release_wakes_a_waiter(self, client: LockClient) -> None:
        """Two permits: two holders, a third caller fails at once or waits and is woken by a release."""
        first, t1 = hold_in_thread(client, "two", 2)
        second, t2 = hold_in_thread(client, "two", 2)
        assert client.permits("two") == (2, 2)
        with pytest.raises(LockNotAcquired) as caught, client.semaphore("two", permits=2):
            pytest.fail("no permit is free")
        assert caught.value.holder_ttl is not None
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(_enter_and_leave(client, "two", 2)))
        waiter.start()
        first.set()
        waiter.join(LIVENESS)
        assert len(got) == 1
        second.set()
        t1.join(LIVENESS)
        t2.join(LIVENESS)
        assert client.permits("two") == (2, 0)

    def test_another_number_of_permits_is_refused_until_set_permits(self, client: LockClient) -> None:
        with client.semaphore("n", permits=2):
            pass
        with pytest.raises(ConfigurationError, match="set_permits"), client.semaphore("n", permits=3):
            pytest.fail("the semaphore has 2 permits")
        assert client.permits("n") == (2, 0)
        client.set_permits("n", 3)
        assert client.permits("n") == (3, 0)
        with client.semaphore("n", permits=3) as permit:
            assert permit.permits == 3

    def test_lowering_permits_keeps_holders(self, client: LockClient) -> None:
        done, thread = hold_in_thread(client, "low", 2)
        second, thread2 = hold_in_thread(client, "low", 2)
        client.set_permits("low", 1)
        assert client.permits("low") == (1, 2)
        with pytest.raises(LockNotAcquired), client.semaphore("low", permits=1):
            pytest.fail("two are held, one is allowed")
        done.set()
        thread.join(LIVENESS)
        with pytest.raises(LockNotAcquired), client.semaphore("low", permits=1):
            pytest.fail("one is held, one is allowed")
        second.set()
        thread2.join(LIVENESS)
        with client.semaphore("low", permits=1):
            assert client.permits("low") == (1, 1)

    def test_a_waiter_with_the_old_number_fails_when_permits_change(self, client: LockClient) -> None:
        done, thread = hold_in_thread(client, "moved", 1)
        errors: list[BaseException] = []

        def wait_old() -> None:
            try:
                _enter_and_leave(client, "moved", 1)
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                errors.append(exc)

        waiter = threading.Thread(target=wait_old)
        waiter.start()
        wait_until(lambda: client.backend.redis.llen(client.backend.semaphore_key("moved") + ":waiters") == 1, "queued")
        client.set_permits("moved", 2)
        waiter.join(LIVENESS)
        assert len(errors) == 1
        assert isinstance(errors[0], ConfigurationError)
        assert client.backend.redis.llen(client.backend.semaphore_key("moved") + ":waiters") == 0
        done.set()
        thread.join(LIVENESS)

    def test_reentry_in_one_context_uses_one_permit(self, client: LockClient) -> None:
        with client.semaphore("re", permits=1) as outer:
            with client.semaphore("re", permits=1) as inner:
                assert inner is outer
                assert client.permits("re") == (1, 1)
            assert client.permits("re") == (1, 1), "the outer block still holds it"
        assert client.permits("re") == (1, 0)

    def test_the_watchdog_renews_a_permit(self, client: LockClient) -> None:
        """A 1 s watchdog lease, held through two renewals: still held in the store, not lost."""
        with client.semaphore("long", permits=1) as permit:
            wait_until(lambda: client.stats().renewals >= 2, "two renewals")
            assert client.permits("long") == (1, 1)
            assert not permit.lost
        assert client.stats().lost == 0

    def test_a_fixed_lease_that_ends_is_lost(self, client: LockClient) -> None:
        with pytest.raises(LockLost) as caught, client.semaphore("short", permits=1, lease=0.2):
            wait_until(lambda: client.permits("short")[1] == 0, "the permit to expire")
        assert caught.value.reason in ("not-owner", "expired")


def _enter_and_leave(client: LockClient, key: str, permits: int) -> int:
    with client.semaphore(key, permits=permits, wait=LIVENESS) as permit:
        return permit.fencing_token


class TestDecoratorAndAsync:
    def test_decorator_sync_and_async(self, client: LockClient) -> None:
        @distributed_semaphore("pool:<name>", permits=2, client=client)
        def work(name: str) -> int | None:
            lease = current_lease()
            return None if lease is None else lease.permits

        @distributed_semaphore("pool:<name>", permits=2, client=client)
        async def awork(name: str) -> int | None:
            lease = current_lease()
            return None if lease is None else lease.permits

        async def main() -> int | None:
            result = await awork("a")
            await client.aclose()
            return result

        assert work("a") == 2
        assert asyncio.run(main()) == 2
        assert client.permits("pool:a") == (2, 0)

    def test_async_tasks_share_two_permits(self, client: LockClient) -> None:
        """Three tasks, two permits: two get in together, the third only after one leaves."""

        async def main() -> list[str]:
            events: list[str] = []
            both_in = asyncio.Event()
            inside = 0

            async def task(name: str) -> None:
                nonlocal inside
                async with client.semaphore("tasks", permits=2, wait=LIVENESS):
                    inside += 1
                    events.append(f"in {name}")
                    if inside == 2:
                        both_in.set()
                    await asyncio.wait_for(both_in.wait(), LIVENESS)
                    inside -= 1
                    events.append(f"out {name}")

            await asyncio.gather(task("a"), task("b"), task("c"))
            await client.aclose()
            return events

        events = asyncio.run(main())
        first = [event.removeprefix("in ") for event in events[:2]]
        assert all(event.startswith("in ") for event in events[:2]), "two tasks get in together"
        (third,) = {"a", "b", "c"} - set(first)
        assert events.index(f"in {third}") > min(events.index(f"out {name}") for name in first)


class TestBadInput:
    @pytest.mark.parametrize(
        ("permits", "error"),
        [(0, ConfigurationError), (-1, ConfigurationError), ("2", TypeError), (True, TypeError), (2.0, TypeError)],
    )
    def test_decorator_rejects_bad_permits_at_decoration(self, permits: Any, error: type[Exception]) -> None:
        with pytest.raises(error, match="permits"):

            @distributed_semaphore("k", permits=permits)
            def work() -> None: ...

    @pytest.mark.parametrize(("permits", "error"), [(0, ConfigurationError), ("2", TypeError)])
    def test_client_rejects_bad_permits_before_any_io(
        self, client: LockClient, permits: Any, error: type[Exception], commands: Any
    ) -> None:
        with commands.assert_none(), pytest.raises(error, match="permits"):
            client.semaphore("k", permits=permits)
        with commands.assert_none(), pytest.raises(error, match="permits"):
            client.set_permits("k", permits)
