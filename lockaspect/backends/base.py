"""What a store must do for lockaspect: the backend protocol and its result types.

A backend performs single round trips and reports what the store said; every decision
(waiting, retrying, what a failed renewal means) is taken by the core. Backends raise only
:class:`~lockaspect.BackendError`, chained to the driver's exception.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, Protocol

__all__ = [
    "AcquireResult",
    "Backend",
    "Capability",
    "MultiAcquireResult",
    "Notifier",
    "ReleaseResult",
    "RenewItem",
    "Subscription",
]


#: What the watchdog asks a backend to renew: ``(key, token, lease seconds)`` for a lock or a
#: fair lock, ``(key, token, lease seconds, kind)`` for the other kinds: ``"semaphore"`` (a
#: permit), ``"read"`` or ``"write"`` (a read-write lock's hold). :meth:`Backend.renew`
#: answers each with ``True``, ``False`` or ``None`` (renewed, not ours, retry).
RenewItem = tuple[str, str, float] | tuple[str, str, float, str]


class Capability(enum.Flag):
    """What a backend can do beyond acquire/release."""

    NONE = 0
    #: Leases expire unless renewed, so the watchdog applies.
    RENEWABLE = enum.auto()
    #: ``renew`` takes many keys and answers in one round trip.
    BATCH_RENEW = enum.auto()
    #: A release publishes a message that waiters can block on (see :class:`Notifier`).
    RELEASE_NOTIFY = enum.auto()
    #: Every acquisition gets a strictly increasing fencing token per key.
    FENCING = enum.auto()


class AcquireResult(NamedTuple):
    """The store's answer to one acquire attempt (a tuple: cheap on the hot path).

    Attributes:
        acquired: The lock is ours (first hold, or a re-entry of our own token).
        fencing_token: The lock's fencing token on a first acquisition, else 0 (a re-entry
            does not read it: the caller already has it).
        holds: Our hold count after the call (1 on first acquisition), else 0.
        holder_ttl: When busy, the holder's remaining lease in seconds, or ``None`` when
            the store did not say.
        replicas: When acquired by a backend asked to wait for replicas, how many
            confirmed the write in time; else ``None``.
        permits: Semaphores only: the semaphore has this many permits, not the number the
            caller expected (nothing was acquired or changed); else ``None``.
        valid_for: When acquired, how long the lease may be trusted, in seconds counted from
            when the request was sent, if shorter than the lease asked for (RedLock takes the
            round trips and a clock-drift allowance off); ``None``: the whole lease.
    """

    acquired: bool
    fencing_token: int = 0
    holds: int = 0
    holder_ttl: float | None = None
    replicas: int | None = None
    permits: int | None = None
    valid_for: float | None = None


class MultiAcquireResult(NamedTuple):
    """The store's answer to one all-or-nothing attempt on several keys.

    Attributes:
        acquired: Every key is held by the token now.
        fencing_tokens: When acquired, each key's fencing token, in the keys' order.
        busy: When not acquired, the key held by another owner.
        holder_ttl: That holder's remaining lease in seconds, ``None`` when it has none.
        replicas: As :attr:`AcquireResult.replicas`.
    """

    acquired: bool
    fencing_tokens: tuple[int, ...] = ()
    busy: str | None = None
    holder_ttl: float | None = None
    replicas: int | None = None


class ReleaseResult(enum.IntEnum):
    """Release outcome codes (the values are what the Lua script returns)."""

    NOT_OWNER = 0
    RELEASED = 1
    STILL_HELD = 2


class Subscription(Protocol):
    """A local waiter's registration for release messages on one lock."""

    def wait(self, timeout: float) -> bool:
        """Block until a release message arrives or ``timeout`` passes; ``True`` if woken
        by a message (or by the notifier failing, so the waiter re-checks at once)."""
        ...

    @property
    def active(self) -> bool:
        """The subscription is confirmed by the store, so a release will wake us."""
        ...


class Notifier(Protocol):
    """Delivers release messages to local waiters over one shared connection."""

    #: The id under which this notifier's waiters queue for a lock: a release wakes the
    #: first queued waiter, on a channel of that waiter's own.
    waiter_id: str

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> Subscription:
        """Register for release messages of ``key`` (for ``waiter``, default
        :attr:`waiter_id`); waits up to ``timeout`` for the store to confirm. A
        subscription that is not confirmed reports ``active == False`` and the waiter falls
        back to bounded polling."""
        ...

    def listening(self, key: str) -> bool:
        """Whether wake-ups of ``key`` already reach this notifier."""
        ...

    def unsubscribe(self, subscription: Subscription) -> None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """A lock store. Seconds at this boundary; conversion to the store's units inside."""

    capabilities: Capability

    def acquire(
        self,
        key: str,
        token: str,
        lease: float,
        waiter: str | None = None,
        front: bool = False,
        fair: bool = False,
    ) -> AcquireResult:
        """Take ``key`` for ``token`` for ``lease`` seconds, or report the holder's TTL.

        Idempotent for a token that already holds the lock (a retried request does not
        add a hold): re-entry is :meth:`reenter`. With ``waiter`` (a notifier's
        ``waiter_id``), a busy attempt queues that waiter for a wake-up on release (at the
        head with ``front``), and a successful one takes it off the queue. With ``fair``,
        the fair lock's queue: a free lock goes only to its first live waiter (or to anyone
        when nobody queues).
        """
        ...

    def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        """Take ``waiter`` off ``key``'s queue: it stopped waiting."""
        ...

    def multi_acquire(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None = None
    ) -> MultiAcquireResult:
        """Take every lock of ``keys`` for ``token`` at once, or none: the first busy key and
        its holder's TTL. With ``waiter``, a busy attempt queues it on that key."""
        ...

    def sem_acquire(
        self, key: str, token: str, lease: float, permits: int, waiter: str | None = None, front: bool = False
    ) -> AcquireResult:
        """Take one of the ``permits`` permits of semaphore ``key`` for ``lease`` seconds, each
        permit with a lease of its own; a permit whose lease ended is free again. When the
        semaphore has another number of permits, nothing happens and ``permits`` says how
        many. Waiters queue as for :meth:`acquire`."""
        ...

    def sem_release(self, key: str, token: str) -> ReleaseResult:
        """Give the permit back (``RELEASED``) and wake the next waiter, or ``NOT_OWNER``."""
        ...

    def sem_reenter(self, key: str, token: str) -> AcquireResult:
        """Whether ``token`` still holds a permit of ``key`` (re-entry holds are counted by
        the client)."""
        ...

    def sem_state(self, key: str, permits: int | None = None) -> tuple[int | None, int]:
        """``(permits, in use)``, after setting the permits to ``permits`` if given."""
        ...

    def rw_acquire(
        self, key: str, token: str, lease: float, mode: str, waiter: str | None = None, below: str = ""
    ) -> AcquireResult:
        """Take read-write lock ``key`` for ``mode`` (``"read"``: shared, ``"write"``:
        exclusive) for ``lease`` seconds. ``below``: the token of the write lock the caller
        holds (a reader may downgrade). A waiting writer (one with ``waiter``) keeps new
        readers out. Waiters queue for a wake-up."""
        ...

    def rw_release(self, key: str, token: str, mode: str) -> ReleaseResult:
        """Give back a ``mode`` hold (``RELEASED``, waking waiters when the lock may be free
        for them) or ``NOT_OWNER``."""
        ...

    def rw_held(self, key: str, token: str, mode: str) -> AcquireResult:
        """Whether ``token`` still holds ``key`` in ``mode`` (re-entry)."""
        ...

    def reenter(self, key: str, token: str) -> AcquireResult:
        """Add a hold for ``token`` if it still owns ``key``; ``acquired=False`` if not.
        Never takes a free lock and never changes the lease."""
        ...

    def release(self, key: str, token: str, fair: bool = False) -> ReleaseResult:
        """Drop one hold of ``token``; at zero delete the lock and wake the next waiter (of
        the fair lock's queue with ``fair``)."""
        ...

    def renew(self, leases: Sequence[RenewItem]) -> Sequence[bool | float | None]:
        """Extend many :data:`RenewItem` in one round trip; one status per item, in order:
        ``True`` renewed, ``False`` not ours any more (gone, another owner, or a value the
        store did not get from lockaspect written over the key), ``None`` not decided: this
        item's renewal failed on its own (an error reply for the part of the batch that
        carried it, such as a refusal for memory) and should be retried; the other items'
        statuses stand. Raises :class:`~lockaspect.BackendError` only when the round trip
        as a whole failed (the connection, a timeout)."""
        ...

    def notifier(self) -> Notifier | None:
        """A notifier for release messages, or ``None`` without RELEASE_NOTIFY."""
        ...

    def close(self) -> None: ...
