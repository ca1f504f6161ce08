"""Redis Cluster's fast path: :class:`_ClusterWire` and :class:`_AsyncClusterWire` send each
lock command on a :class:`~._wire._Wire` (or :class:`~._async_wire._AsyncWire`) of the
primary that serves the key's hash slot, read from redis-py's slot map.

A node that does not serve the slot any more says so without running the command: ``MOVED``
(a failover, a finished migration) refreshes the slot map and sends the command again to the
new owner; ``ASK`` (a slot being migrated, the key already moved) sends it once to the
importing node, behind ``ASKING``. A command that may have run (a connection error, a
timeout) is never sent again here: the error goes up (transient), the slot map is refreshed
before the next command, and the node's idle connections are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import redis
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterError, MovedError, RedisClusterException, TryAgainError

from ._async_wire import _AsyncWire
from ._script import _pack_any
from ._wire import _Line, _Undo, _Wire

__all__ = [
    "REDIRECTS",
    "_AsyncClusterLine",
    "_AsyncClusterWire",
    "_ClusterLine",
    "_ClusterWire",
    "command_slot",
    "user_key_slot",
]

T = TypeVar("T")

#: How many MOVED/ASK redirections one command follows before giving up (transiently).
REDIRECTS = 5

#: A command answered TRYAGAIN (a script whose slot is being migrated, some of its keys moved
#: already, or absent: the node cannot tell) did not run: it is sent again after a pause
#: doubling from this many seconds, for at most :data:`TRYAGAIN_FOR` seconds in all (a slot's
#: migration usually ends within milliseconds), then the error goes up (transient).
TRYAGAIN_PAUSE = 0.01
TRYAGAIN_FOR = 1.0

#: A slot map refreshed less than this many seconds ago is not refreshed again for a MOVED
#: (many commands meet the same failover at once; one refresh serves them all).
REFRESH_EVERY = 0.05


def user_key_slot(key: str) -> int:
    """The hash slot of every store key of user key ``key`` (its hash tag is the key)."""
    return int(key_slot(key.encode()))


def command_slot(args: tuple[object, ...]) -> int | None:
    """The slot of a script call (``EVAL[SHA] script numkeys key ...``): its first key's
    (all its keys share one), or ``None`` for a call without keys."""
    if len(args) < 4 or int(str(args[2])) < 1:
        return None
    key = args[3]
    return int(key_slot(key if isinstance(key, bytes) else str(key).encode()))


def _unused() -> None:  # pragma: no cover - a pool's make_connection, never called
    return None


def _unrouted(exc: Exception) -> redis.ConnectionError:
    # No primary serves the slot right now (a failover in progress): nothing was sent.
    return redis.ConnectionError(f"no node serves the slot: {exc}")


class _Routing:
    """What both twins share: the slot map's clock and the redirection decisions."""

    def __init__(self) -> None:
        self._stale = False
        self._refreshed_at = 0.0

    def _due(self) -> bool:
        return time.monotonic() - self._refreshed_at >= REFRESH_EVERY

    @staticmethod
    def _redirected(exc: AskError, slot: int | None, redirects: int) -> int:
        """Count a redirection; raise once there were :data:`REDIRECTS` in a row."""
        if redirects + 1 >= REDIRECTS:
            raise ClusterError(f"the slot {slot} was redirected {REDIRECTS} times in a row") from exc
        return redirects + 1

    @staticmethod
    def _pause_again(retries: int, began: float) -> float | None:
        """How long to wait before sending again a command answered ``TRYAGAIN`` (it did not
        run: a migration has moved some of its keys, not all), doubling from
        :data:`TRYAGAIN_PAUSE`; ``None`` once :data:`TRYAGAIN_FOR` would be spent."""
        pause = min(TRYAGAIN_PAUSE * 2.0 ** (retries - 1), 0.2)
        if time.monotonic() - began + pause > TRYAGAIN_FOR:
            return None
        return pause

    @staticmethod
    def _target(exc: AskError) -> tuple[str, int]:
        return str(exc.host), int(exc.port)

    @staticmethod
    def _pick(cluster: Any, slot: int | None, to: tuple[str, int] | None) -> Any:
        """The node for ``slot`` by the slot map, or the one a redirection named (``to``)."""
        manager = cluster.nodes_manager
        if to is not None:
            node = manager.get_node(host=to[0], port=to[1])
            if node is None:
                raise redis.ConnectionError(f"redirected to {to[0]}:{to[1]}, a node the slot map does not list yet")
            return node
        if slot is None:
            return cluster.get_random_node()
        return manager.get_node_from_slot(slot)


class _ClusterWire(_Routing):
    """One :class:`_Wire` per primary, picked by the command's slot (thread-safe)."""

    def __init__(self, cluster: Any) -> None:
        super().__init__()
        self._cluster = cluster
        self._wires: dict[str, _Wire] = {}
        self._mutex = threading.Lock()

    def call(self, packed: bytes, args: tuple[object, ...], undo: _Undo | None = None) -> Any:
        return self._routed(args, lambda wire, asking: wire.call(packed, args, undo, asking))

    def call_then(
        self, packed: bytes, args: tuple[object, ...], then: tuple[bytes, ...], undo: _Undo | None = None
    ) -> tuple[Any, Any]:
        return self._routed(args, lambda wire, asking: wire.call_then(packed, args, then, undo, asking))

    def _routed(self, args: tuple[object, ...], send: Callable[[_Wire, bool], T]) -> T:
        slot = command_slot(args)
        to: tuple[str, int] | None = None
        asking = False
        redirects = retries = 0
        began = time.monotonic()
        while True:
            if self._stale:
                self.refresh()
            node = self._node(slot, to)
            wire = self._wire(node)
            try:
                return send(wire, asking)
            except AskError as exc:  # also MovedError: the node did not run the command
                redirects = self._redirected(exc, slot, redirects)
                to, asking = self._target(exc), not isinstance(exc, MovedError)
                if not asking:
                    self.refresh()
            except TryAgainError:
                retries += 1
                pause = self._pause_again(retries, began)
                if pause is None:
                    raise
                to, asking = None, False  # from the slot's owner again: the keys are moving
                time.sleep(pause)
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                wire.close_idle()
                self._stale = True
                raise

    def node(self, slot: int | None) -> Any:
        """The primary serving ``slot`` now (by the slot map, read again first if stale)."""
        if self._stale:
            self.refresh()
        return self._node(slot, None)

    def _node(self, slot: int | None, to: tuple[str, int] | None) -> Any:
        try:
            return self._pick(self._cluster, slot, to)
        except RedisClusterException as exc:
            self._stale = True
            raise _unrouted(exc) from exc

    def _wire(self, node: Any) -> _Wire:
        wire = self._wires.get(node.name)
        if wire is None:
            with self._mutex:
                wire = self._wires.get(node.name)
                if wire is None:
                    wire = self._wires[node.name] = _Wire(self._cluster.get_redis_connection(node))
        return wire

    def refresh(self) -> None:
        """Read the slot map again (once per :data:`REFRESH_EVERY` however many callers ask)."""
        with self._mutex:
            self._stale = False
            if not self._due():
                return
            self._refreshed_at = time.monotonic()
        try:
            self._cluster.nodes_manager.initialize()
        except (redis.RedisError, RedisClusterException, OSError):
            self._stale = True  # every node unreachable for now: try again at the next command

    def nodes(self) -> list[str]:
        return list(self._wires)

    def close(self) -> None:
        with self._mutex:
            wires, self._wires = self._wires, {}
        for wire in wires.values():
            wire.close()

    def _after_fork(self) -> None:
        self._wires = {}
        self._mutex = threading.Lock()


class _AsyncClusterWire(_Routing):
    """:class:`_ClusterWire` for one event loop (``redis.asyncio.cluster.RedisCluster``)."""

    def __init__(self, cluster: Any) -> None:
        super().__init__()
        self._cluster = cluster
        self._wires: dict[str, _AsyncWire] = {}
        self._refreshing: asyncio.Task[None] | None = None

    async def call(self, packed: bytes, args: tuple[object, ...], undo: _Undo | None = None) -> Any:
        return await self._routed(args, lambda wire, asking: wire.call(packed, args, undo, asking))

    async def call_then(
        self, packed: bytes, args: tuple[object, ...], then: tuple[bytes, ...], undo: _Undo | None = None
    ) -> tuple[Any, Any]:
        return await self._routed(args, lambda wire, asking: wire.call_then(packed, args, then, undo, asking))

    async def _routed(self, args: tuple[object, ...], send: Callable[[_AsyncWire, bool], Awaitable[T]]) -> T:
        slot = command_slot(args)
        to: tuple[str, int] | None = None
        asking = False
        if getattr(self._cluster, "_initialize", False):
            await self._cluster.initialize()  # an asyncio cluster client reads its slot map on first use
        redirects = retries = 0
        began = time.monotonic()
        while True:
            if self._stale:
                await self.refresh()
            try:
                node = self._pick(self._cluster, slot, to)
            except (RedisClusterException, KeyError) as exc:
                self._stale = True
                raise _unrouted(exc) from exc
            wire = self._wire(node)
            try:
                return await send(wire, asking)
            except AskError as exc:  # also MovedError
                redirects = self._redirected(exc, slot, redirects)
                to, asking = self._target(exc), not isinstance(exc, MovedError)
                if not asking:
                    await self.refresh()
            except TryAgainError:
                retries += 1
                pause = self._pause_again(retries, began)
                if pause is None:
                    raise
                to, asking = None, False
                await asyncio.sleep(pause)
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                wire.close_idle()
                self._stale = True
                raise

    async def node(self, slot: int | None) -> Any:
        """See :meth:`_ClusterWire.node`."""
        if getattr(self._cluster, "_initialize", False):
            await self._cluster.initialize()
        if self._stale:
            await self.refresh()
        try:
            return self._pick(self._cluster, slot, None)
        except (RedisClusterException, KeyError) as exc:
            self._stale = True
            raise _unrouted(exc) from exc

    def _wire(self, node: Any) -> _AsyncWire:
        wire = self._wires.get(node.name)
        if wire is None:
            # _AsyncWire makes connections from a pool's class and settings: the node's.
            pool = SimpleNamespace(
                connection_class=node.connection_class,
                connection_kwargs=dict(node.connection_kwargs),
                make_connection=_unused,
                max_connections=node.max_connections,
            )
            wire = self._wires[node.name] = _AsyncWire(SimpleNamespace(connection_pool=pool, connection=None))
        return wire

    async def refresh(self) -> None:
        """See :meth:`_ClusterWire.refresh`; concurrent callers share one refresh."""
        self._stale = False
        task = self._refreshing
        if task is None or task.done():
            if not self._due():
                return
            self._refreshed_at = time.monotonic()
            task = self._refreshing = asyncio.get_running_loop().create_task(self._initialize())
        await asyncio.shield(task)

    async def _initialize(self) -> None:
        try:
            await self._cluster.nodes_manager.initialize()
        except (redis.RedisError, RedisClusterException, OSError):
            self._stale = True

    def nodes(self) -> list[str]:
        return list(self._wires)

    async def close(self) -> None:
        refreshing, self._refreshing = self._refreshing, None
        if refreshing is not None and not refreshing.done():
            refreshing.cancel()
            with contextlib.suppress(BaseException):
                await refreshing
        wires, self._wires = self._wires, {}
        for wire in wires.values():
            await wire.close()


class _ClusterLine:
    """The renewals' round trip on a cluster: the commands grouped by the primary serving
    each one's slot, written to every primary (on a :class:`_Line` of its own) before any
    reply is read: one round trip per primary, all at once. A primary that fails answers its
    commands with the error (those leases are retried at the next tick, the others are not
    held up); a command redirected (``MOVED``/``ASK``) goes again on its own through the
    cluster wire. Called from one thread at a time (the watchdog)."""

    def __init__(self, cluster: Any, wire: _ClusterWire) -> None:
        self._cluster = cluster
        self._wire = wire
        self._lines: dict[str, _Line] = {}

    def round_trip(self, commands: list[tuple[object, ...]]) -> list[Any]:
        replies: list[Any] = [None] * len(commands)
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, command in enumerate(commands):
            try:
                node = self._wire.node(command_slot(command))
            except redis.ConnectionError as exc:
                replies[i] = exc
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        sent: list[tuple[_Line, list[int]]] = []
        for name, (node, indexes) in groups.items():
            line = self._lines.get(name)
            if line is None:
                line = self._lines[name] = _Line(self._cluster.get_redis_connection(node))
            try:
                line.send([commands[i] for i in indexes])
                sent.append((line, indexes))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                self._failed(indexes, replies, exc)
        for line, indexes in sent:
            try:
                for i, reply in zip(indexes, line.receive(len(indexes)), strict=True):
                    replies[i] = reply
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                self._failed(indexes, replies, exc)
        for i, reply in enumerate(replies):
            if isinstance(reply, AskError):
                try:
                    replies[i] = self._wire.call(_pack_any(commands[i]), commands[i])
                except (redis.RedisError, OSError) as exc:
                    replies[i] = exc
        return replies

    def _failed(self, indexes: list[int], replies: list[Any], exc: Exception) -> None:
        self._wire._stale = True
        for i in indexes:
            replies[i] = exc

    def close(self) -> None:
        lines, self._lines = self._lines, {}
        for line in lines.values():
            line.close()


class _AsyncClusterLine:
    """:class:`_ClusterLine` for one event loop: one batch per primary on the primaries'
    wires, all in flight at once."""

    def __init__(self, wire: _AsyncClusterWire) -> None:
        self._wire = wire

    async def round_trip(self, commands: list[tuple[object, ...]]) -> list[Any]:
        replies: list[Any] = [None] * len(commands)
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, command in enumerate(commands):
            try:
                node = await self._wire.node(command_slot(command))
            except redis.ConnectionError as exc:
                replies[i] = exc
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        batches = [
            self._wire._wire(node).batch(b"".join(_pack_any(commands[i]) for i in indexes), len(indexes))
            for node, indexes in groups.values()
        ]
        results = await asyncio.gather(*batches, return_exceptions=True)
        for (_, indexes), result in zip(groups.values(), results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception) or isinstance(result, asyncio.CancelledError):
                    raise result
                self._wire._stale = True
                result = [result] * len(indexes)
            for i, reply in zip(indexes, result, strict=True):
                replies[i] = reply
        for i, reply in enumerate(replies):
            if isinstance(reply, AskError):
                try:
                    replies[i] = await self._wire.call(_pack_any(commands[i]), commands[i])
                except (redis.RedisError, OSError) as exc:
                    replies[i] = exc
        return replies
