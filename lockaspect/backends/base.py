"""The store protocol: what a lock store must do for lockaspect, and the values that cross it.

A store performs single round trips and reports what the store said; every decision (waiting,
retrying, re-entry, what a failed renewal means) is taken by the engine. The protocol is small
and generic: :meth:`Store.acquire` takes one :class:`AcquireRequest` for every lock kind
(``request.kind`` names it; a store looks it up in its own operation table), and answers one
:class:`AcquireResult`. A store declares what it can do (:class:`Capability`) and which kinds it
serves (:attr:`Store.kinds`); the engine refuses anything else before any I/O.

Stores raise only :class:`~lockaspect.BackendError` (chained to the driver's exception, with
``transient`` set when a retry may succeed) and :class:`~lockaspect.ConfigurationError` (for a
request they cannot serve). Seconds at this boundary; conversion to the store's units inside.

Nothing outside a store touches its driver or its private members: the engine reaches a store
only through :class:`Store` / :class:`AsyncStore`, the operator tools through
:class:`AdminStore`. ``docs/stores/writing-a-store.md`` walks through adding one.
"""

from __future__ import annotations

import enum
import math
import os
import re
import threading
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from ..errors import BackendError, ConfigurationError
from .admin import AddsPermits as AddsPermits
from .admin import AdminStore as AdminStore
from .admin import AsyncAdminStore as AsyncAdminStore
from .admin import HolderState as HolderState
from .admin import KeyState as KeyState

__all__ = [
    "KINDS",
    "AcquireRequest",
    "AcquireResult",
    "AddsPermits",
    "AdminStore",
    "AsyncAdminStore",
    "AsyncNotifier",
    "AsyncReleasesMany",
    "AsyncStore",
    "AsyncSubscription",
    "Capability",
    "HolderState",
    "KeyState",
    "LossCallback",
    "Notifier",
    "ReleaseResult",
    "ReleaseStatus",
    "ReleasesMany",
    "RenewItem",
    "RenewStatus",
    "ReportsLosses",
    "Store",
    "Subscription",
    "checked_request",
    "new_waiter_id",
    "redacted",
]

#: Every lock kind the engine knows, by the name a store sees in requests: ``"lock"`` (a
#: mutex; several keys: a multi-key lock), ``"fair"`` (a mutex whose waiters are served in
#: order), ``"semaphore"`` (one of ``permits`` permits), ``"read"`` and ``"write"`` (the two
#: sides of a read-write lock).
KINDS = frozenset({"lock", "fair", "semaphore", "read", "write"})


class Capability(enum.Flag):
    """What a store can do beyond taking and giving back a lock."""

    NONE = 0
    #: Leases expire unless renewed, so the watchdog renews them (Redis, SQL lease tables).
    RENEWABLE = enum.auto()
    #: Holds live as long as a session the store keeps alive itself (ZooKeeper, PostgreSQL
    #: advisory locks). The engine treats such leases as any other: the watchdog still asks
    #: :meth:`Store.renew` on its schedule, and the store answers from its session state
    #: without a round trip (``True`` while the session lives, ``False`` once it was lost).
    SESSION_BOUND = enum.auto()
    #: :meth:`Store.renew` takes many leases and answers in one round trip.
    BATCH_RENEW = enum.auto()
    #: A release publishes a message that waiters can block on (see :meth:`Store.notifier`).
    RELEASE_NOTIFY = enum.auto()
    #: A release wakes the waiters of the same process only (the SQL lease table): the store
    #: has a notifier, but its subscriptions never report ``active``, so waiters keep polling
    #: for releases made elsewhere and are woken early by this process's own.
    LOCAL_NOTIFY = enum.auto()
    #: Every acquisition gets a strictly increasing fencing token per key.
    FENCING = enum.auto()
    #: A ``"lock"`` request may name several keys: all taken at once, or none.
    MULTI_KEY = enum.auto()
    #: After a write, the store can wait for replicas to confirm it (``wait_replicas``).
    REPLICAS = enum.auto()
    #: A fair release hands the lock over itself: a busy fair attempt with a waiter id
    #: registers the lease it would take (token, lease, owner record) with its queue place,
    #: and a release whose wake-up of the first live waiter is received makes that waiter
    #: the owner (a fresh fencing token, its lease, its record) and says so: the
    #: subscription's ``granted`` holds that fencing token (0 for a plain wake-up). A later
    #: fair attempt with the granted token answers acquired with that fencing token and the
    #: lease renewed from then (a waiter that missed the message). A waiter that gives up
    #: gives its token back with :meth:`Store.release` after :meth:`Store.unqueue` (it may
    #: have been granted). The notifiers' ``listening(key, waiter)`` takes a waiter id too
    #: (a fair waiter id reused by a later wait of the process: its channel may still listen).
    FAIR_HANDOFF = enum.auto()


class AcquireRequest(NamedTuple):
    """One acquire attempt, for any kind (a tuple: cheap on the hot path).

    Attributes:
        kind: One of :data:`KINDS`; the store serves only its :attr:`Store.kinds`.
        keys: The key; several (sorted, distinct) for a multi-key ``"lock"``.
        token: The owner token: random, unique per acquisition, never a re-entry.
        lease: Seconds the store keeps the hold without a renewal.
        waiter: A waiter id (from :meth:`Store.waiter_id` or a notifier's ``waiter_id``): a
            busy attempt queues it for a wake-up on release, a successful one takes it off the
            queue. ``None``: a try that does not queue.
        front: Queue at the head (a waiter woken for a release but beaten to it).
        below: For ``"read"``: the token of the write lock the caller holds (a downgrade).
        permits: For ``"semaphore"``: the number of permits the caller expects.
        owner: Who asks: a compact JSON object (host, pid, thread, function, template,
            acquired_at; see :mod:`lockaspect.owner`) that the store keeps with the hold and
            gives back in :attr:`HolderState.owner`; ``""``: nothing recorded (the client's
            ``owner_info=False``). Opaque to the store.
        weight: For ``"semaphore"``: how many permits the hold takes at once (all or none;
            the public ``count=``); 1 for every other kind.
    """

    kind: str
    keys: tuple[str, ...]
    token: str
    lease: float
    waiter: str | None = None
    front: bool = False
    below: str = ""
    permits: int | None = None
    owner: str = ""
    weight: int = 1

    @property
    def key(self) -> str:
        """The (first) key."""
        return self.keys[0]


class AcquireResult(NamedTuple):
    """The store's answer to one acquire attempt: acquired, or busy and what to wait on.

    Attributes:
        acquired: The lock is ours (every key of a multi-key request).
        fencing_token: When acquired, the (first) key's fencing token (0 without FENCING).
        holder_ttl: When busy, the holder's remaining lease in seconds (the retry hint for a
            poller), or ``None`` when the store did not say.
        replicas: When acquired by a store asked to wait for replicas, how many confirmed the
            write in time; else ``None``.
        permits: Semaphores only: the semaphore has this many permits, not the number the
            request expected (nothing was acquired or changed); else ``None``.
        valid_for: When acquired, how long the lease may be trusted, in seconds counted from
            when the request was sent, if shorter than the lease asked for (RedLock takes the
            round trips and a clock-drift allowance off); ``None``: the whole lease.
        fencing_tokens: When acquired, each key's fencing token, in the request's key order
            (a multi-key request; a single key's answer may leave it empty).
        busy: When not acquired, the key to wait on (the busy key of a multi-key request);
            ``None``: the request's (first) key.
        retry_after: When not acquired, the store's advice on when to try again, in seconds,
            if sooner than ``holder_ttl`` says (a store whose waiters poll: the head of a fair
            queue polls often, the others less); ``None``: ``holder_ttl`` bounds the wait.
    """

    acquired: bool
    fencing_token: int = 0
    holder_ttl: float | None = None
    replicas: int | None = None
    permits: int | None = None
    valid_for: float | None = None
    fencing_tokens: tuple[int, ...] = ()
    busy: str | None = None
    retry_after: float | None = None


class ReleaseResult(enum.IntEnum):
    """What a release did (the values are what the Redis scripts return)."""

    NOT_OWNER = 0
    RELEASED = 1
    STILL_HELD = 2


class RenewItem(NamedTuple):
    """One lease the watchdog asks a store to renew."""

    key: str
    token: str
    lease: float
    kind: str = "lock"


#: One renewal's outcome: ``True`` renewed for the whole lease; a ``float``: renewed, valid
#: for that many seconds from when the renewal was sent (RedLock); ``False``: not ours any
#: more (gone, another owner, a foreign value written over the key, a session lost); ``None``:
#: not decided, retry (this item's part of the batch failed on its own).
RenewStatus = bool | float | None


class Subscription(Protocol):
    """A local waiter's registration for release messages of one lock (threads)."""

    def wait(self, timeout: float) -> bool:
        """Block until a release message arrives or ``timeout`` passes; ``True`` if woken by a
        message (or by the notifier failing, so the waiter re-checks at once)."""
        ...

    @property
    def active(self) -> bool:
        """The store confirmed the subscription, so a release will wake us."""
        ...


class AsyncSubscription(Protocol):
    """:class:`Subscription` for one event loop's tasks."""

    async def wait(self, timeout: float) -> bool: ...

    @property
    def active(self) -> bool: ...


class Notifier(Protocol):
    """Delivers release messages to local waiters (one shared connection per client)."""

    #: The id under which this notifier's waiters queue (coalesced waiters of one process).
    waiter_id: str

    def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> Subscription:
        """Register for release messages of ``key`` (for ``waiter``, default :attr:`waiter_id`);
        waits up to ``timeout`` for the store to confirm. An unconfirmed subscription reports
        ``active == False`` and the waiter falls back to bounded polling."""
        ...

    def listening(self, key: str) -> bool:
        """Whether wake-ups of ``key`` already reach this notifier."""
        ...

    def unsubscribe(self, subscription: Subscription) -> None: ...

    def close(self) -> None: ...


class AsyncNotifier(Protocol):
    """:class:`Notifier` for one event loop."""

    waiter_id: str

    async def subscribe(self, key: str, timeout: float, waiter: str | None = None) -> AsyncSubscription: ...

    def listening(self, key: str) -> bool: ...

    def unsubscribe(self, subscription: AsyncSubscription) -> None: ...


@runtime_checkable
class Store(Protocol):
    """A lock store, for threads. Every method is one round trip (or none).

    Holds are counted by the engine: the store keeps one hold per owner token, and a retried
    request with the same token does not add one.
    """

    #: What the store can do.
    capabilities: Capability
    #: The lock kinds it serves (a subset of :data:`KINDS`).
    kinds: frozenset[str]

    def acquire(self, request: AcquireRequest) -> AcquireResult:
        """Try once to take ``request.keys`` for ``request.token`` (see
        :class:`AcquireRequest`). Idempotent for a token that already holds them. A request
        that fails (a timeout, an interrupt) must leave nothing behind: a store that cannot
        know whether it arrived undoes it (the Redis store writes the release behind it on the
        same connection)."""
        ...

    def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        """Give back ``token``'s hold of ``key`` and wake the next waiter: ``RELEASED``, or
        ``NOT_OWNER`` when the store no longer has it for ``token``."""
        ...

    def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        """Whether ``token`` still holds ``key`` (asked on a re-entry; changes nothing)."""
        ...

    def renew(self, leases: Sequence[RenewItem]) -> Sequence[RenewStatus]:
        """Extend ``leases`` (one round trip with BATCH_RENEW); one :data:`RenewStatus` per
        item, in order. Raises :class:`~lockaspect.BackendError` only when the round trip as a
        whole failed (the connection, a timeout)."""
        ...

    def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        """Take ``waiter`` off ``key``'s wait queue: it stopped waiting."""
        ...

    def waiter_id(self, listens: bool) -> str:
        """A fresh id for a waiter with a queue place of its own (fair, read-write and
        multi-key waiters); ``listens``: it will hear release messages (the store may hand a
        free lock to a waiter that does not listen differently)."""
        ...

    def notifier(self) -> Notifier | None:
        """The shared notifier for release messages, or ``None`` without RELEASE_NOTIFY."""
        ...

    def wait_for_replicas(self, replicas: int, timeout: float) -> None:
        """From now on, follow every acquisition with a wait for ``replicas`` replicas (at most
        ``timeout`` seconds) and report the count in :attr:`AcquireResult.replicas`. Raises
        :class:`~lockaspect.ConfigurationError` without REPLICAS or for values the store
        cannot honour (a timeout its connections would not wait for)."""
        ...

    def asyncio_twin(self) -> AsyncStore:
        """A store on the same server and namespace for the running event loop (connections
        belong to one loop); :class:`~lockaspect.ConfigurationError` if it cannot make one."""
        ...

    def threads(self) -> list[threading.Thread]:
        """The threads the store started (a notifier's reader, a session keeper)."""
        ...

    def reset_after_fork(self) -> None:
        """In a forked child: forget what belongs to the parent (threads, connections in use)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncStore(Protocol):
    """:class:`Store` for one event loop: the same operations, awaited."""

    capabilities: Capability
    kinds: frozenset[str]

    async def acquire(self, request: AcquireRequest) -> AcquireResult: ...

    async def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult: ...

    async def reenter(self, key: str, token: str, kind: str = "lock") -> bool: ...

    async def renew(self, leases: Sequence[RenewItem]) -> Sequence[RenewStatus]: ...

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None: ...

    def waiter_id(self, listens: bool) -> str: ...

    def notifier(self) -> AsyncNotifier | None: ...

    async def aclose(self) -> None: ...


#: One key's part of :meth:`ReleasesMany.release_many`: what its release did, or the
#: :class:`~lockaspect.BackendError` of its own release when the store needed several round
#: trips (a cluster's keys over several slots) and that one failed.
ReleaseStatus = ReleaseResult | BackendError


@runtime_checkable
class ReleasesMany(Protocol):
    """The optional part of a MULTI_KEY store that gives a multi-key lock back in one round
    trip. The engine uses it for a multi-key lock's last holds, when the store has it, and
    releases key by key otherwise."""

    def release_many(self, keys: Sequence[str], token: str) -> Sequence[ReleaseStatus]:
        """Give back ``token``'s ``"lock"`` holds of ``keys`` (a multi-key lock's, taken with
        that one token) at once: one :data:`ReleaseStatus` per key, in order, each what
        :meth:`Store.release` of that key alone would answer. A key no longer held by
        ``token`` is ``NOT_OWNER`` and changes nothing; the others are still released, and
        each released key wakes its next waiter (one wake-up per release per key). Raises
        :class:`~lockaspect.BackendError` when the call as a whole failed."""
        ...


@runtime_checkable
class AsyncReleasesMany(Protocol):
    """:class:`ReleasesMany` for an :class:`AsyncStore`."""

    async def release_many(self, keys: Sequence[str], token: str) -> Sequence[ReleaseStatus]: ...


#: How a store reports holds it knows are lost without being asked: ``callback(tokens,
#: reason, keys)`` with the owner tokens, one of the lost reasons (``"not-owner"``,
#: ``"expired"``, ``"session-lost"``) and ``keys``: ``None`` when every hold of those tokens
#: is lost, else the keys of the lost ones (one key of a multi-key set, whose keys share
#: one token). Called from any thread; never blocks.
LossCallback = Callable[[Collection[str], str, "Collection[str] | None"], None]


@runtime_checkable
class ReportsLosses(Protocol):
    """The optional part of a SESSION_BOUND store that learns of losses by itself (a session
    expired, a session's lease estimate ran out, a held node deleted by someone else): the
    engine registers one callback and marks those leases lost at once, fixed leases too,
    instead of waiting for the watchdog's next probe."""

    def report_losses(self, callback: LossCallback) -> None:
        """Call ``callback`` for every later loss (one callback per store; a new one replaces
        the old)."""
        ...


# -- helpers every store may use ----------------------------------------------------------


def new_waiter_id(listens: bool) -> str:
    """A fresh waiter id, unique per waiter: ``"n"`` for a waiter that listens for release
    messages, ``"p"`` for one that polls (a fair release hands a free lock to a polling first
    waiter without waiting for its wake-up), then 64 random bits."""
    return ("n" if listens else "p") + os.urandom(8).hex()


def checked_request(request: AcquireRequest, namespace: str, store: str) -> AcquireRequest:
    """``request`` with its keys prefixed by ``namespace``, or :class:`ConfigurationError` for
    what no store can serve (an unknown kind, no keys, several keys of a kind other than
    ``"lock"``, a lease that is not a positive number, a semaphore without its permits).
    ``store`` names the store in the messages."""
    kind, keys = request.kind, request.keys
    if kind not in KINDS:
        raise ConfigurationError(f"{store} serves {', '.join(sorted(KINDS))}, not {kind!r}")
    if not keys or not all(isinstance(key, str) for key in keys):
        raise ConfigurationError(f"an acquire request needs one or more str keys, got {keys!r}")
    if len(keys) > 1 and kind != "lock":
        raise ConfigurationError(f"only a 'lock' request may name several keys, not {kind!r}", key=keys[0])
    lease = request.lease
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not (0 < lease < math.inf):
        raise ConfigurationError(f"the lease must be a positive number of seconds, got {lease!r}", key=keys[0])
    count = request.weight
    if kind == "semaphore":
        permits = request.permits
        if isinstance(permits, bool) or not isinstance(permits, int) or permits < 0:
            raise ConfigurationError(f"a semaphore request needs its number of permits, got {permits!r}", key=keys[0])
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= max(permits, 1):
            raise ConfigurationError(f"a semaphore request takes 1 to {permits} permits, not {count!r}", key=keys[0])
    elif count != 1:
        raise ConfigurationError(f"only a semaphore request takes several permits, not {kind!r}", key=keys[0])
    if not isinstance(request.owner, str):
        raise ConfigurationError(f"the owner record must be a str, got {request.owner!r}", key=keys[0])
    named = (namespace + keys[0],) if len(keys) == 1 else tuple(namespace + key for key in keys)
    token, waiter, front, below, permits = request.token, request.waiter, request.front, request.below, request.permits
    return AcquireRequest(kind, named, token, lease, waiter, front, below, permits, request.owner, count)


_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redacted(url: str) -> str:
    """``url`` with its password (``user:password@`` or ``?password=``) replaced by ``***``:
    what error messages and reprs show."""
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # The last '@' ends the user info (hosts never hold one), also when the password holds a
    # '/', '?' or '#' that should have been percent-encoded.
    userinfo, at, tail = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}"
