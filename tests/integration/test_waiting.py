"""Waiting for a busy lock, against real servers, for sync waiters (threads) and async waiters
(tasks on one event loop) alike: woken by the release message, coalesced per key and process,
``wait_strategy="poll"``, and the fallbacks when the server refuses pub/sub or the subscriber
connection is lost.

Each test runs on a server of its own (``fresh_server``), so the server's own counters are
this test's alone. Acquire attempts are counted on the server: ``acquire.lua`` runs ``PTTL``
exactly once per attempt and no other lockaspect script runs it, so ``cmdstat_pttl`` in
``INFO commandstats`` is the number of acquire attempts the server executed.

Holders take a fixed 30 s lease. A waiter that missed the release message would sleep until
that lease ends (the PTTL fallback), so a waiter that gets the lock well within it (the
:data:`LIVENESS` guard) can only have been woken by the message or by bounded polling.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import ConfigurationError, LockClient, LockNotAcquired, _policy, config, current_lease, distributed_lock
from lockaspect.testing import LockServer

#: Holders' fixed lease: nothing in these tests can end it, only a release can.
HOLD = 30.0

#: Deadlock guard for events the tests wait for. Shorter than HOLD on purpose: a waiter still
#: waiting after this long slept through a release (only the holder's lease end would wake it).
LIVENESS = 20.0

MODES = ["sync", "async"]


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` until it holds (a deadlock guard, not a timing assertion)."""
    deadline = time.monotonic() + LIVENESS
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


class Store:
    """The test's own server, seen through a plain redis-py client: counters and pub/sub state."""

    def __init__(self, server: LockServer) -> None:
        self.server = server
        self.redis = server.redis()

    def acquire_attempts(self) -> int:
        """Acquire-script executions so far (one ``PTTL`` each, see the module docstring)."""
        stats: dict[str, Any] = self.redis.info("commandstats")
        return int(stats.get("cmdstat_pttl", {}).get("calls", 0))

    def publishes(self) -> int:
        stats: dict[str, Any] = self.redis.info("commandstats")
        return int(stats.get("cmdstat_publish", {}).get("calls", 0))

    def pubsub_connections(self) -> int:
        """Connections in pub/sub mode (``CLIENT LIST TYPE pubsub``)."""
        return len(self.redis.client_list(_type="pubsub"))

    def wake_channels(self, client: LockClient, key: str) -> list[str]:
        """The wake-up channels for ``key`` that someone listens on (``PUBSUB CHANNELS``)."""
        found = self.redis.pubsub_channels(client.backend.wake_channel(key, "*"))
        return sorted(channel.decode() if isinstance(channel, bytes) else channel for channel in found)

    def queue(self, client: LockClient, key: str) -> list[str]:
        """The waiter ids queued for ``key``'s wake-ups, first in line first."""
        return [item.decode() for item in self.redis.lrange(client.backend.queue_key(key), 0, -1)]

    def refused(self, command: str) -> int:
        """How often the ACL refused ``command`` (``ACL LOG`` groups repeats in one entry's count)."""
        return sum(int(entry["count"]) for entry in self.redis.acl_log() if entry["object"] == command)

    def close(self) -> None:
        self.redis.close()


class Exclusion:
    """Records who is inside a locked section, to prove mutual exclusion and the order of entry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.entered: list[int] = []

    def enter(self, who: int) -> None:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.entered.append(who)

    def leave(self) -> None:
        with self._lock:
            self.inside -= 1


class Mode:
    """Runs waiters as threads (``sync``) or as tasks on one event loop in a thread of its own
    (``async``; one loop for the whole test, so its notifier lives across rounds)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        if name == "async":
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
            self._thread.start()

    def submit(
        self, client: LockClient, key: str, exclusion: Exclusion, who: int = 0, **options: Any
    ) -> concurrent.futures.Future[int]:
        """Start one waiter: lock ``key``, enter ``exclusion`` briefly, release; its fencing token."""
        if self.loop is not None:
            return asyncio.run_coroutine_threadsafe(self._task(client, key, exclusion, who, options), self.loop)
        future: concurrent.futures.Future[int] = concurrent.futures.Future()

        def run() -> None:
            try:
                with client.lock(key, **options) as lease:
                    exclusion.enter(who)
                    time.sleep(0.002)
                    exclusion.leave()
                future.set_result(lease.fencing_token)
            except BaseException as exc:  # noqa: BLE001 - handed to the test through the future
                future.set_exception(exc)

        threading.Thread(target=run, name=f"waiter-{who}", daemon=True).start()
        return future

    @staticmethod
    async def _task(client: LockClient, key: str, exclusion: Exclusion, who: int, options: dict[str, Any]) -> int:
        async with client.lock(key, **options) as lease:
            exclusion.enter(who)
            await asyncio.sleep(0.002)
            exclusion.leave()
        return lease.fencing_token

    def call(self, fn: Callable[[], Any]) -> Any:
        """Call ``fn`` here (sync) or await it on the loop (async, ``fn`` returns a coroutine)."""
        if self.loop is None:
            return fn()
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(LIVENESS)

    def notifier_running(self, client: LockClient) -> bool:
        """Whether release notifications are read: the client's reader thread runs, or the loop's
        notifier has its subscriber connection open (read in the loop's callbacks, no task)."""
        if self.loop is None:
            return any(thread.name == "lockaspect-notifier" for thread in client.threads())

        async def connected() -> bool:
            state = client._async.states.get(asyncio.get_running_loop())
            notifier = None if state is None else getattr(state.store, "_notifier", None)
            return notifier is not None and notifier._pubsub is not None

        return bool(asyncio.run_coroutine_threadsafe(connected(), self.loop).result(LIVENESS))

    def close(self) -> None:
        loop = self.loop
        if loop is None:
            return

        async def cancel_all() -> None:
            current = asyncio.current_task()
            tasks = [task for task in asyncio.all_tasks() if task is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await loop.shutdown_asyncgens()

        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(LIVENESS)
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(LIVENESS)
        loop.close()


def in_background(fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """Call ``fn`` on a thread of its own; its result or exception in a future."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test through the future
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def results(futures: list[concurrent.futures.Future[int]]) -> list[int]:
    """Every waiter's fencing token (re-raising a waiter's exception)."""
    return [future.result(LIVENESS) for future in futures]


@pytest.fixture(autouse=True)
def no_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """Subscribed waiters re-check a busy lock every NOTIFY_RECHECK even without a wake-up (in
    case a message is lost); these tests count attempts exactly, so that re-check is pushed
    beyond HOLD here, except in the test about it."""
    monkeypatch.setattr(_policy, "NOTIFY_RECHECK", 60.0)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> Iterator[Mode]:
    made = Mode(request.param)
    yield made
    made.close()


@pytest.fixture
def store(fresh_server: LockServer) -> Iterator[Store]:
    made = Store(fresh_server)
    yield made
    made.close()


@pytest.fixture
def clients(fresh_server: LockServer, mode: Mode, namespace: str) -> Iterator[Callable[..., LockClient]]:
    """Build clients on the test's server; closed after the test (on the loop, for async)."""
    made: list[LockClient] = []

    def make(url: str | None = None) -> LockClient:
        client = LockClient.from_url(url or fresh_server.url, namespace=namespace)
        made.append(client)
        return client

    yield make
    for client in made:
        if mode.loop is not None and mode.loop.is_running():
            mode.call(client.aclose)
        client.close()


@pytest.fixture
def nopubsub_url(store: Store) -> str:
    """A server user with every right except pub/sub (so also no PUBLISH inside scripts)."""
    store.redis.execute_command("ACL", "SETUSER", "nopubsub", "on", ">pw", "~*", "&*", "+@all", "-@pubsub")
    return f"redis://nopubsub:pw@127.0.0.1:{store.server.port}/0"


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


class TestWakeOnRelease:
    def test_waiter_is_woken_by_the_release_message(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """A queued waiter sleeping out a 30 s lease gets the lock on its third attempt, woken by the release."""
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        before = store.acquire_attempts()
        with holder.lock("order:1", lease=HOLD):
            future = mode.submit(waiter, "order:1", exclusion, wait=None, lease=HOLD)
            # holder's attempt + the waiter's first try + its retry once subscribed (which queues it)
            wait_until(lambda: store.acquire_attempts() - before >= 3, "the waiter's retry after subscribing")
            time.sleep(0.3)  # a chance to poll, which a subscribed waiter must not take
            assert store.acquire_attempts() - before == 3
            assert len(store.wake_channels(waiter, "order:1")) == 1
            assert len(store.queue(waiter, "order:1")) == 1
            assert not future.done()
        token = future.result(LIVENESS)
        assert token > 0
        assert exclusion.entered == [0]
        assert store.publishes() == 1, "the holder's release woke the waiter; the waiter's woke nobody"
        assert store.acquire_attempts() - before == 4, "one attempt after the wake-up, none in between"
        assert store.queue(waiter, "order:1") == []

    def test_waiter_subscribes_through_one_notifier(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """Waiting starts the client's one notifier (thread or loop task) on one subscriber connection."""
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        assert not mode.notifier_running(waiter)
        before = store.acquire_attempts()
        with holder.lock("k", lease=HOLD):
            future = mode.submit(waiter, "k", exclusion, wait=None, lease=HOLD)
            wait_until(lambda: store.acquire_attempts() - before >= 3, "the waiter's retry after subscribing")
            assert store.pubsub_connections() == 1
            assert mode.notifier_running(waiter)
        results([future])


class TestFifo:
    CLIENTS = 4

    def test_waiters_of_several_clients_get_the_lock_in_arrival_order(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """Four clients queue one after another; each release wakes the next in line, one attempt per handoff."""
        holder = clients()
        waiters = [clients() for _ in range(self.CLIENTS)]
        exclusion = Exclusion()
        futures = []
        with holder.lock("fifo", lease=HOLD):
            for who, waiter in enumerate(waiters):
                futures.append(mode.submit(waiter, "fifo", exclusion, who, wait=None, lease=HOLD))
                wait_until(lambda n=who + 1: len(store.queue(holder, "fifo")) == n, f"waiter {who} queued")
            assert len(store.wake_channels(holder, "fifo")) == self.CLIENTS
            released_at = store.acquire_attempts()
        tokens = results(futures)
        assert exclusion.entered == list(range(self.CLIENTS))
        assert exclusion.most_inside == 1
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == self.CLIENTS
        assert store.acquire_attempts() - released_at == self.CLIENTS, "one attempt per handoff"
        assert store.publishes() == self.CLIENTS, "every release but the last woke exactly one waiter"
        assert store.queue(holder, "fifo") == []

    def test_release_skips_a_queued_waiter_that_is_gone(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """A waiter id first in the queue with nobody listening (a dead process) is skipped on release."""
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        with holder.lock("gone", lease=HOLD):
            store.redis.rpush(holder.backend.queue_key("gone"), "0123456789abcdef")
            future = mode.submit(waiter, "gone", exclusion, wait=None, lease=HOLD)
            wait_until(lambda: len(store.queue(holder, "gone")) == 2, "the live waiter queued behind the dead one")
            released_at = store.acquire_attempts()
        assert results([future])[0] > 0
        assert store.acquire_attempts() - released_at == 1, "the live waiter was woken by that release"
        assert store.queue(holder, "gone") == []

    def test_waiter_that_gives_up_leaves_the_queue(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """A waiter whose wait runs out takes its id off the queue, so the next release wakes a live waiter."""
        holder, quitter, stayer = clients(), clients(), clients()
        exclusion = Exclusion()
        with holder.lock("quit", lease=HOLD):
            with pytest.raises(LockNotAcquired):
                results([mode.submit(quitter, "quit", exclusion, 0, wait=0.5, lease=HOLD)])
            assert store.queue(holder, "quit") == []
            future = mode.submit(stayer, "quit", exclusion, 1, wait=None, lease=HOLD)
            wait_until(lambda: len(store.queue(holder, "quit")) == 1, "the second waiter queued")
            released_at = store.acquire_attempts()
        assert results([future])[0] > 0
        assert exclusion.entered == [1]
        assert store.acquire_attempts() - released_at == 1

    def test_early_queued_waiter_whose_wait_ends_at_once_leaves_the_queue(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """A first attempt that queued at once (the process already listens for the key) but whose wait is
        over when it returns leaves the queue: the next release must not spend its wake-up on nobody."""
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        with holder.lock("brief", lease=HOLD):
            first = mode.submit(waiter, "brief", exclusion, 0, wait=None, lease=HOLD)
            wait_until(lambda: len(store.queue(holder, "brief")) == 1, "the first waiter queued")
        results([first])  # its subscription lingers: the process still listens for "brief"
        with holder.lock("brief", lease=HOLD):
            with pytest.raises(LockNotAcquired):
                results([mode.submit(waiter, "brief", exclusion, 1, wait=1e-6)])
            assert store.queue(holder, "brief") == []

    def test_lost_wake_up_is_made_up_by_the_recheck(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With its queue entry gone (so the release publishes nothing), a queued waiter still gets the
        lock by re-checking every NOTIFY_RECHECK, long before the 30 s lease it was told about."""
        monkeypatch.setattr(_policy, "NOTIFY_RECHECK", 0.2)
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        with holder.lock("recheck", lease=HOLD):
            future = mode.submit(waiter, "recheck", exclusion, wait=None, lease=HOLD)
            wait_until(lambda: len(store.queue(holder, "recheck")) == 1, "the waiter queued")
            store.redis.delete(holder.backend.queue_key("recheck"))
        assert results([future])[0] > 0
        assert store.publishes() == 0


class TestCoalescing:
    WAITERS = 10

    def test_same_process_waiters_take_turns_talking_to_the_store(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """10 waiters of one process on a busy key: one talks to the store, then all get it one at a time."""
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        before = store.acquire_attempts()
        with holder.lock("hot", lease=HOLD):
            futures = [mode.submit(waiter, "hot", exclusion, who, wait=None, lease=HOLD) for who in range(self.WAITERS)]
            # the holder's attempt, each waiter's first try, the first in line's retry once subscribed
            settled = 1 + self.WAITERS + 1
            wait_until(lambda: store.acquire_attempts() - before >= settled, "every waiter's first try")
            time.sleep(0.5)  # a chance to poll, which queued waiters must not take
            assert store.acquire_attempts() - before == settled
            assert len(store.wake_channels(waiter, "hot")) == 1
            assert len(store.queue(waiter, "hot")) == 1, "one place in line for the whole process"
            assert store.pubsub_connections() == 1
            assert not any(future.done() for future in futures)
        released_at = store.acquire_attempts()
        tokens = results(futures)
        assert sorted(exclusion.entered) == list(range(self.WAITERS))
        assert exclusion.most_inside == 1
        assert len(set(tokens)) == self.WAITERS
        # each handoff costs the next waiter its retry and, if that found the lock still held,
        # one more attempt when woken
        assert store.acquire_attempts() - released_at <= 2 * self.WAITERS
        assert 1 <= store.publishes() <= self.WAITERS


class TestPollStrategy:
    def test_poll_waits_without_subscribing_and_gets_the_lock(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """wait_strategy="poll" never subscribes, backs off (far fewer than 500 attempts in 0.5 s), then acquires."""
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        before = store.acquire_attempts()
        with holder.lock("poll", lease=HOLD):
            future = mode.submit(waiter, "poll", exclusion, wait=None, lease=HOLD, wait_strategy="poll")
            wait_until(lambda: store.acquire_attempts() - before >= 3, "the waiter polling")
            time.sleep(0.5)
            polled = store.acquire_attempts() - before - 1
            assert store.pubsub_connections() == 0
            assert store.redis.pubsub_channels() == []
            assert not mode.notifier_running(waiter)
            assert not future.done()
        assert results([future])[0] > 0
        assert 2 <= polled <= 50, f"{polled} attempts in about 0.5 s: not a jittered backoff"
        assert store.pubsub_connections() == 0


class TestPubSubRefused:
    def test_waiters_poll_when_the_user_may_not_subscribe(
        self,
        mode: Mode,
        clients: Callable[..., LockClient],
        store: Store,
        nopubsub_url: str,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Without pub/sub rights holders still release, waiters poll to the lock, and SUBSCRIBE is tried once."""
        caplog.set_level(logging.WARNING, logger="lockaspect")
        holder, waiter = clients(nopubsub_url), clients(nopubsub_url)
        exclusion = Exclusion()
        for round_ in range(2):
            before = store.acquire_attempts()
            with holder.lock("acl", lease=HOLD):
                future = mode.submit(waiter, "acl", exclusion, round_, wait=None, lease=HOLD)
                wait_until(lambda b=before: store.acquire_attempts() - b >= 3, "the waiter polling")
                assert store.refused("subscribe") == 1
            assert results([future])[0] > 0
        assert exclusion.entered == [0, 1]
        assert holder.stats().released == 2, "the release script's PUBLISH must not fail the release"
        assert waiter.stats().released == 2
        assert store.refused("subscribe") == 1, "the second wait must not ask for pub/sub again"
        assert store.pubsub_connections() == 0
        assert len(messages(caplog, "refuses pub/sub")) == 1
        assert not messages(caplog, "release of")


class TestLostNotification:
    def test_waiter_survives_a_killed_subscriber_connection(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Killing the subscriber connection mid-wait wakes the waiter, which subscribes again on a
        fresh connection and still gets the lock at the release, with one warning."""
        caplog.set_level(logging.WARNING, logger="lockaspect")
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        before = store.acquire_attempts()
        with holder.lock("lost", lease=HOLD):
            future = mode.submit(waiter, "lost", exclusion, wait=None, lease=HOLD)
            wait_until(lambda: store.acquire_attempts() - before >= 3, "the waiter's retry after subscribing")
            assert len(store.wake_channels(waiter, "lost")) == 1
            assert store.redis.client_kill_filter(_type="pubsub") == 1
            wait_until(lambda: messages(caplog, "notifications interrupted") != [], "the interruption warning")
            # the waiter was woken, tried again and listens again, on a new connection
            wait_until(lambda: len(store.redis.client_list(_type="pubsub")) == 1, "a new subscriber connection")
            wait_until(lambda: len(store.wake_channels(waiter, "lost")) == 1, "the waiter's subscription again")
            assert not future.done()
        assert results([future])[0] > 0
        assert len(messages(caplog, "notifications interrupted")) == 1

    def test_holder_that_never_releases_is_waited_out(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """With no release message at all (a crashed holder), a subscribed waiter sleeps out the PTTL, then locks."""
        waiter = clients()
        lock_key = waiter.backend.lock_key("dead")
        # What a holder that crashed leaves behind: its hold, expiring with its lease.
        store.redis.hset(lock_key, mapping={"0" * 32: 1, "fence": 1})
        exclusion = Exclusion()
        before = store.acquire_attempts()
        started = time.monotonic()
        store.redis.pexpire(lock_key, 500)
        assert results([mode.submit(waiter, "dead", exclusion, wait=None, lease=HOLD)])[0] > 0
        assert time.monotonic() - started >= 0.49  # the server keeps the lock until the lease ends
        assert exclusion.entered == [0]
        assert store.publishes() == 0, "nobody was queued behind the waiter"
        # first try, the retry once subscribed, the one after sleeping out the holder's lease
        # (and at most one more, should that sleep end a hair before the server's expiry)
        assert 3 <= store.acquire_attempts() - before <= 4

    def test_notifier_recovers_after_a_killed_connection(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store, caplog: pytest.LogCaptureFixture
    ) -> None:
        """After a killed subscriber connection, the next wait subscribes again and is woken by the release."""
        caplog.set_level(logging.WARNING, logger="lockaspect")
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        with holder.lock("again", lease=HOLD):
            first = mode.submit(waiter, "again", exclusion, 0, wait=None, lease=HOLD)
            wait_until(lambda: len(store.wake_channels(waiter, "again")) == 1, "the first subscription")
            store.redis.client_kill_filter(_type="pubsub")
            wait_until(lambda: messages(caplog, "notifications interrupted") != [], "the interruption warning")
            # the first waiter subscribes again, on a new connection
            wait_until(lambda: len(store.wake_channels(waiter, "again")) == 1, "the subscription again")
        results([first])
        before = store.acquire_attempts()
        with holder.lock("again", lease=HOLD):
            # The channel is still subscribed (idle channels stay for a while): the second
            # waiter's first attempt queues it at once, with no retry after subscribing.
            second = mode.submit(waiter, "again", exclusion, 1, wait=None, lease=HOLD)
            wait_until(lambda: store.acquire_attempts() - before >= 2, "the second waiter's first attempt")
            time.sleep(0.3)  # a chance to poll, which a subscribed waiter must not take
            assert store.acquire_attempts() - before == 2
            assert len(store.wake_channels(waiter, "again")) == 1
            assert store.pubsub_connections() == 1
        results([second])
        assert exclusion.entered == [0, 1]
        assert store.acquire_attempts() - before == 3, "the second waiter was woken by the release message"
        assert len(messages(caplog, "notifications interrupted")) == 1


class TestSubscribeFailed:
    def test_failed_subscribe_does_not_stick(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A SUBSCRIBE that could not be sent (no connection allowed) leaves polling for that wait only."""
        caplog.set_level(logging.WARNING, logger="lockaspect")
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        # Load the scripts from the holder, so the waiter's lock commands use only the one
        # connection opened here and its pool stays empty: its subscriber needs a new one.
        with holder.lock("warm"):
            pass
        results([mode.submit(waiter, "warm", exclusion, -1)])
        with holder.lock("full", lease=HOLD):
            store.redis.config_set("maxclients", 1)  # open connections stay, new ones are refused
            try:
                first = mode.submit(waiter, "full", exclusion, 0, wait=None, lease=HOLD)
                wait_until(lambda: messages(caplog, "cannot subscribe") != [], "the refused subscriber connection")
            finally:
                store.redis.config_set("maxclients", 10000)
        results([first])
        before = store.acquire_attempts()
        with holder.lock("full", lease=HOLD):
            second = mode.submit(waiter, "full", exclusion, 1, wait=None, lease=HOLD)
            wait_until(lambda: store.acquire_attempts() - before >= 3, "the second waiter's retry after subscribing")
            time.sleep(0.3)  # a chance to poll, which a subscribed waiter must not take
            assert store.acquire_attempts() - before == 3
            assert len(store.wake_channels(waiter, "full")) == 1
        results([second])
        assert exclusion.entered == [-1, 0, 1]
        assert store.acquire_attempts() - before == 4, "the second waiter was woken by the release message"
        assert len(messages(caplog, "cannot subscribe")) == 1


class TestWaitZero:
    def test_wait_zero_tries_once_and_never_subscribes(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """wait=0 on a held key makes one attempt, starts no notifier and raises LockNotAcquired with waited 0."""
        holder, waiter = clients(), clients()
        with holder.lock("busy", lease=HOLD):
            before = store.acquire_attempts()
            with pytest.raises(LockNotAcquired) as caught:
                results([mode.submit(waiter, "busy", Exclusion(), wait=0)])
            assert store.acquire_attempts() - before == 1
            assert store.pubsub_connections() == 0
            assert not mode.notifier_running(waiter)
        assert caught.value.waited == 0.0
        assert caught.value.holder_ttl is not None
        assert 0 < caught.value.holder_ttl <= HOLD

    def test_wait_zero_does_not_queue_behind_a_waiter(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """While a same-process waiter holds the key's turn, a wait=0 call still fails at once after one attempt."""
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        before = store.acquire_attempts()
        with holder.lock("queue", lease=HOLD):
            queued = mode.submit(waiter, "queue", exclusion, 0, wait=None, lease=HOLD)
            wait_until(lambda: store.acquire_attempts() - before >= 3, "the queued waiter's retry")
            with pytest.raises(LockNotAcquired):
                results([mode.submit(waiter, "queue", exclusion, 1, wait=0)])
            assert store.acquire_attempts() - before == 4
            assert not queued.done()
        results([queued])
        assert exclusion.entered == [0]


class TestNotAcquired:
    def test_timed_out_wait_reports_waited_and_holder_ttl(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """LockNotAcquired after wait=0.3 on a held key carries waited >= 0.3 and the holder's remaining lease."""
        holder, waiter = clients(), clients()
        with holder.lock("slow", lease=HOLD), pytest.raises(LockNotAcquired) as caught:
            results([mode.submit(waiter, "slow", Exclusion(), wait=0.3)])
        assert caught.value.waited >= 0.3
        assert caught.value.key == "slow"
        assert caught.value.holder_ttl is not None
        assert 0 < caught.value.holder_ttl <= HOLD
        assert waiter.stats().not_acquired == 1


class TestWaitStrategyOption:
    @pytest.mark.parametrize(("value", "error"), [("sometimes", ConfigurationError), (42, TypeError)])
    def test_decorator_rejects_bad_values_at_decoration(self, value: object, error: type[Exception]) -> None:
        """A bad wait_strategy fails when the decorator is applied, with the exact error type."""
        with pytest.raises(error, match="wait_strategy"):

            @distributed_lock("k", wait_strategy=value)
            def work() -> None: ...

    @pytest.mark.parametrize(
        ("value", "error"), [("sometimes", ConfigurationError), (42, TypeError), (None, TypeError)]
    )
    def test_client_lock_rejects_bad_values(
        self, lock_client: LockClient, value: object, error: type[Exception]
    ) -> None:
        """client.lock() rejects a bad wait_strategy before any I/O."""
        with pytest.raises(error, match="wait_strategy"):
            lock_client.lock("k", wait_strategy=value)

    @pytest.mark.parametrize("value", ["notify", "poll"])
    def test_client_lock_accepts_both_strategies(self, lock_client: LockClient, value: str) -> None:
        """client.lock() takes "notify" and "poll" and locks with either."""
        with lock_client.lock("k", wait=1.0, wait_strategy=value) as lease:
            assert lease.fencing_token > 0

    @pytest.mark.parametrize("source", ["mapping", "toml"])
    def test_policy_applies_the_poll_strategy(
        self, source: str, tmp_path: Path, clients: Callable[..., LockClient], store: Store, mode: Mode
    ) -> None:
        """A policy's wait_strategy="poll" (mapping or TOML) reaches the waiter: it polls and never subscribes."""
        policies: Any
        if source == "mapping":
            policies = {"reports": {"key": "report:<day>", "wait": "forever", "lease": HOLD, "wait_strategy": "poll"}}
        else:
            policies = tmp_path / "locks.toml"
            policies.write_text(
                '[locks."reports"]\nkey = "report:<day>"\nwait = "forever"\nlease = 30.0\nwait_strategy = "poll"\n'
            )
        config.configure(policies=policies)
        holder, waiter = clients(), clients()
        assert config.get_policy("reports") is not None

        if mode.loop is None:

            @distributed_lock(policy="reports", client=waiter)
            def report(day: str) -> str:
                return day

            call: Callable[[], Any] = functools.partial(report, "monday")
        else:

            @distributed_lock(policy="reports", client=waiter)
            async def areport(day: str) -> str:
                return day

            call = functools.partial(areport, "monday")

        before = store.acquire_attempts()
        with holder.lock("report:monday", lease=HOLD):
            done = in_background(lambda: mode.call(call))
            wait_until(lambda: store.acquire_attempts() - before >= 3, "the policy's waiter polling")
            assert store.pubsub_connections() == 0
            assert not mode.notifier_running(waiter)
        assert done.result(LIVENESS) == "monday"

    @pytest.mark.parametrize("source", ["mapping", "toml"])
    def test_policy_rejects_a_bad_strategy(self, source: str, tmp_path: Path) -> None:
        """A policy with a bad wait_strategy fails in configure() with ConfigurationError."""
        policies: Any
        if source == "mapping":
            policies = {"reports": {"wait_strategy": "sometimes"}}
        else:
            policies = tmp_path / "locks.toml"
            policies.write_text('[locks."reports"]\nwait_strategy = 42\n')
        with pytest.raises(ConfigurationError, match="wait_strategy"):
            config.configure(policies=policies)


# -- the fair lock ---------------------------------------------------------------------------


def fair_queue(store: Store, client: LockClient, key: str) -> list[str]:
    """The fair lock's queue of waiter ids, first in line first."""
    return [item.decode() for item in store.redis.lrange(client.backend.fair_queue_key(key), 0, -1)]


def queue_phantom(store: Store, client: LockClient, key: str, waiter: str, seen_ago: float) -> None:
    """Put a waiter nobody listens for at the end of ``key``'s fair queue, last seen ``seen_ago`` s ago."""
    queue = client.backend.fair_queue_key(key)
    seconds, micros = store.redis.time()
    store.redis.rpush(queue, waiter)
    store.redis.hset(queue + ":seen", waiter, seconds * 1000 + micros // 1000 - int(seen_ago * 1000))


FAIR_CHILD = """
import sys
import redis
from lockaspect import LockClient

url, namespace, key, who = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
with LockClient.from_url(url, namespace=namespace) as client:
    with client.fair_lock(key, wait=None, lease=30):
        redis.Redis.from_url(url).rpush(namespace + "entered", who)
"""


class TestFairLock:
    WAITERS = 4

    def test_waiters_get_the_lock_in_arrival_order_no_attempt_per_handoff(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """Waiters of two clients, interleaved, each with a place of its own: served in arrival order."""
        holder, first, second = clients(), clients(), clients()
        exclusion = Exclusion()
        futures = []
        before = store.acquire_attempts()
        with holder.fair_lock("desk", lease=HOLD):
            for who in range(self.WAITERS):
                waiter = first if who % 2 == 0 else second
                futures.append(mode.submit(waiter, "desk", exclusion, who, wait=None, lease=HOLD, fair=True))
                wait_until(lambda n=who + 1: len(fair_queue(store, holder, "desk")) == n, f"waiter {who} queued")
            assert len(set(fair_queue(store, holder, "desk"))) == self.WAITERS, "one place per waiter"
            # the holder's attempt, then each waiter's first try (which queues it) and its retry once subscribed
            settled = 1 + 2 * self.WAITERS
            wait_until(lambda: store.acquire_attempts() - before >= settled, "every waiter subscribed")
            released_at = store.acquire_attempts()
            assert released_at - before == settled
        tokens = results(futures)
        assert exclusion.entered == list(range(self.WAITERS))
        assert exclusion.most_inside == 1
        assert tokens == sorted(tokens)
        # each release hands the lock to the next waiter itself (FAIR_HANDOFF): no attempt follows
        assert store.acquire_attempts() - released_at == 0, "no attempt per handoff"
        assert store.publishes() == self.WAITERS
        assert fair_queue(store, holder, "desk") == []
        assert store.redis.exists(holder.backend.fair_queue_key("desk") + ":seen") == 0
        assert store.redis.exists(holder.backend.fair_queue_key("desk") + ":grant") == 0

    def test_a_later_wait_reuses_the_waiter_id_and_its_channel_one_attempt_in_all(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """A fair wait that acquired gives its waiter id back to the client: the next wait for
        the key queues under it, finds its channel still subscribed, and makes one attempt
        (the queueing one) before the release hands it the lock."""
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        ids = []
        for round_ in range(2):
            before = store.acquire_attempts()
            with holder.fair_lock("again", lease=HOLD):
                future = mode.submit(waiter, "again", exclusion, round_, wait=None, lease=HOLD, fair=True)
                wait_until(lambda: len(fair_queue(store, holder, "again")) == 1, "the waiter queued")
                ids.append(fair_queue(store, holder, "again")[0])
                # the holder's attempt and the waiter's queueing one; a fresh id's channel is
                # subscribed first, then the waiter tries again (it may have missed a wake-up)
                settled = 2 if round_ else 3
                wait_until(lambda n=settled, b=before: store.acquire_attempts() - b >= n, "the waiter listens")
            assert results([future])[0] > 0
            assert store.acquire_attempts() - before == settled
        assert ids[0] == ids[1], "the second wait queued under the first one's id"
        assert exclusion.entered == [0, 1]

    def test_free_lock_goes_to_the_first_in_line_not_to_a_newcomer(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """While a live waiter is first in line, a fair newcomer cannot take the free lock; a non-fair one can."""
        client = clients()
        queue_phantom(store, client, "line", "n" + "1" * 16, seen_ago=0)
        with pytest.raises(LockNotAcquired) as caught:
            results([mode.submit(client, "line", Exclusion(), wait=0, fair=True)])
        assert caught.value.holder_ttl is not None, "how long the first in line may take"
        with pytest.raises(LockNotAcquired):
            results([mode.submit(client, "line", Exclusion(), wait=0.3, fair=True)])
        assert fair_queue(store, client, "line") == ["n" + "1" * 16], "the newcomer left the queue on giving up"
        assert results([mode.submit(client, "line", Exclusion(), wait=0)])[0] > 0, "a non-fair lock barges in"

    def test_wait_that_ends_during_the_first_attempt_leaves_the_queue(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """A fair waiter whose wait is over when its first (queueing) attempt returns takes its place back."""
        holder, waiter = clients(), clients()
        with holder.fair_lock("brief", lease=HOLD):
            with pytest.raises(LockNotAcquired):
                results([mode.submit(waiter, "brief", Exclusion(), wait=1e-6, fair=True)])
            assert fair_queue(store, holder, "brief") == []
            assert store.redis.hlen(holder.backend.fair_queue_key("brief") + ":seen") == 0
            assert store.redis.hlen(holder.backend.fair_queue_key("brief") + ":grant") == 0

    def test_gone_waiter_first_in_line_is_dropped(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """A queued waiter not seen for FAIR_GONE_AFTER no longer blocks the free lock."""
        client = clients()
        queue_phantom(store, client, "stale", "n" + "2" * 16, seen_ago=_policy.FAIR_GONE_AFTER + 1)
        assert results([mode.submit(client, "stale", Exclusion(), wait=0, fair=True)])[0] > 0
        assert fair_queue(store, client, "stale") == []

    def test_release_skips_a_first_in_line_nobody_listens_to(
        self, mode: Mode, clients: Callable[..., LockClient], store: Store
    ) -> None:
        """Past its subscribe grace, a waiter with no listener is skipped by the release: the next is woken at once."""
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        before = store.acquire_attempts()
        with holder.fair_lock("skip", lease=HOLD):
            queue_phantom(store, holder, "skip", "n" + "3" * 16, seen_ago=_policy.FAIR_SUBSCRIBE_GRACE + 1)
            future = mode.submit(waiter, "skip", exclusion, wait=None, lease=HOLD, fair=True)
            wait_until(lambda: len(fair_queue(store, holder, "skip")) == 2, "the live waiter queued")
            wait_until(lambda: store.acquire_attempts() - before >= 3, "the live waiter's retry once subscribed")
            released_at = store.acquire_attempts()
        assert results([future])[0] > 0
        assert store.acquire_attempts() - released_at == 0, "handed over by the release"
        assert fair_queue(store, holder, "skip") == []

    def test_polling_waiter_keeps_its_place(self, mode: Mode, clients: Callable[..., LockClient], store: Store) -> None:
        """wait_strategy="poll" on a fair lock: not skipped for having no listener, still served in order."""
        holder, poller, notified = clients(), clients(), clients()
        exclusion = Exclusion()
        with holder.fair_lock("polls", lease=HOLD):
            first = mode.submit(poller, "polls", exclusion, 0, wait=None, lease=HOLD, fair=True, wait_strategy="poll")
            wait_until(lambda: len(fair_queue(store, holder, "polls")) == 1, "the poller queued")
            assert fair_queue(store, holder, "polls")[0].startswith("p")
            second = mode.submit(notified, "polls", exclusion, 1, wait=None, lease=HOLD, fair=True)
            wait_until(lambda: len(fair_queue(store, holder, "polls")) == 2, "the notified waiter queued")
        results([first, second])
        assert exclusion.entered == [0, 1]

    def test_reentry_and_decorator(self, mode: Mode, clients: Callable[..., LockClient], store: Store) -> None:
        """A fair lock re-enters in one context, and @distributed_lock(fair=True) takes the same lock."""
        client = clients()
        if mode.loop is None:

            @distributed_lock("job:<n>", fair=True, client=client)
            def job(n: int) -> tuple[int, int]:
                with client.fair_lock(f"job:{n}") as inner:
                    return inner.fencing_token, inner._holds

            fence, holds = mode.call(lambda: job(7))
        else:

            @distributed_lock("job:<n>", fair=True, client=client)
            async def ajob(n: int) -> tuple[int, int]:
                async with client.fair_lock(f"job:{n}") as inner:
                    return inner.fencing_token, inner._holds

            fence, holds = mode.call(lambda: ajob(7))
        assert fence > 0
        assert holds == 2
        assert store.redis.exists(client.backend.lock_key("job:7")) == 0

    def test_waiters_of_several_processes_are_served_in_arrival_order(
        self, clients: Callable[..., LockClient], store: Store, namespace: str, mode: Mode
    ) -> None:
        """Three processes queue one after another behind a holder and enter in that order."""
        if mode.loop is not None:
            pytest.skip("processes: one run is enough")
        holder = clients()
        children = []
        try:
            with holder.fair_lock("procs", lease=HOLD):
                for who in range(3):
                    children.append(
                        subprocess.Popen(
                            [sys.executable, "-c", FAIR_CHILD, store.server.url, namespace, "procs", str(who)]
                        )
                    )
                    wait_until(lambda n=who + 1: len(fair_queue(store, holder, "procs")) == n, f"process {who} queued")
            for child in children:
                assert child.wait(LIVENESS) == 0
        finally:
            for child in children:
                child.kill()
        assert store.redis.lrange(namespace + "entered", 0, -1) == [b"0", b"1", b"2"]

    def test_killed_waiter_holds_up_the_queue_only_for_a_bounded_time(
        self,
        clients: Callable[..., LockClient],
        store: Store,
        namespace: str,
        mode: Mode,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A waiter SIGKILLed while first in line: the next waiter still gets the lock once the holder releases."""
        if mode.loop is not None:
            pytest.skip("processes: one run is enough")
        # The live waiter re-checks as in production, so it notices when the dead one is gone.
        monkeypatch.setattr(_policy, "NOTIFY_RECHECK", 1.0)
        holder, waiter = clients(), clients()
        exclusion = Exclusion()
        with holder.fair_lock("killed", lease=HOLD):
            child = subprocess.Popen([sys.executable, "-c", FAIR_CHILD, store.server.url, namespace, "killed", "0"])
            try:
                wait_until(lambda: len(fair_queue(store, holder, "killed")) == 1, "the child queued")
            finally:
                child.send_signal(signal.SIGKILL)
                child.wait(LIVENESS)
            future = mode.submit(waiter, "killed", exclusion, 1, wait=None, lease=HOLD, fair=True)
            wait_until(lambda: len(fair_queue(store, holder, "killed")) == 2, "the live waiter queued")
        # FAIR_GONE_AFTER (5 s) bounds the delay: well inside LIVENESS
        assert results([future])[0] > 0
        assert exclusion.entered == [1]
        assert store.redis.lrange(namespace + "entered", 0, -1) == []
        assert fair_queue(store, holder, "killed") == []


class TestFairOption:
    @pytest.mark.parametrize("value", ["yes", 1, None])
    def test_decorator_rejects_a_non_bool_fair_at_decoration(self, value: object) -> None:
        with pytest.raises(TypeError, match="fair"):

            @distributed_lock("k", fair=value)
            def work() -> None: ...

    def test_client_lock_rejects_a_non_bool_fair(self, lock_client: LockClient) -> None:
        with pytest.raises(TypeError, match="fair"):
            lock_client.lock("k", fair="yes")  # type: ignore[arg-type]

    def test_policy_rejects_a_non_bool_fair(self) -> None:
        with pytest.raises(ConfigurationError, match="fair"):
            config.configure(policies={"desk": {"fair": "always"}})

    def test_policy_makes_the_lock_fair(self, lock_client: LockClient) -> None:
        config.configure(policies={"desk": {"key": "desk", "fair": True, "wait": 1.0}})

        @distributed_lock(policy="desk", client=lock_client)
        def serve() -> bool:
            lease = current_lease()
            return lease is not None and lease.fair

        assert serve() is True
