"""The ZooKeeper store's session: one kazoo client (one ZooKeeper session) per store and its
asyncio twins, what this process has in the tree (:class:`Book`), and what the session's
state means for the locks held in it.

**The lease estimate.** A hold lives as long as the session. The server ends a session it has
not heard from for the negotiated session timeout ``T``. The client cannot see the server's
clock, so it keeps a conservative estimate: the session is alive until ``last contact + T``,
where the last contact is when the latest request that the server answered was *sent*
(kazoo's heartbeats answer at least every ``2T/3`` while connected, so a connection that goes
quiet is noticed, SUSPENDED, at most ``2T/3`` after the last answer). On SUSPENDED the store
starts a timer to ``max(last answered request, suspension - 2T/3) + T`` (never later than
Curator's ``suspension + T``), less a margin; if the session has not reconnected by then,
every hold of the session is declared lost (``"expired"``): the flag, ``on_lost``,
``LockLost``, the async body cancelled. Its nodes are deleted if the session turns out alive
after all. A reconnection on the same session in time re-reads the session's held nodes before
the watchdog trusts them again. LOST (the server expired the session) loses every hold at once
(``"session-lost"``). A held node deleted by someone else (an operator's force release) loses
that hold at once (``"not-owner"``), through a watch set on it when it was acquired.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.retry import KazooRetry

from ...errors import BackendError
from ..base import LossCallback
from ._book import Book, Node
from ._calls import ANSWERS, Batch, Call, batch_error, connection_trouble, container_request
from ._layout import parse
from ._notify import Hub
from ._options import Settings
from ._state import SessionState

__all__ = ["Book", "Node", "Session"]  # Book and Node: from ._book

log = logging.getLogger("lockaspect.zookeeper")

#: Known parent paths remembered (a create under a forgotten one costs one extra request).
PARENTS_KEPT = 4096


class Session(SessionState):
    """The kazoo client of a store and its twins, started on first use (no I/O before)."""

    def __init__(self, settings: Settings, root: str) -> None:
        self.settings = settings
        self.root = root
        self.lock = threading.Lock()
        self.book = Book()
        self.hub = Hub()
        self.epoch = 0
        self.timeout = settings.session_timeout
        self.session_id: int | None = None
        self.connected = False
        self.verified = True
        self.last_contact = 0.0
        self.on_loss: LossCallback | None = None
        self._client: KazooClient | None = None
        self._start_lock = threading.Lock()
        self._suspension = 0
        self._timer: threading.Timer | None = None
        self._closing = False
        self._parents: dict[str, None] = {}
        self._redelete: set[str] = set()
        self._doubts: set[tuple[str, str]] = set()
        self._pid = os.getpid()
        # Set while the session can take requests: kazoo fails every request at once between
        # an expired session and its new one, so a batch waits (request_timeout) for that.
        self._live = threading.Event()
        self._watcher: threading.Thread | None = None
        self._watcher_wake = threading.Event()

    # -- the client -----------------------------------------------------------------------

    def client(self) -> KazooClient:
        """The started client (starting it blocks up to ``connect_timeout``)."""
        client = self._client
        if client is not None:
            return client
        with self._start_lock:
            if self._closing:
                raise BackendError(f"ZooKeeper {self.settings.shown}: the store is closed")
            if self._client is None:
                self._client = self._start()
            return self._client

    def _start(self) -> KazooClient:
        settings = self.settings
        retry = KazooRetry(max_tries=-1, delay=0.05, backoff=2, max_delay=1.0, max_jitter=0.1)
        client = KazooClient(
            hosts=settings.hosts,
            timeout=settings.session_timeout,
            connection_retry=retry,
            auth_data=[settings.auth] if settings.auth else None,
        )
        client.add_listener(self._on_state)
        self._learn_granted_timeout(client)
        try:
            client.start(timeout=settings.connect_timeout)
        except Exception as exc:
            _stop(client)
            raise BackendError(
                f"ZooKeeper {settings.shown}: no connection within {settings.connect_timeout:g}s ({exc}); "
                "is the ensemble up and the URL right?",
                transient=True,
            ) from exc
        with self.lock:
            self.session_id = client.client_id[0] if client.client_id else None
            self.connected = True
            self._live.set()
            self.last_contact = time.monotonic()
        try:
            client.ensure_path(self.settings.chroot + self.root if self.settings.chroot else self.root)
        except Exception as exc:
            _stop(client)
            raise batch_error(exc, None, settings.shown) from exc
        return client

    def _learn_granted_timeout(self, client: KazooClient) -> None:
        """Record the session timeout the server grants (it clamps the one asked for to its
        bounds). kazoo keeps only the one asked for; its connection's ``_connect`` returns the
        read timeout, two thirds of the granted one, so that method is wrapped, for this
        client only (the kazoo internals used are checked by tests/unit)."""
        connection = client._connection
        connect = connection._connect

        def connected(*args: Any) -> Any:
            read_timeout, connect_timeout = connect(*args)
            granted = read_timeout * 1.5 / 1000.0
            if abs(granted - self.timeout) > 1e-3:
                log.info(
                    "ZooKeeper %s granted a session timeout of %.3gs (asked for %.3gs): the lease estimate uses it",
                    self.settings.shown, granted, self.settings.session_timeout,
                )  # fmt: skip
                self.timeout = granted
            return read_timeout, connect_timeout

        connection._connect = connected

    def close(self) -> None:
        with self._start_lock:
            self._closing = True
            client, self._client = self._client, None
        timer = self._timer
        if timer is not None:
            timer.cancel()
        if client is not None and os.getpid() == self._pid:
            _stop(client)
        self._live.set()  # nobody waits for a closed session
        self._watcher_wake.set()
        self.hub.wake_all()

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's client and nodes are not ours."""
        self._start_lock = threading.Lock()
        self.lock = threading.Lock()
        self._client = None
        self._timer = None
        self._watcher = None
        self._watcher_wake = threading.Event()
        self._live = threading.Event()
        self.book = Book()
        self.hub = Hub()
        self._redelete.clear()
        self._doubts.clear()
        self._pid = os.getpid()
        self.epoch += 1

    def threads(self) -> list[threading.Thread]:
        """kazoo's threads for this session: its connection loop and its callback worker."""
        client = self._client
        if client is None:
            return []
        found = list(getattr(client.handler, "_workers", ()))
        connection = getattr(getattr(client, "_connection", None), "_connection_routine", None)
        if connection is not None:
            found.append(connection)
        if self._watcher is not None:
            found.append(self._watcher)
        return [thread for thread in found if isinstance(thread, threading.Thread) and thread.is_alive()]

    # -- round trips ------------------------------------------------------------------------

    def send(self, calls: Sequence[Call]) -> Batch:
        """Send ``calls`` (pipelined), returning the batch in flight."""
        client = self.client()
        epoch = self.epoch
        sent = time.monotonic()
        results: list[Any] = []
        try:
            for call in calls:
                results.append(self._submit(client, call))
        except BaseException:
            self.abandon(Batch(calls, results, sent))
            raise
        return Batch(calls, results, sent, epoch)

    def _submit(self, client: KazooClient, call: Call) -> Any:
        op, path = call.op, self.settings.chroot + call.path
        paths = getattr(call.watch, "paths", None)
        if paths is not None:
            paths.add(path)  # a waiter's watch: taken off kazoo's sets when the waiter goes
        if op == "create":
            return client.create_async(path, call.data, ephemeral=True, sequence=True, include_data=True)
        if op == "children":
            return client.get_children_async(path, watch=call.watch)
        if op == "exists":
            return client.exists_async(path, watch=call.watch)
        if op == "delete":
            return client.delete_async(path)
        if op == "get":
            return client.get_async(path, watch=call.watch)
        if op == "set":
            return client.set_async(path, call.data, call.version)
        if op == "persistent":
            return client.create_async(path, call.data)
        if op == "deletes":
            transaction = client.transaction()
            for each in call.paths:
                transaction.delete(self.settings.chroot + each)
            return transaction.commit_async()
        assert op == "container"
        result = client.handler.async_result()
        client._call(container_request(path, call.data), result)
        return result

    def run(self, calls: Sequence[Call], key: str | None = None) -> list[Any]:
        """Send ``calls`` and wait (this thread) for every answer."""
        if not self._live.is_set() or self._expired():
            self._ready()
        batch = self.send(calls)
        try:
            outcomes = batch.answers(batch.outcomes(self.settings.request_timeout))
        except BaseException as exc:
            self.abandon(batch)
            if isinstance(exc, Exception):
                raise batch_error(exc, key, self.settings.shown) from exc
            raise
        self.contact(batch.sent)
        return outcomes

    async def arun(self, calls: Sequence[Call], key: str | None = None) -> list[Any]:
        """:meth:`run` for a task: the loop is not blocked while the answers come."""
        if self._client is None or not self._live.is_set() or self._expired():
            await asyncio.to_thread(self._ready)
        batch = self.send(calls)
        loop = asyncio.get_running_loop()
        done = batch.when_done(loop)
        timer = loop.call_later(self.settings.request_timeout, _time_out, done)
        try:
            await done
            outcomes = batch.answers(batch.collected())
        except BaseException as exc:
            self.abandon(batch)
            if isinstance(exc, Exception) and not isinstance(exc, asyncio.CancelledError):
                raise batch_error(exc, key, self.settings.shown) from exc
            raise
        finally:
            timer.cancel()
        self.contact(batch.sent)
        return outcomes

    def _expired(self) -> bool:
        """kazoo is between an expired session and its new one (it says so before it tells its
        listeners, so this is checked here too): requests would fail at once."""
        client = self._client
        return client is not None and client.state == KazooState.LOST and not self._closing

    def _ready(self) -> None:
        """Start the client if need be, and wait (up to ``request_timeout``) for a session."""
        self.client()
        deadline = time.monotonic() + self.settings.request_timeout
        while not self._closing:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if not self._live.is_set():
                self._live.wait(left)
            elif self._expired():
                time.sleep(min(left, 0.01))  # our LOST listener has not run yet: a moment
            else:
                return

    def contact(self, sent: float) -> None:
        if sent > self.last_contact:
            self.last_contact = sent

    def abandon(self, batch: Batch) -> None:
        """A batch failed or was given up: every contender node it creates, or may have
        created, is deleted (now if answered, else when its answer comes or, if lost, once
        its uuid is found after the reconnection)."""
        for call, result in zip(batch.calls, batch.results, strict=False):
            if call.op == "create":
                result.rawlink(lambda r, c=call: self._created_for_nobody(c, r))

    def _created_for_nobody(self, call: Call, result: Any) -> None:
        try:
            path = result.get_nowait()
        except Exception as exc:  # noqa: BLE001 - kazoo's answer, whatever it is, is sorted here
            if connection_trouble(exc):
                contender = parse(call.path.rsplit("/", 1)[1] + "0")
                if contender is not None:
                    with self.lock:
                        self._doubts.add((call.path.rsplit("/", 1)[0], contender.uuid))
            return
        created = path[0] if isinstance(path, tuple) else path
        chroot = self.settings.chroot
        self.delete_later(created[len(chroot) :] if chroot and created.startswith(chroot) else created)

    def delete_later(self, path: str) -> None:
        """Delete ``path`` until it is gone (Curator's guaranteed delete): now, and again after
        each reconnection while the connection fails."""
        client = self._client
        if client is None:
            return
        try:
            result = client.delete_async(self.settings.chroot + path)
        except Exception:  # noqa: BLE001 - a closed or failing client: retried after reconnecting
            with self.lock:
                self._redelete.add(path)
            return

        def done(r: Any) -> None:
            try:
                r.get_nowait()
            except NoNodeError:
                pass
            except Exception as exc:  # noqa: BLE001 - logged below when not a connection failure
                if connection_trouble(exc):
                    with self.lock:
                        self._redelete.add(path)
                else:
                    log.warning("could not delete %s: %r", path, exc)

        result.rawlink(done)

    def forget(self, channel: tuple[str, str]) -> None:
        """A waiter's queue place is gone: forget its wake-ups, and take its watch function off
        kazoo's watcher sets (kazoo keeps each until its node changes: a long-held lock would
        otherwise collect one per waiter that gave up)."""
        watch = self.hub.forget(channel)
        client = self._client
        if watch is None or client is None:
            return
        for path in getattr(watch, "paths", ()):
            for watchers in (client._data_watchers, client._child_watchers):
                found = watchers.get(path)
                if found is not None:
                    found.discard(watch)

    def ensure_parent(self, parent: str) -> bool:
        """Whether ``parent`` is known to exist (else a create must make it first)."""
        return parent in self._parents

    def parent_made(self, parent: str) -> None:
        parents = self._parents
        parents[parent] = None
        if len(parents) > PARENTS_KEPT:
            parents.pop(next(iter(parents)))

    def parent_gone(self, parent: str) -> None:
        self._parents.pop(parent, None)


def _time_out(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_exception(TimeoutError("no reply in time"))


def _stop(client: KazooClient) -> None:
    try:
        client.stop()
        client.close()
    except Exception:  # pragma: no cover - best effort at shutdown
        log.debug("stopping the kazoo client failed", exc_info=True)


__all__ += ["ANSWERS", "NoNodeError", "NodeExistsError"]
