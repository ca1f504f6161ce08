"""The watchdog's record of one lease (:class:`Renewal`): when it ends, when it counts as lost,
its renewal state and timeouts. The user's :class:`~lockaspect.Lease` reads its end and its
loss from here; only the engine and the watchdog write it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from . import _policy
from .backends.base import RenewItem

if TYPE_CHECKING:
    import weakref

    from .lease import Lease
    from .timer import Timeout

__all__ = ["DISPATCH_ALLOWANCE", "Renewal", "lost_guard"]

# Record states. NEW and NEW_FINAL: registered (to be renewed) or watched (a fixed lease), not
# yet on the wheel: the timer thread arms it at its next tick (see Watchdog.register).
ARMED, QUEUED, IN_FLIGHT, FINAL, CLOSED, NEW, NEW_FINAL = range(7)

#: Seconds allowed, on top of one timer tick, for the lost signal to reach the holder (the
#: hook thread, a cancelled task) before the store's lease end: a lease counts as lost this
#: much (plus a tick) before the client's estimate of that end.
DISPATCH_ALLOWANCE: Final = 0.05


def lost_guard(lease: float, tick: float) -> float:
    """How long before the estimated store-side end a lease of ``lease`` seconds counts as
    lost: one tick plus :data:`DISPATCH_ALLOWANCE`, at most half the lease (a lease that
    short cannot keep the full guard; documented)."""
    return min(tick + DISPATCH_ALLOWANCE, lease / 2.0)


class Renewal:
    """The watchdog's record of one lease (the user's :class:`~lockaspect.Lease` is a
    separate, public value that reads its deadline and lost reason from here).

    Attributes:
        ends_at: The client's conservative estimate of the store-side lease end (monotonic):
            when the last confirmed (re)newal request left, plus the lease it asked for.
        lost_at: The local deadline, :func:`lost_guard` before ``ends_at``.
        lost_reason: Why the lease was lost, once it is.
    """

    __slots__ = (
        "attempt",
        "clock",
        "deadline",
        "delay_weight",
        "ends_at",
        "guard",
        "hold_deadline",
        "key",
        "kind",
        "lease_ref",
        "lease_time",
        "lost_at",
        "lost_reason",
        "releasing_since",
        "renewed_at",
        "seen_lost",
        "spare",
        "state",
        "swept",
        "timeout",
        "token",
    )

    def __init__(
        self,
        key: str,
        token: str,
        kind: str,
        lease_time: float,
        delay_weight: float,
        sent: float,
        granted: float,
        max_hold: float | None,
        guard: float,
        clock: Callable[[], float],
    ) -> None:
        self.key = key
        self.token = token
        self.kind = kind
        self.lease_time = lease_time
        self.delay_weight = delay_weight
        self.guard = guard
        self.clock = clock
        self.hold_deadline = None if max_hold is None else sent + max_hold
        self.renewed_at = sent
        self.ends_at = sent + granted
        self.lost_at = self.ends_at - guard
        self.lost_reason: str | None = None
        # When the client began releasing the lease (its last hold given back), if it did.
        self.releasing_since: float | None = None
        # Released by the watchdog's sweep: nobody held it any more.
        self.swept = False
        # Someone read the lease as lost (its local deadline passed): it must stay lost.
        self.seen_lost = False
        self.state = FINAL
        self.timeout: Timeout | None = None
        self.deadline: Timeout | None = None
        # The renewal timeout that last fired, reused for the next one (see _Wheel.readd).
        self.spare: Timeout | None = None
        self.attempt = 0
        self.lease_ref: weakref.ref[Lease] | None = None

    def extend(self, sent: float, granted: float) -> None:
        """A (re)newal sent at ``sent`` was confirmed for ``granted`` seconds."""
        self.renewed_at = sent
        self.ends_at = sent + granted
        self.lost_at = self.ends_at - self.guard

    def time_reason(self) -> str:
        """The reason of a loss by the clock: ``"max-hold"`` when this term was the last one
        ``max_hold`` allowed, else ``"expired"``."""
        hold = self.hold_deadline
        return "max-hold" if hold is not None and self.ends_at >= hold - 1e-6 else "expired"

    def renewal_item(self, sent: float) -> RenewItem:
        seconds = _policy.renewal_lease(sent, self.lease_time, self.hold_deadline)
        return RenewItem(self.key, self.token, seconds, self.kind)

    def __repr__(self) -> str:
        state = ("armed", "queued", "in-flight", "final", "closed", "new", "new-final")[self.state]
        return f"<Renewal {self.key!r} {state}>"
