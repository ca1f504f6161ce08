"""Re-entry holds are counted in one place, the client, before the round trip.

Regression tests for two bugs of the same root: the store counted re-entries of a lock, the
client counted them too, and the two could disagree.

* A re-entry racing the outer call's exit: the outer call saw the count reach 0, stopped the
  renewal and sent a release the store answered "still held"; the re-entry's reply came
  next and its body ran on a lock nobody renewed, that another client then took.
* A re-entry whose reply timed out left its hold in the store: after the outer call the lock
  stayed taken for the rest of its lease.

Real server; the reply of the re-entry is held back by a real network stall (a proxy that
stops forwarding), not by a mock.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from faults import DOWN, FaultProxy, wait_until

from lockaspect import BackendError, LockClient, LockNotAcquired, current_lease
from lockaspect.testing import LockServer


def _address(server: LockServer) -> tuple[str, int]:
    return ("127.0.0.1", server.port)


@pytest.fixture
def proxy(lock_server: LockServer) -> Iterator[FaultProxy]:
    with FaultProxy(_address(lock_server)) as proxy:
        yield proxy


class TestReentryRacingTheOuterExit:
    """Thread B shares the outer call's context (a copy) and re-enters while A returns."""

    @pytest.mark.parametrize("kind", ["lock", "fair", "semaphore", "read", "write"])
    def test_the_re_entered_holder_stays_renewed_and_exclusive(
        self, proxy: FaultProxy, make_client: Callable[..., LockClient], kind: str
    ) -> None:
        # A short watchdog lease: a lease nobody renews is gone within a second.
        holder = make_client(url=proxy.url, watchdog_lease=1.0, tick=0.02, delay_weight=0.5)
        other = make_client(watchdog_lease=1.0, tick=0.02, delay_weight=0.5)

        def block(client: LockClient, wait: float = 0.0) -> Any:
            if kind == "lock":
                return client.lock("race", wait=wait)
            if kind == "fair":
                return client.fair_lock("race", wait=wait)
            if kind == "semaphore":
                return client.semaphore("race", permits=1, wait=wait)
            return client.rw_lock("race").write(wait=wait) if kind == "write" else client.rw_lock("race").read()

        with block(holder):  # warm-up: scripts loaded, one connection made
            pass
        entered, leave = threading.Event(), threading.Event()
        failures: list[BaseException] = []
        renewals_inside: list[int] = []

        def inner() -> None:
            try:
                with block(holder) as lease:  # re-enters: the context holds the outer lease
                    entered.set()
                    assert leave.wait(30)
                    renewals_inside.append(holder.stats().renewals)
                    lease.check()
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        with block(holder) as outer:
            context = contextvars.copy_context()
            # Hold back the replies of the connections open now: B's re-entry goes out on
            # one of them, runs in the store, and its answer waits in the network.
            proxy.hold(DOWN)
            sent = proxy.bytes_up
            thread = threading.Thread(target=context.run, args=(inner,))
            thread.start()
            proxy.wait_for_traffic(sent)
        # A returned (its release went out on a new connection, not held): it must not have
        # ended B's hold. Now B's re-entry gets its answer.
        proxy.release()
        assert entered.wait(30), failures
        # B holds the lock now; prove it stays renewed and exclusive over several leases.
        start = holder.stats().renewals
        wait_until(lambda: holder.stats().renewals >= start + 3, "three renewals while B holds it")
        with pytest.raises(LockNotAcquired), other.rw_lock("race").write() if kind == "read" else block(other):
            pass
        leave.set()
        thread.join(30)
        assert failures == []
        assert not outer.lost
        stats = holder.stats()
        assert stats.held == 0
        assert stats.lost == 0
        with block(other):  # free again once B left
            pass


class TestReentryThatTimesOut:
    """The re-entry runs in the store, but its reply is held up in the network past the socket
    timeout: the caller gets BackendError, and must leave no hold behind."""

    def test_a_timed_out_re_entry_leaves_no_hold_behind(
        self, proxy: FaultProxy, make_client: Callable[..., LockClient]
    ) -> None:
        client = make_client(url=proxy.url, socket_timeout=0.5)
        other = make_client()
        errors: list[BaseException] = []

        def reenter() -> None:
            try:
                with client.lock("slow"):
                    raise AssertionError("the re-entry cannot succeed: its reply is held up")
            except BackendError as exc:
                errors.append(exc)

        with client.lock("slow"):
            with client.lock("slow"):  # a first re-entry: its script is loaded
                pass
            context = contextvars.copy_context()
            proxy.hold(DOWN)  # the re-entry reaches the store; its reply does not come back in time
            try:
                thread = threading.Thread(target=context.run, args=(reenter,))
                thread.start()
                thread.join(30)
            finally:
                proxy.release()
        assert len(errors) == 1
        # The outer block's release took the lock back: nothing of the re-entry is left.
        with other.lock("slow"):
            pass
        assert client.stats().held == 0

    def test_a_timed_out_async_re_entry_leaves_no_hold_behind(
        self, proxy: FaultProxy, make_client: Callable[..., LockClient]
    ) -> None:
        client = make_client(url=proxy.url, socket_timeout=0.5)
        other = make_client()

        async def main() -> None:
            async with client.lock("slow"):
                async with client.lock("slow"):  # a first re-entry: its script is loaded
                    assert current_lease() is not None

                async def reenter() -> None:
                    async with client.lock("slow"):
                        raise AssertionError("unreachable")

                proxy.hold(DOWN)
                try:
                    with pytest.raises(BackendError):
                        await asyncio.create_task(reenter())
                finally:
                    proxy.release()

        asyncio.run(main())
        with other.lock("slow"):
            pass
        assert client.stats().held == 0
