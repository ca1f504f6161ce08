"""What this process has in ZooKeeper: :class:`Node`, one contender node of the session, and
:class:`Book`, every such node by what it is for (guarded by the session's lock)."""

from __future__ import annotations

__all__ = ["Book", "Node"]


class Node:
    """One contender node of this session: a hold (``token`` set) or a queue place."""

    __slots__ = (
        "epoch", "fence", "held_since", "infix", "key", "name", "parent",
        "path", "token", "waiter", "watched", "written",
    )  # fmt: skip

    def __init__(self, key: str, parent: str, name: str, infix: str, fence: int, epoch: int) -> None:
        self.key = key
        self.parent = parent
        self.name = name
        self.path = f"{parent}/{name}"
        self.infix = infix
        self.fence = fence
        self.epoch = epoch
        self.token = ""
        self.waiter = ""
        self.watched = False
        self.held_since = 0.0
        self.written = ""  # the token its data names (a waiter's node may be held for another)


class Book:
    """What this session has in the tree: holds by ``(key, token)``, queue places by ``(key,
    waiter)``, a multi-key waiter's places by waiter, and every node by path. Guarded by the
    session's lock."""

    def __init__(self) -> None:
        self.holds: dict[tuple[str, str], Node] = {}
        self.queued: dict[tuple[str, str], Node] = {}
        self.multi: dict[str, list[Node]] = {}
        self.paths: dict[str, Node] = {}
        # (key, waiter) places an attempt is using now: a concurrent attempt under the same
        # waiter id (another task or thread of this process) acts as a plain try instead.
        self.claims: set[tuple[str, str]] = set()

    def nodes(self) -> list[Node]:
        return list(self.paths.values())

    def clear(self) -> None:
        self.holds.clear()
        self.queued.clear()
        self.multi.clear()
        self.paths.clear()
        self.claims.clear()
