"""Release notifications: :class:`RedisNotifier` (one subscriber connection and reader thread
per client) and :class:`AsyncRedisNotifier` (one per event loop) fan the wake-up messages the
release scripts publish out to local waiters. Which channels are wanted, sent and confirmed
is kept by the pure :class:`~._channels.ChannelTable` both share."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from typing import Any

import redis
from redis.exceptions import AskError, RedisError, ResponseError

from ..._wakeup import Wakeup
from ._channels import ChannelTable
from ._subscriber import Subscriber

__all__ = ["UNAVAILABLE_FOR", "AsyncRedisNotifier", "RedisNotifier"]

log = logging.getLogger("lockaspect.backend")

#: After the server refuses pub/sub (an ACL without ``+@pubsub``, a proxy without it), stop
#: asking for this many seconds: waiters poll at once instead of timing out on SUBSCRIBE.
UNAVAILABLE_FOR = 60.0


class _SlotMoved(Exception):
    """The server dropped a sharded subscription by itself: the channel's slot moved."""


_SHARDED = frozenset({b"smessage", b"ssubscribe", b"sunsubscribe"})


def _kind(message: dict[str, Any]) -> tuple[bytes, bytes]:
    """A pub/sub message's type, with the sharded types named as the plain ones, and its
    channel."""
    kind = message["type"]
    kind = kind.encode() if isinstance(kind, str) else kind
    if kind in _SHARDED:
        kind = kind[1:]
    return kind, message["channel"]


def _granted(message: dict[str, Any]) -> int:
    """The fencing token of a fair release's hand-over (``granted:<fencing token>``, see
    release.lua), or 0 for a plain wake-up."""
    data = message.get("data")
    if isinstance(data, str):
        data = data.encode()
    if isinstance(data, bytes) and data.startswith(b"granted:") and data[8:].isdigit():
        return int(data[8:])
    return 0


class _Subscription:
    """A sync waiter's registration for release messages of one lock. (A :class:`Wakeup`,
    not a ``threading.Event``: a waiter interrupted by a signal handler's exception must not
    leave a lock behind that the reader thread then blocks on.)"""

    __slots__ = ("_event", "active", "channel", "granted")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self._event = Wakeup()
        self.active = False
        self.granted = 0  # see Capability.FAIR_HANDOFF

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def wake(self) -> None:
        self._event.set()


class RedisNotifier:
    """One subscriber connection and reader thread per client, fanning release messages
    out to local waiters (see :class:`~._channels.ChannelTable`).

    When the connection fails, every waiter is woken and every subscription turns
    inactive; when the server refuses pub/sub, subscriptions stay inactive for a while.
    Waiters then retry with bounded polling, so progress never depends on a message.
    """

    def __init__(self, client: redis.Redis, channel_for: Any, *, sharded: bool = False, on_moved: Any = None) -> None:
        self._redis: Any = client
        self._channel_for = channel_for
        # Sharded (Redis Cluster, one notifier per primary): SSUBSCRIBE, and ``on_moved()``
        # when the server says the channel's slot is served elsewhere now.
        self._sharded = sharded
        self._on_moved = on_moved
        #: This notifier's waiter id: queued in a lock's waiter list, woken on its own channel.
        self.waiter_id = os.urandom(8).hex()
        # Entered as ``with self._mutex`` (a C-level enter: an exception raised asynchronously
        # cannot leave it held); ``self._lock`` waits and notifies on it.
        self._mutex = threading.Lock()
        self._lock = threading.Condition(self._mutex)
        self._table = ChannelTable()
        self._pubsub: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unavailable_until = 0.0

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _Subscription:
        sub = _Subscription(self._channel_for(key, waiter or self.waiter_id).encode())
        now = time.monotonic()
        deadline = now + timeout
        with self._mutex:
            if self._closed or now < self._unavailable_until:
                return sub
            try:
                if self._table.join(sub, now):
                    try:
                        self._send("SUBSCRIBE", sub.channel)
                    except RedisError as exc:
                        log.warning("cannot subscribe to %r, waiting by polling: %s", sub.channel, exc)
                        # Nothing will answer that SUBSCRIBE: forget the subscriber connection's
                        # channels, as when the reader loses it, or this one waits for it forever.
                        self._forget_connection(sub)
                        return sub
                    except BaseException:
                        # Interrupted: whether SUBSCRIBE went out is unknown, so no reply can be
                        # counted on; start over on a fresh connection.
                        self._forget_connection(sub)
                        raise
                # Stop waiting when the reader gave up (it resets the table and clears _pubsub).
                while not self._table.subscribed(sub.channel) and not self._closed and self._pubsub is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._lock.wait(remaining):
                        break
            except BaseException:
                self._table.leave(sub, time.monotonic())  # the caller never gets it to leave
                raise
            sub.active = self._table.subscribed(sub.channel)
        return sub

    # Called with self._mutex held.
    def _forget_connection(self, sub: _Subscription) -> None:
        for other in self._table.reset():
            if other is not sub:
                other.wake()
        self._thread = None  # the reader of the old connection stops (see _read)
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                pubsub.close()
            except (RedisError, OSError):  # pragma: no cover - closing a broken connection
                pass

    def listening(self, key: str, waiter: str | None = None) -> bool:
        """Whether this notifier already listens for wake-ups of ``key`` (so a first attempt
        may queue at once: a wake-up that comes before its waiter registers is kept), for
        ``waiter`` (default: :attr:`waiter_id`)."""
        with self._mutex:
            return self._table.subscribed(self._channel_for(key, waiter or self.waiter_id).encode())

    def unsubscribe(self, subscription: Any) -> None:
        with self._mutex:
            self._table.leave(subscription, time.monotonic())

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            pubsub, self._pubsub = self._pubsub, None
            for waiter in self._table.reset():
                waiter.wake()
            self._lock.notify_all()
        if pubsub is not None:
            try:
                pubsub.close()
            except RedisError:  # pragma: no cover - closing a broken connection
                pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # Called with self._mutex held.
    def _send(self, command: str, name: bytes) -> None:
        if self._pubsub is None:
            self._pubsub = self._redis.pubsub(ignore_subscribe_messages=False)
        if command == "SUBSCRIBE":
            (self._pubsub.ssubscribe if self._sharded else self._pubsub.subscribe)(name)
        else:
            (self._pubsub.sunsubscribe if self._sharded else self._pubsub.unsubscribe)(name)
        if self._thread is None:
            thread = threading.Thread(target=self._read, name="lockaspect-notifier", daemon=True)
            thread.start()  # published once started: close() joins what it finds
            self._thread = thread

    def _read(self) -> None:
        me = threading.current_thread()
        while True:
            with self._mutex:
                if self._closed or self._thread is not me:
                    return  # closed, or the connection was replaced (see _forget_connection)
                pubsub = self._pubsub
                for name in self._table.idle(time.monotonic()):
                    try:
                        self._send("UNSUBSCRIBE", name)
                    except RedisError:
                        break
            if pubsub is None:
                return
            try:
                message = pubsub.get_message(timeout=1.0)
            except Exception as exc:  # noqa: BLE001 - any failure ends this reader
                # Also what redis-py raises when close() pulled the connection away.
                self._connection_lost(pubsub, exc)
                return
            if message is not None and not self._dispatch(message):
                self._connection_lost(pubsub, _SlotMoved(f"the server dropped {message['channel']!r}"))
                return

    def _dispatch(self, message: dict[str, Any]) -> bool:
        """Hand ``message`` to the waiters; ``False`` when the server dropped a sharded
        subscription by itself (its slot moved: the connection is given up)."""
        kind, name = _kind(message)
        with self._mutex:
            if kind == b"message":
                granted = _granted(message)
                for waiter in self._table.message(name, time.monotonic()):
                    if granted:
                        waiter.granted = granted
                    waiter.wake()
            elif kind == b"unsubscribe" and self._sharded and not self._table.expects(name, kind):
                return False
            elif kind in (b"subscribe", b"unsubscribe") and self._table.reply(kind, name):
                self._lock.notify_all()
        return True

    def _connection_lost(self, pubsub: Any, exc: BaseException) -> None:
        with self._mutex:
            if self._closed:
                return
            if self._pubsub is not pubsub:
                pass  # an older connection, already replaced: nothing to reset
            elif isinstance(exc, (AskError, _SlotMoved)):
                # Redis Cluster: a failover or a migration moved a channel's slot.
                log.info("release notifications of a moved slot, subscribing again: %s", exc)
                if self._on_moved is not None:
                    self._on_moved()
            elif isinstance(exc, ResponseError):
                # NOPERM (an ACL without pub/sub) or an unknown command behind a proxy.
                self._unavailable_until = time.monotonic() + UNAVAILABLE_FOR
                log.warning("the server refuses pub/sub, waiters poll instead for %gs: %s", UNAVAILABLE_FOR, exc)
            else:
                log.warning("release notifications interrupted, waiters fall back to polling: %s", exc)
            if self._pubsub is pubsub:
                for waiter in self._table.reset():
                    waiter.wake()
                self._pubsub = None
                if self._thread is threading.current_thread():
                    self._thread = None
                self._lock.notify_all()
        try:
            pubsub.close()
        except (RedisError, OSError):  # pragma: no cover
            pass


class _AsyncSubscription:
    """An async waiter's registration for release messages of one lock."""

    __slots__ = ("_future", "_woken", "active", "channel", "granted")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self._future: asyncio.Future[bool] | None = None
        self._woken = False
        self.active = False
        self.granted = 0  # see Capability.FAIR_HANDOFF

    async def wait(self, timeout: float) -> bool:
        # A future and a call_later, not asyncio.wait_for (a task per wait on Python 3.11).
        if self._woken:
            self._woken = False
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(timeout, _resolve, future, False)
        self._future = future
        try:
            return await future
        finally:
            timer.cancel()
            self._future = None
            self._woken = False

    def wake(self) -> None:
        future = self._future
        if future is None:
            self._woken = True
        else:
            _resolve(future, True)


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class AsyncRedisNotifier:
    """:class:`RedisNotifier` for one event loop: one subscriber connection per loop, read in
    the loop's own callbacks (:class:`~._subscriber.Subscriber`: a wake-up resolves its waiter's
    future in the iteration the message arrives in). SUBSCRIBE/UNSUBSCRIBE are written with no
    await, so they reach the server in the order the table recorded them; opening the
    connection, the one await, runs under an asyncio lock."""

    def __init__(self, client: Any, channel_for: Any, *, sharded: bool = False, on_moved: Any = None) -> None:
        self._redis = client
        self._channel_for = channel_for
        self._sharded = sharded
        self._on_moved = on_moved
        self.waiter_id = os.urandom(8).hex()
        self._table = ChannelTable()
        self._open_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._pubsub: Subscriber | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self._closed = False
        self._unavailable_until = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subscribe = b"SSUBSCRIBE" if sharded else b"SUBSCRIBE"
        self._unsubscribe = b"SUNSUBSCRIBE" if sharded else b"UNSUBSCRIBE"

    async def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> _AsyncSubscription:
        sub = _AsyncSubscription(self._channel_for(key, waiter or self.waiter_id).encode())
        now = time.monotonic()
        if self._closed or now < self._unavailable_until:
            return sub
        if self._pubsub is not None and not self._open_lock.locked():
            # Connected: join and send with no await (a waiter on a busy key takes this path
            # on every wait, and finds its channel confirmed: no suspension at all).
            self._join_now(sub, now)
            if self._table.subscribed(sub.channel):
                sub.active = True
                return sub
            joined = None
        else:
            # Opening the connection runs in a task of its own: a waiter cancelled meanwhile
            # stops waiting, but what was sent and what the table expects stay in step (else
            # the channel would stay "subscribing" for every later waiter on the key).
            joined = self._spawn(self._join(sub, now))
        try:
            if joined is not None:
                await asyncio.shield(joined)
            if not self._table.subscribed(sub.channel):
                try:
                    async with self._changed:
                        await asyncio.wait_for(
                            self._changed.wait_for(
                                lambda: self._table.subscribed(sub.channel) or self._closed or self._pubsub is None
                            ),
                            timeout,
                        )
                except asyncio.TimeoutError:
                    pass
        except BaseException:
            # The caller never gets the subscription to leave with: leave for it, once joined.
            if joined is None or joined.done():
                self._table.leave(sub, time.monotonic())
            else:
                joined.add_done_callback(lambda _: self._table.leave(sub, time.monotonic()))
            raise
        sub.active = self._table.subscribed(sub.channel)
        return sub

    def _join_now(self, sub: _AsyncSubscription, now: float) -> None:
        pubsub = self._pubsub
        if not self._table.join(sub, now) or pubsub is None:
            return
        try:
            pubsub.send(self._subscribe, sub.channel)
        except RedisError as exc:
            log.warning("cannot subscribe to %r, waiting by polling: %s", sub.channel, exc)
            self._drop(pubsub, sub)  # nothing will answer: as when the connection is lost

    async def _join(self, sub: _AsyncSubscription, now: float) -> None:
        async with self._open_lock:
            if self._pubsub is not None:
                self._join_now(sub, now)
                return
            if not self._table.join(sub, now):
                return
            try:
                pubsub = await Subscriber.open(self._redis.connection_pool, self._on_frame, self._lost)
            except RedisError as exc:
                log.warning("cannot subscribe to %r, waiting by polling: %s", sub.channel, exc)
                self._forget(sub)
                return
            except BaseException:
                # Cancelled (the loop shutting down): nothing was sent.
                self._forget(sub)
                raise
            if self._closed:
                await pubsub.close()
                return
            self._pubsub = pubsub
            self._ticker = asyncio.get_running_loop().call_later(1.0, self._tick)
            pubsub.send(self._subscribe, sub.channel)

    def _forget(self, sub: _AsyncSubscription | None) -> None:  # every channel; wakes all but sub
        for other in self._table.reset():
            if other is not sub:
                other.wake()
        self._spawn(self._notify_changed())

    def _drop(self, pubsub: Subscriber, sub: _AsyncSubscription | None = None) -> None:
        """Give the subscriber connection up: its channels are forgotten, its waiters poll."""
        if self._pubsub is pubsub:
            self._pubsub = None
            self._stop_ticker()
            self._forget(sub)
        self._spawn(pubsub.close())

    def _stop_ticker(self) -> None:
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()

    def _tick(self) -> None:
        """Every second while connected: unsubscribe from channels idle long enough."""
        pubsub = self._pubsub
        if pubsub is None or self._closed:
            self._ticker = None
            return
        for name in self._table.idle(time.monotonic()):
            try:
                pubsub.send(self._unsubscribe, name)
            except RedisError:
                break  # the connection is going: its loss resets the table
        self._ticker = asyncio.get_running_loop().call_later(1.0, self._tick)

    def listening(self, key: str, waiter: str | None = None) -> bool:
        """See :meth:`RedisNotifier.listening`."""
        return self._table.subscribed(self._channel_for(key, waiter or self.waiter_id).encode())

    def unsubscribe(self, subscription: Any) -> None:
        self._table.leave(subscription, time.monotonic())

    async def aclose(self) -> None:
        self._closed = True
        for waiter in self._table.reset():
            waiter.wake()
        for task in list(self._tasks):
            task.cancel()
        self._stop_ticker()
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.close()

    def _on_frame(self, pubsub: Subscriber, frame: Any) -> None:
        """A frame of the subscriber connection, in the loop iteration it arrived in (see
        :meth:`RedisNotifier._dispatch`)."""
        if pubsub is not self._pubsub:
            return
        if isinstance(frame, Exception):
            self._lost(pubsub, frame)  # an error reply (NOPERM, MOVED): the connection is given up
            return
        if not isinstance(frame, list) or len(frame) < 3:
            return
        kind, name = _kind({"type": frame[0], "channel": frame[1]})
        if kind == b"message":
            granted = _granted({"data": frame[2]})
            for waiter in self._table.message(name, time.monotonic()):
                if granted:
                    waiter.granted = granted
                waiter.wake()
        elif kind == b"unsubscribe" and self._sharded and not self._table.expects(name, kind):
            self._lost(pubsub, _SlotMoved(f"the server dropped {name!r}"))
        elif kind in (b"subscribe", b"unsubscribe") and self._table.reply(kind, name):
            self._spawn(self._notify_changed())

    async def _notify_changed(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _lost(self, pubsub: Subscriber, exc: BaseException) -> None:
        if self._pubsub is pubsub and not self._closed:
            if isinstance(exc, (AskError, _SlotMoved)):
                log.info("release notifications of a moved slot, subscribing again: %s", exc)
                if self._on_moved is not None:
                    self._on_moved()
            elif isinstance(exc, ResponseError):
                self._unavailable_until = time.monotonic() + UNAVAILABLE_FOR
                log.warning("the server refuses pub/sub, waiters poll instead for %gs: %s", UNAVAILABLE_FOR, exc)
            else:
                log.warning("release notifications interrupted, waiters fall back to polling: %s", exc)
        self._drop(pubsub)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
