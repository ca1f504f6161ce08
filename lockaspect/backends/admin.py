"""The operator part of the store protocol (re-exported by :mod:`lockaspect.backends.base`):
what :meth:`AdminStore.describe` reports (:class:`KeyState`, :class:`HolderState`) and the
optional admin interfaces a store implements for the operator tools (``describe``,
``held_locks``, ``force_release``, permits) and their asyncio twin."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import NamedTuple, Protocol, runtime_checkable

__all__ = ["AddsPermits", "AdminStore", "AsyncAdminStore", "HolderState", "KeyState"]


class HolderState(NamedTuple):
    """One holder of a key, as :meth:`AdminStore.describe` reports it.

    Attributes:
        token: The holder's owner token, whole (the client shows only a prefix of it).
        owner: The :attr:`AcquireRequest.owner` recorded with the hold (``""``: none).
        remaining: Seconds until its lease ends; ``None`` for a hold that lives as long as a
            session (ZooKeeper, PostgreSQL advisory locks) or a key without an expiry.
        fencing_token: Its fencing token, or ``None`` when the store has none for it.
        weight: Permits it holds (semaphores; 1 otherwise).
    """

    token: str
    owner: str = ""
    remaining: float | None = None
    fencing_token: int | None = None
    weight: int = 1


class KeyState(NamedTuple):
    """What :meth:`AdminStore.describe` reports about one key (for the operator tools).

    ``holders`` counts holders (a semaphore holder may hold several permits: see its
    :attr:`HolderState.weight`); ``held_by`` lists them
    with what the store recorded, where the store can say (a value not written by lockaspect
    counts as one holder with no entry there)."""

    key: str
    kind: str
    holders: int
    remaining: float | None
    fencing_token: int | None = None
    waiters: int = 0
    permits: int | None = None
    held_by: tuple[HolderState, ...] = ()


@runtime_checkable
class AdminStore(Protocol):
    """The optional operator part of a store: look at keys, set permits, force a release."""

    def describe(self, key: str) -> list[KeyState]:
        """What the store holds under ``key``: one entry per kind held there (empty: free),
        each listing its holders in :attr:`KeyState.held_by`."""
        ...

    def held_keys(self, pattern: str = "*") -> Iterator[str]:
        """The keys held now whose name matches the glob ``pattern`` (incrementally)."""
        ...

    def force_release(self, key: str) -> bool:
        """Delete every hold of ``key`` whoever holds it, waking waiters (fencing state is
        kept, so tokens stay increasing); whether anything was held."""
        ...

    def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)`` of semaphore ``key``, after setting its permits to ``set_to``
        if given (``None`` permits: never set)."""
        ...


@runtime_checkable
class AddsPermits(Protocol):
    """The optional part of an admin store that changes a semaphore's permits by a delta in
    one step (without it, the client reads the number and sets it: two round trips)."""

    def add_permits(self, key: str, delta: int) -> tuple[int, int]:
        """Add ``delta`` (negative: take away) to semaphore ``key``'s permits, never below 0;
        ``(permits, in use)`` after. A semaphore never used starts from 0. Raising it wakes
        waiters; lowering it takes no permit away from holders."""
        ...


@runtime_checkable
class AsyncAdminStore(Protocol):
    """:class:`AdminStore` for one event loop (without it, the client runs the sync admin
    calls in a worker thread)."""

    async def describe(self, key: str) -> list[KeyState]: ...

    def held_keys(self, pattern: str = "*") -> AsyncIterator[str]: ...

    async def force_release(self, key: str) -> bool: ...

    async def permits(self, key: str, set_to: int | None = None) -> tuple[int | None, int]: ...
