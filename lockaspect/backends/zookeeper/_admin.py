"""The ZooKeeper store's operator part (:class:`~lockaspect.backends.base.AdminStore`,
:class:`~lockaspect.backends.base.AddsPermits`, and their asyncio twins): describe a key,
list held keys, force a release, read, set or add to a semaphore's permits. Each is a plan of
a few pipelined round trips (see :mod:`._ops`), driven by the thread store or by the twin."""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import BadVersionError

from ...errors import BackendError, ConfigurationError
from ..base import HolderState, KeyState
from ._calls import Call
from ._layout import Contender, decode_key, holders, ordered
from ._ops import Plan, admin_permits, parent_of
from ._record import read
from ._session import NodeExistsError, NoNodeError

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["AdminMixin", "AsyncAdminMixin"]

log = logging.getLogger("lockaspect.zookeeper")

_KIND = {"lock": "lock", "sem": "semaphore"}
#: Requests per round trip when reading many nodes (held keys' queues, holders' data).
CHUNK = 256
#: Tries of a permits change or a force release that lost a race with another change.
PERMIT_TRIES = 64


def _families(children: Any) -> dict[str, list[Contender]]:
    families: dict[str, list[Contender]] = {}
    for contender in ordered(children if isinstance(children, list) else []):
        families.setdefault(contender.family, []).append(contender)
    return families


def _held(families: dict[str, list[Contender]], set_permits: int | None) -> list[tuple[str, list[Contender]]]:
    """Each family's holders (families held by nobody left out)."""
    found = []
    for family, queue in families.items():
        held = holders(queue, set_permits if family == "sem" else None)
        if held:
            found.append((family, held))
    return found


def _in_use(queue: list[Contender], permits: int | None) -> int:
    return sum(c.weight for c in holders(queue, permits)) if queue else 0


def describe(session: Session, namespace: str, key: str) -> Plan:
    """One :class:`KeyState` per family held at ``key``, each holder's token, owner record,
    fencing token (its node's creation zxid) and weight read from its node: two round trips
    (the queue, then every holder's node), more only past :data:`CHUNK` holders.
    ``remaining`` is ``None`` for each holder (it lives as long as its session); the
    KeyState's is the lease the holders asked for."""
    parent = parent_of(session, namespace + key)
    children, data = yield [Call("children", parent), Call("get", parent)]
    families = _families(children)
    set_permits = admin_permits(data)
    found = _held(families, set_permits)
    nodes = [c for _, held in found for c in held]
    answers: list[Any] = []
    for start in range(0, len(nodes), CHUNK):
        answers += yield [Call("get", f"{parent}/{c.name}") for c in nodes[start : start + CHUNK]]
    read_back = dict(zip((c.name for c in nodes), answers, strict=True))
    states = []
    for family, held in found:
        present = [(c, read_back[c.name]) for c in held if isinstance(read_back[c.name], tuple)]
        if not present:  # every holder left meanwhile
            continue
        held_by, leases, kinds = [], [], set()
        for c, (raw, stat) in present:
            record = read(raw)
            held_by.append(HolderState(record.token, record.owner, None, int(stat.czxid), c.weight))
            kinds.add(record.kind)
            if record.lease is not None:
                leases.append(record.lease)
        queue = families[family]
        kind = _KIND.get(family) or ("write" if held[0].infix == "write" else "read")
        if kind == "lock" and kinds == {"fair"}:
            kind = "fair"  # one queue serves both: the holder's data says which it asked for
        permits = (set_permits if set_permits is not None else queue[0].permits) if family == "sem" else None
        fence = max(holder.fencing_token or 0 for holder in held_by)
        remaining = max(leases) if leases else None
        waiters = len(queue) - len(held)
        states.append(KeyState(key, kind, len(held_by), remaining, fence, waiters, permits, tuple(held_by)))
    return states


def force_release(session: Session, namespace: str, key: str) -> Plan:
    """Delete every contender node at ``key`` if anyone holds it, in one transaction: the
    holders' (a holder of this session loses its hold at once, others from the watch on
    their node or their next re-entry: ``not-owner``) and the waiters' (each is woken by its
    watch, finds its place gone and queues again, so a waiter that cannot act, a frozen
    process, does not become the next stuck holder; and none holds for a moment between two
    deletes). Fencing tokens stay increasing: they are creation zxids. Whether anything was
    held."""
    parent = parent_of(session, namespace + key)
    for _ in range(PERMIT_TRIES):
        children, data = yield [Call("children", parent), Call("get", parent)]
        families = _families(children)
        held = [c for _, group in _held(families, admin_permits(data)) for c in group]
        if not held:
            return False
        everyone = [f"{parent}/{c.name}" for queue in families.values() for c in queue]
        with session.lock:
            paths = session.book.paths
            mine = [paths[f"{parent}/{c.name}"] for c in held if f"{parent}/{c.name}" in paths]
        (results,) = yield [Call("deletes", parent, paths=tuple(everyone))]
        if isinstance(results, list) and not any(isinstance(result, Exception) for result in results):
            session.lose_nodes([node for node in mine if node.token], "not-owner")
            log.warning(
                "force-released %r: deleted %d holder node(s) and %d waiter node(s)",
                key, len(held), len(everyone) - len(held),
            )  # fmt: skip
            return True
        # A contender left meanwhile (the transaction deleted nothing): look again.
    raise BackendError(f"ZooKeeper {session.settings.shown}: the contenders keep changing", key=key, transient=True)


def _store_permits(parent: str, data: Any, permits: int, version: int = -1) -> Call:
    payload = json.dumps({"permits": permits}).encode()
    if isinstance(data, tuple):
        return Call("set", parent, payload, version=version)
    return Call("container", parent, payload)  # no key node yet (or it was reaped)


def permits(session: Session, namespace: str, key: str, set_to: int | None, delta: int | None = None) -> Plan:
    """``(permits, in use)`` of semaphore ``key`` (in use: the holders' weights), after
    storing ``set_to`` on the key's node (the permits then override what contenders expect,
    until the node is removed with the key's last contender) or adding ``delta`` to what it
    has (a write made on the version read, tried again if another change came between).
    Changing it fires the data watch of the first waiter, which looks again."""
    parent = parent_of(session, namespace + key)
    for _ in range(PERMIT_TRIES):
        children, data = yield [Call("children", parent), Call("get", parent)]
        queue = _families(children).get("sem", [])
        current = admin_permits(data)
        if current is None and queue:
            current = queue[0].permits
        in_use = _in_use(queue, current)  # who holds now, even if the permits go down
        if delta is not None:
            set_to = max(0, (current or 0) + delta)
        if set_to is None:
            return current, in_use
        version = data[1].version if delta is not None and isinstance(data, tuple) else -1
        (answer,) = yield [_store_permits(parent, data, set_to, version)]
        if not isinstance(answer, Exception):
            return set_to, in_use
        if not isinstance(answer, (BadVersionError, NoNodeError, NodeExistsError)):
            raise BackendError(f"ZooKeeper {session.settings.shown}: {answer!r}", key=key)
        # Refused: another change came between (a versioned write), or the key's node came or
        # went meanwhile: read again.
    raise BackendError(f"ZooKeeper {session.settings.shown}: the permits keep changing", key=key, transient=True)


def _matching(names: Any, namespace: str, pattern: str) -> list[str]:
    keys = []
    for name in sorted(names if isinstance(names, list) else []):
        full = decode_key(name)
        if full.startswith(namespace) and fnmatch.fnmatchcase(full[len(namespace) :], pattern):
            keys.append(full[len(namespace) :])
    return keys


def _held_of(session: Session, namespace: str, chunk: list[str]) -> list[Call]:
    return [Call("children", parent_of(session, namespace + key)) for key in chunk]


def _check_set(set_to: object) -> None:
    if set_to is not None and (isinstance(set_to, bool) or not isinstance(set_to, int) or set_to < 0):
        raise ConfigurationError(f"permits must be an int >= 0, got {set_to!r}")


def _check_delta(delta: object) -> int:
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(f"the permits to add must be an int, got {type(delta).__name__}")
    return delta


class AdminMixin:
    """Operator calls for :class:`~.store.ZooKeeperStore`."""

    _session: Session
    namespace: str

    if TYPE_CHECKING:

        def _drive(self, plan: Plan, key: str | None) -> Any: ...

    def describe(self, key: str) -> list[KeyState]:
        """One entry per family held at ``key`` (``lock``, ``read`` or ``write``,
        ``semaphore``), each listing its holders (:attr:`KeyState.held_by`)."""
        states: list[KeyState] = self._drive(describe(self._session, self.namespace, key), key)
        return states

    def held_keys(self, pattern: str = "*") -> Iterator[str]:
        """The held keys matching ``pattern`` (one listing of the namespace, then the
        matching keys' queues, :data:`CHUNK` per round trip)."""
        session = self._session
        (names,) = session.run([Call("children", session.root)])
        keys = _matching(names, self.namespace, pattern)
        for start in range(0, len(keys), CHUNK):
            chunk = keys[start : start + CHUNK]
            answers = session.run(_held_of(session, self.namespace, chunk))
            for key, children in zip(chunk, answers, strict=True):
                if isinstance(children, list) and ordered(children):
                    yield key

    def force_release(self, key: str) -> bool:
        """Delete every holder's and waiter's node at ``key`` (see :func:`force_release`)."""
        released: bool = self._drive(force_release(self._session, self.namespace, key), key)
        return released

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after storing ``set_to`` if given."""
        _check_set(set_to)
        found: tuple[int | None, int] = self._drive(permits(self._session, self.namespace, key, set_to), key)
        return found

    def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """Add ``delta`` to semaphore ``key``'s permits in one step, never below 0 (see
        ``AddsPermits``); ``(permits, in use)`` after."""
        delta = _check_delta(delta)
        found: tuple[int, int] = self._drive(permits(self._session, self.namespace, key, None, delta), key)
        return found


class AsyncAdminMixin:
    """The same operator calls for :class:`~.store.AsyncZooKeeperStore`, awaited."""

    _session: Session
    namespace: str

    if TYPE_CHECKING:

        async def _drive(self, plan: Plan, key: str | None) -> Any: ...

    async def describe(self, key: str) -> list[KeyState]:
        """See :meth:`AdminMixin.describe`."""
        states: list[KeyState] = await self._drive(describe(self._session, self.namespace, key), key)
        return states

    async def held_keys(self, pattern: str = "*") -> AsyncIterator[str]:
        """See :meth:`AdminMixin.held_keys`."""
        session = self._session
        (names,) = await session.arun([Call("children", session.root)])
        keys = _matching(names, self.namespace, pattern)
        for start in range(0, len(keys), CHUNK):
            chunk = keys[start : start + CHUNK]
            answers = await session.arun(_held_of(session, self.namespace, chunk))
            for key, children in zip(chunk, answers, strict=True):
                if isinstance(children, list) and ordered(children):
                    yield key

    async def force_release(self, key: str) -> bool:
        """See :meth:`AdminMixin.force_release`."""
        released: bool = await self._drive(force_release(self._session, self.namespace, key), key)
        return released

    async def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """See :meth:`AdminMixin.permits`."""
        _check_set(set_to)
        found: tuple[int | None, int] = await self._drive(permits(self._session, self.namespace, key, set_to), key)
        return found

    async def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """See :meth:`AdminMixin.add_permits`."""
        delta = _check_delta(delta)
        found: tuple[int, int] = await self._drive(permits(self._session, self.namespace, key, None, delta), key)
        return found
