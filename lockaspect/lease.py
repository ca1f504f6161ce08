"""The :class:`Lease` a locked call holds, and :func:`current_lease`.

Ownership follows the logical call chain, not the thread: the leases held by the calls
that are running are kept in a :mod:`contextvars` stack. A nested locked call on the same
key and client finds its lease there and re-enters it, whichever thread an executor moved
it to; an unrelated thread starts with an empty stack and never shares a hold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

from .errors import LockLost

if TYPE_CHECKING:
    from .timer import Timeout

__all__ = ["Lease", "current_lease"]


class _Held:
    """One frame of the held-lease stack: an immutable linked list, so that a copied
    context (executor, task) never sees a later push or pop of its parent, and a push costs
    O(1) memory (a tuple per push would keep every shorter tuple alive through the
    ContextVar tokens: quadratic in the nesting depth)."""

    __slots__ = ("lease", "parent")

    def __init__(self, lease: Lease, parent: _Held | None) -> None:
        self.lease = lease
        self.parent = parent


# The innermost held lease, linked to the ones around it.
_HELD: ContextVar[_Held | None] = ContextVar("lockaspect_held", default=None)

# One lock for all leases' small bookkeeping (hold counts, the lost flag): the critical
# sections are a few bytecodes, and a lock per lease would cost memory per held lock.
_BOOKKEEPING = threading.Lock()

# Watchdog states (see watchdog.py).
IDLE, ARMED, QUEUED, IN_FLIGHT, FINAL, CLOSED = range(6)


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
        "_attempt",
        "_batch",
        "_client",
        "_deadline",
        "_delay_weight",
        "_epoch",
        "_expires_at",
        "_hold_deadline",
        "_holds",
        "_lost_reason",
        "_lost_waiters",
        "_on_lost",
        "_renewed_at",
        "_renewer",
        "_timeout",
        "_wd_state",
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
        *,
        client: Any,
        key: str,
        token: str,
        fencing_token: int,
        lease_time: float,
        watchdog: bool,
        delay_weight: float,
        sent_at: float,
        max_hold: float | None,
        on_lost: Callable[[Lease], object] | None,
        renewer: Any = None,
        kind: str = "lock",
        permits: int | None = None,
    ) -> None:
        self.key = key
        self.kind = kind
        self.permits = permits
        self.token = token
        self.fencing_token = fencing_token
        self.acquired_at = time.time()
        self.lease_time = lease_time
        self.watchdog = watchdog
        self._client = client
        # A forked child inherits its parent's contexts; leases from before the fork belong
        # to the parent and must never be re-entered by the child (see _find_held).
        self._epoch = client._epoch
        self._delay_weight = delay_weight
        # Local, conservative estimate: the store started the lease after it received the
        # request, which was after ``sent_at``.
        self._renewed_at = sent_at
        self._expires_at = sent_at + lease_time
        self._hold_deadline = None if max_hold is None else sent_at + max_hold
        self._holds = 1
        self._lost_reason: str | None = None
        self._lost_waiters: list[Callable[[], object]] | None = None
        self._on_lost = on_lost
        # The event loop's renewer for a lease taken by async code; None for sync code.
        self._renewer = renewer
        self._wd_state = IDLE
        self._timeout: Timeout | None = None
        self._deadline: Timeout | None = None
        self._batch: Any = None
        self._attempt = 0

    @property
    def fair(self) -> bool:
        """``True`` for a fair lock (its release wakes the fair queue's first waiter)."""
        return self.kind == "fair"

    @property
    def lost(self) -> bool:
        """``True`` once the lease is known to be gone, or its local deadline has passed."""
        if self._lost_reason is not None:
            return True
        return self._client._clock() >= self._expires_at and self._holds > 0

    @property
    def held(self) -> bool:
        """``True`` while the call that took the lease has not released it and it is not lost
        (and in the process that took it: a forked child holds nothing)."""
        return self._holds > 0 and not self.lost and self._epoch == self._client._epoch

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost (``"not-owner"``, ``"expired"``, ``"max-hold"``), or ``None``."""
        if self._lost_reason is None and self.lost:
            return "expired"
        return self._lost_reason

    @property
    def expires_in(self) -> float:
        """Seconds until the lease ends unless renewed (negative once past)."""
        return float(self._expires_at - self._client._clock())

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
        if self._epoch != self._client._epoch:
            raise LockLost(
                f"lease on {self.key!r} belongs to the process this one was forked from",
                key=self.key,
                reason="forked",
                lease=self,
            )

    def __repr__(self) -> str:
        state = f"lost:{self.lost_reason}" if self.lost else ("held" if self._holds > 0 else "released")
        return f"<Lease key={self.key!r} fencing_token={self.fencing_token} watchdog={self.watchdog} {state}>"

    # -- internal ---------------------------------------------------------------------

    def _mark_lost(self, reason: str) -> bool:
        """Flip to lost; ``True`` for the caller that flipped it (it runs the hooks)."""
        with _BOOKKEEPING:
            if self._lost_reason is not None:
                return False
            self._lost_reason = reason
            waiters, self._lost_waiters = self._lost_waiters, None
        for wake in waiters or ():
            wake()
        return True

    def _add_lost_waiter(self, wake: Callable[[], object]) -> None:
        with _BOOKKEEPING:
            if self._lost_reason is None:
                if self._lost_waiters is None:
                    self._lost_waiters = []
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

    def _enter(self) -> None:
        with _BOOKKEEPING:
            self._holds += 1

    def _exit(self) -> bool:
        """Drop one hold; ``True`` when it was the last one."""
        with _BOOKKEEPING:
            self._holds -= 1
            return self._holds == 0


def current_lease() -> Lease | None:
    """The :class:`Lease` of the innermost locked call running in this context, or ``None``.

    Inside a decorated function (or a ``with client.lock(...)`` block) this is the lease the
    call holds, also when an executor runs the body in another thread: the context travels
    with it. Threads you start yourself begin with an empty context and see ``None``.
    """
    held = _HELD.get()
    return None if held is None else held.lease


def _push(lease: Lease) -> Token[_Held | None]:
    return _HELD.set(_Held(lease, _HELD.get()))


def _family(kind: str) -> str:
    """Kinds that share one store entry re-enter each other: the lock and the fair lock."""
    return "lock" if kind == "fair" else kind


def _find_held(client: Any, key: str, kind: str = "lock") -> Lease | None:
    """The innermost lease of ``kind`` (or of its family, see :func:`_family`) this context
    holds on ``key`` through ``client``."""
    family = _family(kind)
    held = _HELD.get()
    while held is not None:
        lease = held.lease
        if (
            lease._client is client
            and lease.key == key
            and _family(lease.kind) == family
            and lease._holds > 0
            and lease._epoch == client._epoch
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
