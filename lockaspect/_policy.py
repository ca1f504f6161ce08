"""Pure lease and wait arithmetic: option validation, renewal schedule, margins, backoff.

Nothing here does I/O or reads a clock; callers pass ``now`` in. Every decision the sync
and (later) async runners make about time lives here, so the twins cannot drift.
"""

from __future__ import annotations

import math
import random
from datetime import timedelta
from typing import Final

from .errors import ConfigurationError

#: The smallest margin, on top of one timer tick, that must remain between the first
#: renewal attempt and the lease end: ``(1 - delay_weight) * lease > tick + MIN_SAFETY_MARGIN``.
#: 100 ms covers a slow round trip on a loaded network, a scheduling hiccup of the watchdog
#: thread, and one retry after a failed attempt. It is a floor, not a recommendation: the
#: default (30 s lease, 0.9) leaves 3 s.
MIN_SAFETY_MARGIN: Final = 0.1

#: First delay before retrying a failed renewal; doubles per attempt up to RETRY_CAP.
RETRY_BASE: Final = 0.025
RETRY_CAP: Final = 0.5

#: Longest a notified waiter sleeps before checking again by itself: a wake-up can be lost
#: (a waiter ahead in the queue gave up just as the lock was released, a message dropped).
NOTIFY_RECHECK: Final = 1.0

#: Bounds for the sleep between acquire attempts when no release message arrives.
POLL_FLOOR: Final = 0.005
POLL_CAP: Final = 2.0

#: A fair lock's queued waiter that made no attempt for this long counts as gone (its process
#: died, or it hangs) and leaves the queue. It holds up the waiters behind it this long, plus
#: until the next of them makes an attempt that notices (up to NOTIFY_RECHECK for a notified
#: waiter, POLL_CAP for a polling one): about 5-6 s, or 7 s. Live waiters attempt at least
#: every NOTIFY_RECHECK (notified) or POLL_CAP (polling), plus a round trip bounded by the
#: socket timeout: well within it.
FAIR_GONE_AFTER: Final = 5.0

#: A fair lock's waiter that nobody receives a wake-up for keeps its place for this long
#: after its last attempt (it may still be subscribing: SUBSCRIBE_TIMEOUT is 1 s); after that
#: the release skips it at once instead of waiting out FAIR_GONE_AFTER.
FAIR_SUBSCRIBE_GRACE: Final = 2.0

#: Longest wait_replicas timeout: WAIT follows every acquire attempt, so it adds to the gap
#: between a waiter's attempts (which FAIR_GONE_AFTER must exceed).
MAX_REPLICA_WAIT: Final = 2.0


def check_wait_replicas(value: object, socket_timeout: float | None) -> tuple[int, float] | None:
    """Validate ``wait_replicas=(replicas, timeout)``: at least one replica, a timeout in
    seconds shorter than the connection's socket timeout (``WAIT`` blocks the read)."""
    if value is None:
        return None
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(f"wait_replicas must be a (replicas, timeout) tuple, got {value!r}")
    replicas, timeout = value
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise TypeError(f"wait_replicas: replicas must be an int, got {type(replicas).__name__}")
    if replicas < 1:
        raise ConfigurationError(f"wait_replicas: replicas must be at least 1, got {replicas}")
    seconds_ = seconds(timeout, "wait_replicas timeout")
    assert seconds_ is not None
    if seconds_ > MAX_REPLICA_WAIT:
        raise ConfigurationError(
            f"wait_replicas: the timeout ({seconds_:g}s) must be at most {MAX_REPLICA_WAIT:g}s: WAIT follows every "
            "acquire attempt, and a fair waiter must attempt well within FAIR_GONE_AFTER"
        )
    if socket_timeout is not None and seconds_ >= socket_timeout:
        raise ConfigurationError(
            f"wait_replicas: the timeout ({seconds_:g}s) must be shorter than the socket timeout "
            f"({socket_timeout:g}s), or the WAIT reply would time out the connection"
        )
    return replicas, seconds_


def seconds(value: object, name: str, *, allow_zero: bool = False, allow_none: bool = False) -> float | None:
    """Validate a duration option and return it in seconds.

    Accepts ``int``, ``float`` and :class:`datetime.timedelta`. Rejects ``bool`` and other
    types with :class:`TypeError`, and NaN, infinities, negatives (and zero unless
    ``allow_zero``) with :class:`ConfigurationError`.
    """
    if value is None:
        if allow_none:
            return None
        raise ConfigurationError(f"{name} must be a number of seconds, not None")
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise TypeError(f"{name} must be seconds as int, float or datetime.timedelta, not {type(value).__name__}")
    try:
        result = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except OverflowError:  # an int too large for a float: reported as not finite below
        result = math.inf
    if math.isnan(result) or math.isinf(result):
        raise ConfigurationError(f"{name} must be a finite number of seconds, got {result!r}")
    if result < 0 or (result == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigurationError(f"{name} must be {bound} seconds, got {result!r}")
    return result


def lease_seconds(value: object) -> float | None:
    """``lease``: ``None`` (watchdog mode) or a positive finite number of seconds."""
    return seconds(value, "lease", allow_none=True)


def wait_seconds(value: object) -> float | None:
    """``wait``: 0 (try once), positive seconds, or ``None`` (wait forever)."""
    return seconds(value, "wait", allow_zero=True, allow_none=True)


def check_delay_weight(delay_weight: object) -> float:
    """``delay_weight`` must be a float strictly between 0 and 1."""
    if isinstance(delay_weight, bool) or not isinstance(delay_weight, (int, float)):
        raise TypeError(f"delay_weight must be a float in (0, 1), not {type(delay_weight).__name__}")
    try:
        weight = float(delay_weight)
    except OverflowError:  # an int too large for a float: out of range below
        weight = math.inf
    if not 0.0 < weight < 1.0:  # also rejects NaN
        raise ConfigurationError(f"delay_weight must be in (0, 1), got {weight!r}")
    return weight


def check_margin(lease: float, delay_weight: float, tick: float) -> None:
    """Require ``(1 - delay_weight) * lease > tick + MIN_SAFETY_MARGIN``.

    The first renewal is attempted at ``delay_weight * lease``; what remains of the lease
    must absorb up to one tick of timer lateness, the round trip, and a retry.
    """
    margin = (1.0 - delay_weight) * lease
    needed = tick + MIN_SAFETY_MARGIN
    if margin <= needed:
        raise ConfigurationError(
            f"delay_weight={delay_weight:g} leaves (1 - {delay_weight:g}) * {lease:g}s = {margin:.3f}s "
            f"between the first renewal attempt and the end of the lease; it must exceed "
            f"tick {tick:g}s + safety margin {MIN_SAFETY_MARGIN:g}s = {needed:.3f}s. "
            f"Lower delay_weight or lengthen the lease."
        )


#: The default delay_weight, from the original aspect design (Redisson renews at 1/3).
DEFAULT_DELAY_WEIGHT: Final = 0.9


def default_delay_weight(lease: float, tick: float) -> float:
    """The delay_weight a client uses when none is given: 0.9, or for a lease too short to
    leave the required margin after 0.9, the weight that leaves twice that margin.

    Raises :class:`ConfigurationError` when the lease cannot leave even that.
    """
    needed = tick + MIN_SAFETY_MARGIN
    if (1.0 - DEFAULT_DELAY_WEIGHT) * lease > needed:
        return DEFAULT_DELAY_WEIGHT
    weight = 1.0 - 2.0 * needed / lease
    if weight <= 0.0:
        raise ConfigurationError(
            f"watchdog_lease {lease:g}s is too short: a renewal must leave more than tick {tick:g}s + "
            f"safety margin {MIN_SAFETY_MARGIN:g}s = {needed:.3f}s before the lease ends; use a lease "
            f"above {2 * needed:.3f}s"
        )
    return weight


def first_renewal_at(renewed_at: float, lease: float, delay_weight: float) -> float:
    """When to attempt the next renewal, counted from the last successful (re)newal."""
    return renewed_at + delay_weight * lease


def renewal_retry_at(now: float, attempt: int, expires_at: float, tick: float) -> float | None:
    """When to retry a failed renewal, or ``None`` when no retry fits before the lease end.

    Exponential backoff from :data:`RETRY_BASE` capped at :data:`RETRY_CAP`, never later
    than a third of what remains, and never sooner than one tick (the timer's resolution).
    """
    remaining = expires_at - now
    if remaining <= tick:
        return None
    delay = min(RETRY_BASE * (1 << min(attempt, 16)), RETRY_CAP, remaining / 3.0)
    return now + max(delay, tick)


def renewal_lease(now: float, lease: float, hold_deadline: float | None) -> float:
    """The lease to ask for on renewal: the full lease, cut so it ends at ``max_hold``."""
    if hold_deadline is None:
        return lease
    return min(lease, hold_deadline - now)


def wait_deadline(start: float, wait: float | None) -> float | None:
    """The monotonic instant after which an acquire stops retrying (``None`` = never)."""
    return None if wait is None else start + wait


def retry_sleep(
    *,
    now: float,
    deadline: float | None,
    holder_ttl: float | None,
    attempt: int,
    notified: bool,
    rng: random.Random | None = None,
) -> float:
    """How long a waiter sleeps before its next acquire attempt.

    With release notifications (``notified``) the waiter sleeps until the holder's lease
    would end (the PTTL hint), at most :data:`NOTIFY_RECHECK`, because a release wakes it
    earlier; the bound only guards against a lost wake-up. Without notifications it backs off
    exponentially from :data:`POLL_FLOOR`, never past the hint or :data:`POLL_CAP`. The
    result never passes the wait deadline and is never negative.
    """
    jitter = (rng or random).random()
    backoff = min(POLL_FLOOR * (1 << min(attempt, 16)), POLL_CAP)
    if holder_ttl is None or holder_ttl <= 0:
        holder_ttl = backoff
    if notified:  # a release wakes us; recheck now and then in case the wake-up was lost
        sleep = min(holder_ttl, NOTIFY_RECHECK) * (1.0 + 0.1 * jitter)
    else:  # polling: jittered backoff, never past the hint
        sleep = min(holder_ttl, backoff) * (0.5 + 0.5 * jitter)
    sleep = max(sleep, POLL_FLOOR * jitter)
    if deadline is not None:
        sleep = min(sleep, deadline - now)
    return max(sleep, 0.0)


def client_settings(watchdog_lease: object, tick: object, delay_weight: object) -> tuple[float, float, float]:
    """A client's ``watchdog_lease``, ``tick`` and default ``delay_weight``, checked (the
    default weight depends on the lease and the tick, see :func:`default_delay_weight`)."""
    lease = seconds(watchdog_lease, "watchdog_lease")
    tick_s = seconds(tick, "tick")
    assert lease is not None
    assert tick_s is not None
    if tick_s >= lease:
        raise ConfigurationError(f"tick ({tick_s:g}s) must be shorter than watchdog_lease ({lease:g}s)")
    if delay_weight is None:
        return lease, tick_s, default_delay_weight(lease, tick_s)
    weight = check_delay_weight(delay_weight)
    check_margin(lease, weight, tick_s)
    return lease, tick_s, weight
