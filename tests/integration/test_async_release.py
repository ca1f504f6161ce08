"""An ``async with`` block's release runs in the caller's task; a cancellation that cuts it short
while it is in flight does not leave the lock held: the release is sent again from a task of its
own (``resend_release``), by owner token, so it releases the lock or finds it released already.

The server is paused (SIGSTOP) with the release written and unanswered, so the cancellation lands
exactly there; a server of its own, resumed at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from lockaspect import Lease, LockClient
from lockaspect.renewal import CLOSED
from lockaspect.testing import LockServer

WAIT = 15.0


async def until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.002)


def evalsha_calls(raw: Any) -> int:
    return int(raw.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_release_cut_short_by_a_cancellation_is_sent_again(fresh_server: LockServer, namespace: str) -> None:
    client = LockClient.from_url(fresh_server.url, namespace=namespace)
    rival = LockClient.from_url(fresh_server.url, namespace=namespace)
    raw = fresh_server.redis()
    lock_key = client.backend.lock_key("resend")
    held: list[Lease] = []
    calls: list[int] = []

    async def main() -> None:
        go = asyncio.Event()

        async def hold() -> None:
            async with client.lock("resend") as lease:
                held.append(lease)
                await go.wait()

        task = asyncio.create_task(hold())
        await until(lambda: held, "the lock")
        calls.append(evalsha_calls(raw))
        fresh_server.pause()
        try:
            go.set()
            # The hold is given back and the release written in the same step (no await in
            # between with a connection free): once the count is 0, the release is in flight.
            await until(lambda: held[0].hold_count == 0, "the release under way")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            fresh_server.resume()
        await until(lambda: not client._async.state().tasks, "the resent release")

    try:
        asyncio.run(main())
        lease = held[0]
        # The release that went out before the cancellation ran (RELEASED, its answer never
        # read), and so did the one sent again (NOT_OWNER: not reported as a loss).
        assert evalsha_calls(raw) - calls[0] == 2
        assert raw.exists(lock_key) == 0
        with rival.lock("resend") as theirs:  # free in the store: another owner takes it
            assert theirs.fencing_token > lease.fencing_token
        assert lease._record.state == CLOSED  # nothing renews a released lock
        stats = client.stats()
        assert (stats.acquired, stats.lost, stats.held) == (1, 0, 0)
        assert not lease.held
        wait_for(lambda: len(client._engine.timer) == 0, "the timer to empty")
    finally:
        client.close()
        rival.close()
        raw.close()


def test_a_release_not_cut_short_is_not_sent_twice(fresh_server: LockServer, namespace: str) -> None:
    """The usual cycle: one release round trip per cycle (counted by the server), no task left."""
    client = LockClient.from_url(fresh_server.url, namespace=namespace)
    raw = fresh_server.redis()

    async def main() -> Any:
        async with client.lock("once"):
            pass
        before = evalsha_calls(raw)
        async with client.lock("once"):
            pass
        return before, client._async.state().tasks

    try:
        before, tasks = asyncio.run(main())
        assert evalsha_calls(raw) - before == 2  # the acquire and the release
        assert not tasks
        assert client.stats().released == 2
    finally:
        client.close()
        raw.close()
