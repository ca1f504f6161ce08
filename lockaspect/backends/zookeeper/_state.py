"""The ZooKeeper store's session state (:class:`SessionState`, a part of ``Session``): what
SUSPENDED, LOST and a reconnection mean for the locks held in the session, the re-read after a
reconnection, the watches on held nodes, and how losses reach the engine. The lease estimate
is described in :mod:`._session`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient, KazooState

from ...errors import BackendError
from ..base import LossCallback
from ._book import Book, Node
from ._calls import Batch, Call
from ._notify import Hub
from ._options import Settings

__all__ = ["RETRY_PAUSE", "WATCH_AFTER", "SessionState"]

log = logging.getLogger("lockaspect.zookeeper")

#: Seconds between re-reads of the held nodes after a reconnection, while they fail.
RETRY_PAUSE = 0.2
#: A hold's node gets its watch (deleted by anyone else: the hold is lost) once it was held
#: this long: a short hold costs no request for it.
WATCH_AFTER = 0.5


class SessionState:
    """What the session's state means for its locks (mixed into ``Session``)."""

    settings: Settings
    lock: threading.Lock
    book: Book
    hub: Hub
    epoch: int
    timeout: float
    session_id: int | None
    connected: bool
    verified: bool
    last_contact: float
    on_loss: LossCallback | None
    _client: KazooClient | None
    _start_lock: threading.Lock
    _suspension: int
    _timer: threading.Timer | None
    _closing: bool
    _redelete: set[str]
    _doubts: set[tuple[str, str]]
    _live: threading.Event
    _watcher: threading.Thread | None
    _watcher_wake: threading.Event

    if TYPE_CHECKING:

        def run(self, calls: Sequence[Call], key: str | None = None) -> list[Any]: ...

        def send(self, calls: Sequence[Call]) -> Batch: ...

        def delete_later(self, path: str) -> None: ...

    def usable(self, node: Node) -> bool:
        """Whether ``node`` is a hold of the live session that can be trusted now."""
        return node.epoch == self.epoch and self.connected and self.verified

    def _on_state(self, state: str) -> None:
        """kazoo's listener, on its connection thread: never blocks."""
        if self._closing:
            return
        if state == KazooState.SUSPENDED:
            self._suspended()
        elif state == KazooState.LOST:
            self._live.clear()
            self.declare_lost("session-lost", alive=False)
        else:
            self._reconnected()

    def _suspended(self) -> None:
        now = time.monotonic()
        with self.lock:
            self.connected = False
            self._suspension += 1
            serial = self._suspension
            timeout = self.timeout
            end = max(self.last_contact, now - 2.0 * timeout / 3.0) + timeout - min(0.5, timeout / 10.0)
            timer = threading.Timer(max(0.0, end - now), self._suspension_over, (serial,))
            timer.daemon = True
            timer.name = "lockaspect-zookeeper-suspended"
            old, self._timer = self._timer, timer
            held = len(self.book.holds)
        if old is not None:
            old.cancel()
        log.log(
            logging.WARNING if held else logging.INFO,
            "ZooKeeper %s: connection suspended; %d lock(s) held are lost in %.2fs unless it returns",
            self.settings.shown, held, end - now,
        )  # fmt: skip
        timer.start()

    def _suspension_over(self, serial: int) -> None:
        with self.lock:
            if self.connected or serial != self._suspension or self._closing:
                return
        self.declare_lost("expired", alive=True)

    def _reconnected(self) -> None:
        client = self._client
        new_id = client.client_id[0] if client is not None and client.client_id else None
        with self.lock:
            timer, self._timer = self._timer, None
            same = new_id == self.session_id or self.session_id is None  # None: the first connection
            self.session_id = new_id
            self._suspension += 1
            serial = self._suspension
            self.connected = True
            lost = [] if same else self._forget_all(alive=False)  # before any request of the new session
            self._live.set()
            verify = same and bool(self.book.holds)
            for node in self.book.holds.values():
                node.watched = False  # its watch died with the connection
            if verify:
                self.verified = False
        if timer is not None:
            timer.cancel()
        if lost:
            self._announce(lost, "session-lost")
        if client is not None:
            client.handler.spawn(self._after_reconnect, verify, serial)
        self.hub.wake_all()

    def _after_reconnect(self, verify: bool, serial: int) -> None:
        """On a worker thread: finish deletes the outage held up, find doubtful creates, and
        re-read the held nodes before trusting them."""
        with self.lock:
            redelete, self._redelete = self._redelete, set()
            doubts, self._doubts = self._doubts, set()
            held = [node for node in self.book.holds.values() if node.epoch == self.epoch]
            epoch = self.epoch
        for path in redelete:
            self.delete_later(path)
        for parent, uuid in doubts:
            try:
                (children,) = self.run([Call("children", parent)])
            except BackendError:
                with self.lock:
                    self._doubts.add((parent, uuid))
                continue
            if not isinstance(children, Exception):
                for name in children:
                    if f"_c_{uuid}-" in name:
                        self.delete_later(f"{parent}/{name}")
        if not verify:
            return
        while True:
            try:
                # kazoo does not set watches again after a reconnection: each held node's is
                # set again here, with the re-read.
                calls = [Call("exists", node.path, watch=self.held_watch(node)) for node in held]
                found = self.run(calls) if held else []
                break
            except BackendError:
                with self.lock:
                    if self._closing or self.epoch != epoch or serial != self._suspension:
                        return  # lost meanwhile, or a later reconnection re-reads
                time.sleep(RETRY_PAUSE)
        for node in held:
            node.watched = True
        gone = [node for node, stat in zip(held, found, strict=True) if stat is None or isinstance(stat, Exception)]
        with self.lock:
            if self.epoch == epoch:
                self.verified = True
        self.lose_nodes(gone, "not-owner")

    def declare_lost(self, reason: str, *, alive: bool) -> None:
        """Every hold and queue place of the session is lost (``alive``: the session may
        still live, so its nodes are deleted once it is reachable)."""
        with self.lock:
            tokens = self._forget_all(alive=alive)
        self._announce(tokens, reason)

    def _forget_all(self, *, alive: bool) -> list[str]:
        """Under the lock: forget every node of the session (a new epoch); the lost tokens."""
        nodes = self.book.nodes()
        tokens = [node.token for node in self.book.holds.values()]
        self.book.clear()
        self.epoch += 1
        self.verified = True
        if alive:
            self._redelete.update(node.path for node in nodes)
        else:
            self._redelete.clear()
            self._doubts.clear()
        return tokens

    def _announce(self, tokens: list[str], reason: str) -> None:
        if tokens:
            log.warning(
                "ZooKeeper %s: %d lock(s) lost (%s)", self.settings.shown, len(tokens),
                "the session's lease estimate ran out" if reason == "expired" else "the session expired",
            )  # fmt: skip
        self.hub.wake_all()
        self._report(tokens, reason)

    def lose_nodes(self, nodes: Collection[Node], reason: str) -> None:
        """These held nodes are gone (deleted by someone else): their holds are lost."""
        lost = []
        with self.lock:
            for node in nodes:
                if self.book.holds.get((node.key, node.token)) is node:
                    del self.book.holds[(node.key, node.token)]
                    self.book.paths.pop(node.path, None)
                    lost.append(node)
        if lost:
            log.warning("ZooKeeper %s: %d lock(s) lost (%s)", self.settings.shown, len(lost), reason)
        for node in lost:  # by key: the other keys of a multi-key set (one token) are still held
            self._report([node.token], reason, [node.key])

    def held(self) -> None:
        """A hold was booked: make sure the watcher thread runs (started with the first)."""
        if self._watcher is None and not self._closing:
            with self._start_lock:
                if self._watcher is None and not self._closing:
                    thread = threading.Thread(target=self._watch_loop, name="lockaspect-zookeeper-watcher", daemon=True)
                    thread.start()
                    self._watcher = thread

    def _watch_loop(self) -> None:
        """Set the watch of every hold held :data:`WATCH_AFTER` seconds, twice a second."""
        while True:
            self._watcher_wake.wait(WATCH_AFTER / 2)
            if self._closing:
                return
            now = time.monotonic()
            with self.lock:
                due = [
                    node
                    for node in self.book.holds.values()
                    if not node.watched and node.epoch == self.epoch and now - node.held_since >= WATCH_AFTER
                ]
                trusted = self.connected and self.verified
                if trusted:
                    for node in due:
                        node.watched = True
            if due and trusted:
                self.watch_held(due)

    def watch_held(self, nodes: Sequence[Node]) -> None:
        """Watch held nodes (at their first renewal: a short hold costs no request for it):
        a node deleted by anyone but us loses its hold at once, and one already gone now."""
        try:
            batch = self.send([Call("exists", node.path, watch=self.held_watch(node)) for node in nodes])
        except BackendError:
            for node in nodes:
                node.watched = False
            return
        for node, result in zip(nodes, batch.results, strict=True):
            result.rawlink(lambda r, n=node: self._watched(n, r))

    def _watched(self, node: Node, result: Any) -> None:
        try:
            stat = result.get_nowait()
        except Exception:  # noqa: BLE001 - a failed watch is set again at the next renewal
            node.watched = False
            return
        if stat is None:
            self.lose_nodes([node], "not-owner")

    def held_watch(self, node: Node) -> Callable[[Any], None]:
        """The watch set on a held node: its deletion by anyone but us loses the hold."""

        def fired(event: Any) -> None:
            if event.type == "NONE":  # kazoo dropped the watch with the connection
                node.watched = False
            elif event.type == "DELETED":
                self.lose_nodes([node], "not-owner")
            elif event.type == "CHANGED" and node.token and self._client is not None:
                try:
                    self.send([Call("exists", node.path, watch=fired)])  # re-arm
                except BackendError:
                    pass

        return fired

    def _report(self, tokens: Sequence[str], reason: str, keys: Sequence[str] | None = None) -> None:
        callback = self.on_loss
        if callback is not None and tokens:
            try:
                callback(tokens, reason, keys)
            except Exception:  # pragma: no cover - the engine's callback does not raise
                log.exception("reporting lost locks failed")
