"""The :class:`Lease` a locked call holds, and :func:`current_lease`.

Ownership follows the logical call chain, not the thread: the leases held by the calls
that are running are kept in a :mod:`contextvars` stack. A nested locked call on the same
key and client finds its lease there and re-enters it, whichever thread an executor moved
it to; an unrelated thread starts with an empty stack and never shares a hold.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

from .errors import LockLost

if TYPE_CHECKING:
    import asyncio

    from .renewal import Renewal

__all__ = ["Lease", "current_lease"]


class _Held:
    """One frame of the held-lease stack: an immutable linked list, so that a copied
    context (executor, task) never sees a later push or pop of its parent, and a push costs
    O(1) memory (a tuple per push would keep every shorter tuple alive through the
    ContextVar tokens: quadratic in the nesting depth)."""

    __slots__ = ("lease", "parent", "ref")

    def __init__(self, lease: Lease | None, parent: _Held | None, ref: weakref.ref[Lease] | None = None) -> None:
        # A block's frame holds its lease; a client.acquire() lease's frame only refers to it
        # (the lease may be released in another context, and its handle must be collectable).
        self.lease = lease
        self.parent = parent
        self.ref = ref

    def get(self) -> Lease | None:
        return self.lease if self.ref is None else self.ref()


# The innermost held lease, linked to the ones around it.
_HELD: ContextVar[_Held | None] = ContextVar("lockaspect_held", default=None)

# One lock for all leases' lost-flag bookkeeping: the critical sections are a few bytecodes,
# and a lock per lease would cost memory per held lock. A plain Lock entered with ``with``
# (a C-level __enter__), so an exception raised asynchronously (a signal handler) cannot
# leave it held. Replaced in a forked child (see _after_fork_in_child).
_BOOKKEEPING = threading.Lock()

# Bumped in a forked child: leases from before the fork are the parent's.
_EPOCH = 0


class Lease:
    """A held lock: who holds it, its fencing token, and whether it is still safe.

    A ``Lease`` is what ``with client.lock(...) as lease`` yields and what
    :func:`current_lease` returns inside a decorated call.

    Attributes:
        key: The rendered key, e.g. ``"order:42"`` (without the store namespace).
        token: The random owner token (128 bits, hex) that the store compares on renew
            and release.
        fencing_token: An integer strictly larger than every fencing token issued before
            for this key. Pass it to the resource you write to so it can reject writes
            from a holder whose lease ended (see :mod:`lockaspect.fencing`).
        acquired_at: Wall-clock time of the acquisition (``time.time()``).
        lease_time: Seconds of lease asked for at each (re)newal.
        watchdog: ``True`` when the watchdog renews the lease until the call completes.
        kind: ``"lock"``, ``"fair"`` (a fair lock), ``"semaphore"`` (a semaphore permit),
            ``"read"`` or ``"write"`` (a read-write lock's read or write hold).
        permits: For a semaphore permit, the semaphore's number of permits; ``None`` for a
            lock.
    """

    __slots__ = (
        "__weakref__",
        "_epoch",
        "_family",
        "_loop",
        "_lost_waiters",
        "_on_lost",
        "_owner",
        "_record",
        "_refs",
        "_since",
        "_template",
        "acquired_at",
        "fencing_token",
        "key",
        "kind",
        "lease_time",
        "permits",
        "token",
        "watchdog",
    )

    def __init__(
        self,
        owner: object,
        record: Renewal,
        fencing_token: int,
        watchdog: bool,
        on_lost: Callable[[Lease], object] | None,
        loop: asyncio.AbstractEventLoop | None = None,
        permits: int | None = None,
        family: str = "lock",
        template: str = "",
    ) -> None:
        self.key = record.key
        self.kind = record.kind
        self.permits = permits
        self.token = record.token
        self.fencing_token = fencing_token
        self.acquired_at = time.time()
        self.lease_time = record.lease_time
        self.watchdog = watchdog
        # Whose lease it is (the engine of one client), and its fork epoch then: a forked child
        # inherits its parent's contexts, and leases from before the fork belong to the parent
        # and must never be re-entered by the child (see find_held).
        self._owner = owner
        self._epoch = _EPOCH
        # Kinds that share one store entry re-enter each other (see lockaspect.kinds).
        self._family = family
        # The watchdog's record of this lease: its local end and why it was lost.
        self._record = record
        # The holds of this lease not yet given back (the acquisition and its re-entries), as
        # the client's records of them: counted in this one place, under the client's
        # bookkeeping lock, each added or removed in one step. The store keeps one hold per
        # owner. A list (88 bytes with one hold; a set takes 216): there are few, and every
        # held lock has one.
        self._refs: list[Any] = []
        self._lost_waiters: list[Callable[[], object]] | None = None
        self._on_lost = on_lost
        # The event loop of the code that took the lease (an async on_lost hook runs there);
        # None for sync code.
        self._loop = loop
        # For the observers: the decorated call's key template (see LockEvent.template), and
        # when the acquisition was sent, by the engine's clock (how long it was held).
        self._template = template
        self._since = record.renewed_at

    def _held_for(self) -> float:
        """Seconds since the acquisition was sent."""
        return self._record.clock() - self._since

    @property
    def _holds(self) -> int:
        return len(self._refs)

    @property
    def fair(self) -> bool:
        """``True`` for a fair lock (its release wakes the fair queue's first waiter)."""
        return self.kind == "fair"

    @property
    def lost(self) -> bool:
        """``True`` once the lease is known to be gone, or its local deadline has passed.

        The local deadline comes a safety guard (one timer tick plus 50 ms) before the
        store's lease end as the client estimates it, so a body that polls this (or
        :meth:`check`) and an ``on_lost`` hook both learn of the loss before another
        process can take the lock."""
        record = self._record
        if record.lost_reason is not None:
            return True
        if self._holds > 0 and record.clock() >= record.lost_at:
            # Once anyone was told, it stays lost: a renewal confirmed late must not revive it.
            record.seen_lost = True
            return True
        return False

    @property
    def held(self) -> bool:
        """``True`` while the call that took the lease has not released it and it is not lost
        (and in the process that took it: a forked child holds nothing)."""
        return self._holds > 0 and not self.lost and self._epoch == _EPOCH

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost (``"not-owner"``, ``"expired"``, ``"max-hold"``), or ``None``."""
        record = self._record
        reason = record.lost_reason
        if reason is None and self.lost:
            return record.time_reason()
        return reason

    @property
    def expires_in(self) -> float:
        """Seconds until the lease's local deadline (see :attr:`lost`) unless renewed
        (negative once past)."""
        record = self._record
        return float(record.lost_at - record.clock())

    def check(self) -> None:
        """Raise :class:`~lockaspect.LockLost` unless the lease is still held; a cheap local
        check, no I/O.

        Call it from long-running synchronous bodies between steps: Python cannot
        interrupt a thread, so this is how a sync body learns that it lost the lock. It
        also raises (reason ``"released"``) for a lease whose call already released it,
        e.g. in a thread that shared the call's context and outlived it, and (reason
        ``"forked"``) in a child process forked while the lease was held.
        """
        if self.lost:
            reason = self.lost_reason or "expired"
            raise LockLost(f"lease on {self.key!r} lost ({reason})", key=self.key, reason=reason, lease=self)
        if self._holds <= 0:
            raise LockLost(
                f"lease on {self.key!r} was released; this code no longer runs under the lock",
                key=self.key,
                reason="released",
                lease=self,
            )
        if self._epoch != _EPOCH:
            raise LockLost(
                f"lease on {self.key!r} belongs to the process this one was forked from",
                key=self.key,
                reason="forked",
                lease=self,
            )

    def __repr__(self) -> str:
        state = f"lost:{self.lost_reason}" if self.lost else ("held" if self._holds > 0 else "released")
        return f"<Lease key={self.key!r} fencing_token={self.fencing_token} watchdog={self.watchdog} {state}>"

    # -- acting on the lease (store round trips: lockaspect.engine.manual) -----------------

    @property
    def hold_count(self) -> int:
        """How many holds of this lease are not given back: 1 for the acquisition, plus one
        per re-entry (a nested block, call or ``client.acquire`` of the key in this context);
        0 once released. Local: no I/O."""
        return self._holds

    def release(self) -> None:
        """Give back this hold now; the last one releases the lock in the store (one round
        trip) and stops its renewal.

        A lease from :meth:`LockClient.acquire <lockaspect.LockClient.acquire>` gives back the
        hold that call took; a ``with`` block's lease gives back its most recent hold, and
        the block's exit then does nothing. Raises :class:`~lockaspect.LockLost` when the lease
        was already released (reason ``"released"``) or was lost before the release (its
        reason: the store no longer had it for this owner, or its lease ran out), and
        :class:`~lockaspect.BackendError` when the store could not be reached (the key then
        expires with its lease)."""
        self._hand().release(self)

    async def arelease(self) -> None:
        """:meth:`release` for asyncio."""
        await self._hand().arelease(self)

    def extend(self, seconds: float, *, replace: bool = False) -> None:
        """Add ``seconds`` to this fixed lease (``lease=...``), or with ``replace=True`` make it
        end ``seconds`` from now; one round trip.

        The local lease end moves too, so the lease is not declared lost at its old end.
        Raises :class:`~lockaspect.LockLost` when the store says the lock is not this owner's
        any more (or the lease is lost or released already), :class:`~lockaspect.ConfigurationError`
        for a watchdog lease (the watchdog renews it: use ``lease=`` for a fixed one) or a
        ``seconds`` that is not a positive number (nothing sent). On a store whose holds last
        as long as a session (ZooKeeper, PostgreSQL advisory locks) only the local end moves."""
        self._hand().extend(self, seconds, replace)

    async def aextend(self, seconds: float, *, replace: bool = False) -> None:
        """:meth:`extend` for asyncio."""
        await self._hand().aextend(self, seconds, replace)

    def owned(self) -> bool:
        """Whether the store still has this lock for this lease's owner token: a round trip
        (:attr:`held` is the local, free answer). ``False`` also marks a held lease lost."""
        return bool(self._hand().owned(self))

    async def aowned(self) -> bool:
        """:meth:`owned` for asyncio."""
        return bool(await self._hand().aowned(self))

    def remaining(self) -> float:
        """The store's remaining lease for this owner, in seconds (a round trip; the local,
        more conservative estimate is :attr:`expires_in`): 0.0 once the store no longer has it
        for this owner, ``math.inf`` for a hold that lasts as long as a session."""
        return float(self._hand().remaining(self))

    async def aremaining(self) -> float:
        """:meth:`remaining` for asyncio."""
        return float(await self._hand().aremaining(self))

    # -- internal ---------------------------------------------------------------------

    def _hand(self) -> Any:
        """The engine's hand operations (lockaspect.engine.manual: the lease is below the engine)."""
        owner: Any = self._owner
        return owner.hand

    def _mark_lost(self, reason: str, tell: Callable[[], object] | None = None) -> bool:
        """Flip to lost; ``True`` for the caller that flipped it (it runs the hooks). ``tell``
        (the observers' ``lost`` event) runs before the waiters are woken: a woken body ends
        and releases, and its ``released`` must not come before the ``lost`` that caused it."""
        with _BOOKKEEPING:
            record = self._record
            if record.lost_reason is not None:
                return False
            record.lost_reason = reason
            waiters, self._lost_waiters = self._lost_waiters, None
        try:
            if tell is not None:
                tell()
        finally:
            for wake in waiters or ():
                wake()
        return True

    def _add_lost_waiter(self, wake: Callable[[], object]) -> None:
        with _BOOKKEEPING:
            if self._record.lost_reason is None:
                if self._lost_waiters is None:
                    self._lost_waiters = [wake]  # sized for one: most leases have one waiter
                else:
                    self._lost_waiters.append(wake)
                return
        wake()

    def _remove_lost_waiter(self, wake: Callable[[], object]) -> None:
        with _BOOKKEEPING:
            waiters = self._lost_waiters
            if waiters is not None:
                try:
                    waiters.remove(wake)
                except ValueError:
                    pass


def current_lease(key: str | None = None) -> Lease | None:
    """The :class:`Lease` of the innermost locked call running in this context, or ``None``;
    with ``key``, the lease this context holds on ``key`` (at any depth, of any client), or
    ``None`` (Redisson's ``isHeldByCurrentThread``).

    Inside a decorated function (or a ``with client.lock(...)`` block) this is the lease the
    call holds, also when an executor runs the body in another thread: the context travels
    with it; a lease taken with ``client.acquire()`` counts from there until it is released.
    Threads you start yourself begin with an empty context and see ``None``.
    """
    held = _HELD.get()
    while held is not None:
        lease = held.get()
        if lease is not None:
            if key is None:
                return lease  # the innermost call's, released or not (see Lease.check)
            if lease.key == key and lease.held and not getattr(lease._owner, "closed", False):
                return lease
        held = held.parent
    return None


def _push(lease: Lease) -> Token[_Held | None]:
    return _HELD.set(_Held(lease, _HELD.get()))


def _push_weak(lease: Lease) -> None:
    """Put a ``client.acquire()`` lease on this context's stack (popped by :func:`_pop_released`)."""
    _HELD.set(_Held(None, _HELD.get(), weakref.ref(lease)))


def _pop_released() -> None:
    """Drop the ``client.acquire()`` frames at the top of this context's stack whose lease has
    no hold left (a block's frames are its own to reset)."""
    top = held = _HELD.get()
    while held is not None and held.ref is not None:
        lease = held.ref()
        if lease is not None and lease._holds > 0:
            break
        held = held.parent
    if held is not top:
        _HELD.set(held)


def fork_epoch() -> int:
    """How many forks this process is from the one that imported lockaspect (a lease taken
    before a fork belongs to the parent)."""
    return _EPOCH


def find_held(owner: object, key: str, family: str) -> Lease | None:
    """The innermost lease of ``family`` (see :mod:`lockaspect.kinds`) this context holds on
    ``key`` through ``owner`` in this process."""
    held = _HELD.get()
    while held is not None:
        lease = held.get()
        if (
            lease is not None
            and lease._owner is owner
            and lease.key == key
            and lease._family == family
            and lease._holds > 0
            and lease._epoch == _EPOCH
        ):
            return lease
        held = held.parent
    return None


class MultiLease:
    """The leases of a multi-key lock (see :meth:`LockClient.multi_lock
    <lockaspect.LockClient.multi_lock>`): one :class:`Lease` per key, taken all at once under
    one owner token and renewed together.

    Attributes:
        keys: The keys, deduplicated and sorted (the order they are taken and listed in).
        leases: Each key's lease, in the same order.
    """

    __slots__ = ("keys", "leases")

    def __init__(self, leases: Sequence[Lease]) -> None:
        self.leases = tuple(leases)
        self.keys = tuple(lease.key for lease in self.leases)

    @property
    def fencing_tokens(self) -> dict[str, int]:
        """Each key's fencing token: pass each resource the token of its key."""
        return {lease.key: lease.fencing_token for lease in self.leases}

    @property
    def lost(self) -> bool:
        """``True`` once any of the keys' leases is lost."""
        return any(lease.lost for lease in self.leases)

    @property
    def lost_reason(self) -> str | None:
        """The first lost lease's reason, or ``None``."""
        for lease in self.leases:
            if lease.lost:
                return lease.lost_reason or "expired"
        return None

    @property
    def held(self) -> bool:
        """``True`` while every key's lease is held."""
        return all(lease.held for lease in self.leases)

    def check(self) -> None:
        """Raise :class:`~lockaspect.LockLost` unless every key's lease is held (see
        :meth:`Lease.check`)."""
        for lease in self.leases:
            lease.check()

    def __repr__(self) -> str:
        state = "held" if self.held else (f"lost:{self.lost_reason}" if self.lost else "released")
        return f"<MultiLease {list(self.keys)!r} {state}>"


def _after_fork_in_child() -> None:
    # The parent's lock may have been held by another thread at the fork: a child that
    # inherited it held would deadlock on its first release.
    global _BOOKKEEPING, _EPOCH
    _BOOKKEEPING = threading.Lock()
    _EPOCH += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
