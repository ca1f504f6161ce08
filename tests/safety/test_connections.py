"""Connections: never exhausted by lock traffic, no orphan lock after a failed attempt, and a
store restart during a wait is waited out.

* Lock commands made connections with ``pool.make_connection()`` and never gave them back:
  once they reached ``max_connections``, renewals, ``SCRIPT LOAD`` and the notifier failed
  with ``MaxConnectionsError`` (every watchdog lease lost; after ``SCRIPT FLUSH`` every
  lock call failed until the process restarted).
* A timed-out acquire left an orphan lock for a whole lease: against a stalled server the
  cleanup needed a new connection whose handshake also timed out; with the acquire's bytes
  delayed in the network, the cleanup (on another connection) ran first.
* A transient store error during a long wait ended the wait at once with ``BackendError``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from faults import UP, FaultProxy, wait_until

from lockaspect import BackendError, LockClient, LockLost
from lockaspect.testing import LockServer


class TestMaxConnections:
    @pytest.mark.parametrize("pool", ["default", "blocking"])
    def test_lock_traffic_never_starves_renewals_scripts_or_waiters(
        self, make_client: Callable[..., LockClient], lock_server: LockServer, namespace: str, raw: Any, pool: str
    ) -> None:
        if pool == "blocking":
            # A client the user built (BlockingConnectionPool's make_connection has no cap).
            import redis

            from lockaspect.backends.redis import RedisBackend

            blocking = redis.BlockingConnectionPool.from_url(lock_server.url, max_connections=4, socket_timeout=2.0)
            backend = RedisBackend(redis.Redis(connection_pool=blocking), namespace=namespace)
            client = LockClient(backend, watchdog_lease=1.0, tick=0.02, delay_weight=0.5)
        else:
            client = make_client(watchdog_lease=1.0, tick=0.02, delay_weight=0.5, max_connections=4)
        errors: list[BaseException] = []
        lost: list[str] = []
        stop = threading.Event()

        def holder() -> None:
            # A watchdog lease held across many renewals, while the others contend.
            try:
                with client.lock("long", on_lost=lambda lease: lost.append(lease.key)):
                    stop.wait(60)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def worker(n: int) -> None:
            try:
                for i in range(30):
                    with client.lock(f"shared:{(n + i) % 3}", wait=30):
                        time.sleep(0.002)  # the critical section's work
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        hold = threading.Thread(target=holder)
        hold.start()
        wait_until(lambda: client.stats().held == 1, "the long lease")
        with ThreadPoolExecutor(max_workers=12) as pool_:
            futures = [pool_.submit(worker, n) for n in range(12)]
            wait_until(lambda: sum(f.done() for f in futures) >= 4, "some workers to finish")
            raw.script_flush()  # every script must be loaded again, mid-storm
            for future in futures:
                future.result(timeout=120)
        renewals = client.stats().renewals
        wait_until(lambda: client.stats().renewals >= renewals + 3, "renewals after the storm")
        stop.set()
        hold.join(30)
        assert errors == []
        assert lost == []
        assert client.stats().lost == 0
        if pool == "blocking":
            client.close()


class TestNoOrphanAfterAFailedAttempt:
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_an_attempt_that_times_out_against_a_stalled_server_leaves_no_lock(
        self, make_client: Callable[..., LockClient], fresh_server: LockServer, mode: str
    ) -> None:
        client = make_client(url=fresh_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        other = make_client(url=fresh_server.url)
        with client.lock("warm"):  # a connection made, the scripts loaded
            pass

        async def attempt_async() -> None:
            async with client.lock("warm"):
                pass
            fresh_server.pause()
            async with client.lock("stall"):
                raise AssertionError("the server is stopped: this attempt cannot succeed")

        fresh_server.pause()  # SIGSTOP: the attempt reaches the server's socket, not the server
        try:
            if mode == "sync":
                with pytest.raises(BackendError), client.lock("stall"):
                    raise AssertionError("unreachable")
            else:
                fresh_server.resume()
                with pytest.raises(BackendError):
                    asyncio.run(attempt_async())
        finally:
            fresh_server.resume()  # the attempt runs now, after its caller gave up
        # Its undo runs right behind it: the lock is free long before its 30 s lease ends.
        with other.lock("stall", wait=10):
            pass

    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_an_attempt_whose_bytes_are_delayed_in_the_network_leaves_no_lock(
        self, make_client: Callable[..., LockClient], lock_server: LockServer, mode: str
    ) -> None:
        with FaultProxy(("127.0.0.1", lock_server.port)) as proxy:
            client = make_client(url=proxy.url, socket_timeout=0.5)
            other = make_client()
            with client.lock("warm"):
                pass

            async def attempt_async() -> None:
                async with client.lock("warm"):
                    pass
                proxy.hold(UP)
                async with client.lock("delayed"):
                    raise AssertionError("unreachable")

            try:
                if mode == "sync":
                    # The attempt's bytes wait in the network (its connection only: a cleanup on
                    # a new connection would overtake it).
                    proxy.hold(UP)
                    with pytest.raises(BackendError), client.lock("delayed"):
                        raise AssertionError("unreachable")
                else:
                    with pytest.raises(BackendError):
                        asyncio.run(attempt_async())
            finally:
                proxy.release()  # the delayed attempt arrives now
            with other.lock("delayed", wait=10):
                pass


class TestTransientErrorsDuringAWait:
    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_a_server_restart_during_a_wait_is_waited_out(
        self, make_client: Callable[..., LockClient], fresh_server: LockServer, mode: str
    ) -> None:
        client = make_client(url=fresh_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        holder = make_client(url=fresh_server.url)
        outcome: list[Any] = []
        started = threading.Event()

        def wait_sync() -> None:
            started.set()
            try:
                with client.lock("restart", wait=30) as lease:
                    outcome.append(lease.fencing_token)
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome.append(exc)

        async def wait_async() -> None:
            started.set()
            try:
                async with client.lock("restart", wait=30) as lease:
                    outcome.append(lease.fencing_token)
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome.append(exc)

        block = holder.lock("restart", lease=60)
        block.__enter__()
        thread = threading.Thread(target=wait_sync if mode == "sync" else lambda: asyncio.run(wait_async()))
        thread.start()
        assert started.wait(30)
        fresh_raw = fresh_server.redis()
        try:
            wait_until(lambda: fresh_raw.llen(client.backend.queue_key("restart")) >= 1, "the waiter to queue")
        finally:
            fresh_raw.close()
        fresh_server.restart()  # the store goes away (and loses the lock: no persistence)
        thread.join(60)
        with pytest.raises(LockLost):
            block.__exit__(None, None, None)
        assert len(outcome) == 1
        assert isinstance(outcome[0], int), outcome

    def test_a_store_down_for_the_whole_wait_raises_backend_error(
        self, make_client: Callable[..., LockClient], fresh_server: LockServer
    ) -> None:
        client = make_client(url=fresh_server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
        fresh_server.pause()
        try:
            with pytest.raises(BackendError), client.lock("down", wait=1.0):
                raise AssertionError("unreachable")
        finally:
            fresh_server.resume()
