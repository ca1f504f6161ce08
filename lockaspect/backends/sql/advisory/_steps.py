"""The round trips a plan of :mod:`._ops` yields to its driver (the thread store or its
asyncio twin)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, NamedTuple

from ._state import Pending

__all__ = ["Leave", "Plan", "Queue", "Run", "Undo"]


class Run(NamedTuple):
    """Send ``sql`` on ``session`` (``None``: a holder session of the pool, preferring one that
    holds none of ``avoid``) under the session's lock; then, still under it, ``after(session,
    rows)`` (its value is the result). The driver answers ``(session, result)``."""

    sql: str
    params: dict[str, Any]
    key: str
    session: Any = None
    avoid: frozenset[int] = frozenset()
    after: Callable[[Any, list[tuple[Any, ...]]], Any] | None = None
    #: The parameters for the session the statement runs on (called under the session's
    #: lock, before the statement), when they depend on it.
    bind: Callable[[Any], dict[str, Any]] | None = None


class Queue(NamedTuple):
    """Queue ``waiter`` in the server: a blocking ``sql`` on a session of its own, in the
    background. The driver answers the :class:`Pending` (``None``: no session to spare)."""

    key: str
    waiter: str
    kind: str
    objkey: int
    shared: bool
    sql: str
    params: dict[str, Any]


class Undo(NamedTuple):
    """Unlock ``objkey`` once on ``session`` (errors ignored: a lost session freed it)."""

    session: Any
    objkey: int
    shared: bool


class Leave(NamedTuple):
    """Give up a queued wait: cancel its statement in the server, or unlock what it got."""

    pending: Pending


Plan = Generator[Any, Any, Any]
