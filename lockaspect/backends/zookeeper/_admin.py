"""The ZooKeeper store's operator part (:class:`~lockaspect.backends.base.AdminStore`):
describe a key, list held keys, force a release, read or set a semaphore's permits. Each is a
few pipelined round trips on the store's session."""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..base import KeyState
from ._calls import Call
from ._layout import Contender, decode_key, holders, ordered
from ._ops import admin_permits, parent_of

if TYPE_CHECKING:
    from ._session import Session

__all__ = ["AdminMixin"]

log = logging.getLogger("lockaspect.zookeeper")

_KIND = {"lock": "lock", "sem": "semaphore"}


class AdminMixin:
    """Operator calls for :class:`~.store.ZooKeeperStore`."""

    _session: Session
    namespace: str

    def _queues(self, key: str) -> tuple[str, dict[str, list[Contender]], Any]:
        """``key``'s parent, its contenders by family (in order), and the parent's data."""
        parent = parent_of(self._session, self.namespace + key)
        children, data = self._session.run([Call("children", parent), Call("get", parent)], key)
        names = children if isinstance(children, list) else []
        families: dict[str, list[Contender]] = {}
        for contender in ordered(names):
            families.setdefault(contender.family, []).append(contender)
        return parent, families, data

    def describe(self, key: str) -> list[KeyState]:
        """One entry per family held at ``key``: holders, waiters, the first holder's fencing
        token (its node's creation zxid) and the lease it asked for (``remaining``: a
        ZooKeeper hold has no expiry while its session lives)."""
        parent, families, data = self._queues(key)
        set_permits = admin_permits(data)
        found: list[tuple[str, list[Contender], list[Contender]]] = []
        for family, queue in families.items():
            held = holders(queue, set_permits if family == "sem" else None)
            if held:
                found.append((family, queue, held))
        if not found:
            return []
        answers = self._session.run([Call("get", f"{parent}/{held[0].name}") for _, _, held in found], key)
        states = []
        for (family, queue, held), answer in zip(found, answers, strict=True):
            fence, remaining = None, None
            if isinstance(answer, tuple):
                fence = int(answer[1].czxid)
                remaining = _lease(answer[0])
            kind = _KIND.get(family) or ("write" if held[0].infix == "write" else "read")
            permits = (set_permits if set_permits is not None else queue[0].permits) if family == "sem" else None
            states.append(KeyState(key, kind, len(held), remaining, fence, len(queue) - len(held), permits))
        return states

    def held_keys(self, pattern: str = "*") -> Iterator[str]:
        """The held keys matching ``pattern`` (one listing of the namespace, then the
        matching keys' queues, 256 per round trip)."""
        session = self._session
        (names,) = session.run([Call("children", session.root)])
        if not isinstance(names, list):
            return
        keys = []
        for name in sorted(names):
            full = decode_key(name)
            if full.startswith(self.namespace) and fnmatch.fnmatchcase(full[len(self.namespace) :], pattern):
                keys.append(full[len(self.namespace) :])
        for start in range(0, len(keys), 256):
            chunk = keys[start : start + 256]
            answers = session.run([Call("children", parent_of(session, self.namespace + key)) for key in chunk])
            for key, children in zip(chunk, answers, strict=True):
                if isinstance(children, list) and ordered(children):
                    yield key

    def force_release(self, key: str) -> bool:
        """Delete every holder's node at ``key`` (waiters keep their places: the next in line
        holds next). The holders learn of it from the watch on their node (``not-owner``).
        Fencing tokens stay increasing: they are creation zxids."""
        parent, families, data = self._queues(key)
        set_permits = admin_permits(data)
        victims = [
            c for family, queue in families.items() for c in holders(queue, set_permits if family == "sem" else None)
        ]
        if not victims:
            return False
        session = self._session
        with session.lock:
            mine = [
                session.book.paths[f"{parent}/{c.name}"] for c in victims if f"{parent}/{c.name}" in session.book.paths
            ]
        session.lose_nodes([node for node in mine if node.token], "not-owner")
        session.run([Call("delete", f"{parent}/{c.name}") for c in victims], key)
        log.warning("force-released %r: deleted %d holder node(s)", key, len(victims))
        return True

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``; ``set_to`` stores the permits on the
        key's node (they then override what contenders expect, until the node is removed
        with the key's last contender)."""
        session = self._session
        parent, families, data = self._queues(key)
        queue = families.get("sem", [])
        current = admin_permits(data)
        if set_to is not None:
            payload = json.dumps({"permits": set_to}).encode()
            if isinstance(data, tuple):
                session.run([Call("set", parent, payload)], key)
            else:
                session.run([Call("container", parent, payload)], key)
            current = set_to
        elif current is None and queue:
            current = queue[0].permits
        return current, len(holders(queue, current)) if queue else 0


def _lease(data: bytes) -> float | None:
    try:
        value = json.loads(data).get("lease") if data else None
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
