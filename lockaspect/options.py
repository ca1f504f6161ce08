"""Lock options (provisional)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import _policy
from .errors import ConfigurationError
from .kinds import LockKind, kind_for
from .lease import Lease

__all__ = ["WAIT_STRATEGIES", "LockSpec", "OnLost"]

WAIT_STRATEGIES = ("notify", "poll")

OnLost = Callable[[Lease], object]


@dataclass(frozen=True, slots=True)
class LockSpec:
    """Validated lock options, shared by the decorator and ``client.lock``.

    Attributes:
        lease: Seconds of fixed lease, or ``None`` for watchdog mode.
        delay_weight: First renewal attempt at ``delay_weight * lease``; ``None`` takes
            the client's default.
        wait: Seconds to wait for the lock; 0 tries once; ``None`` waits forever.
        max_hold: Stop renewing after this many seconds; the lease then ends and is lost.
        on_lost: Called once with the lease when it is lost.
        wait_strategy: ``"notify"``: waiters wake on the release message (falling back to
            bounded polling when pub/sub is unavailable); ``"poll"``: jittered polling
            bounded by the holder's remaining lease, for stores or proxies without pub/sub.
        fair: A fair lock: callers get it in the order they asked (see
            :meth:`LockClient.fair_lock`).
        permits: A semaphore with this many permits (see :meth:`LockClient.semaphore`);
            ``None`` for a lock.
        mode: ``"read"`` or ``"write"`` for a read-write lock (see
            :meth:`LockClient.rw_lock`); ``None`` for a lock.
    """

    lease: float | None = None
    delay_weight: float | None = None
    wait: float | None = 0.0
    max_hold: float | None = None
    on_lost: OnLost | None = None
    wait_strategy: str = "notify"
    fair: bool = False
    permits: int | None = None
    mode: str | None = None

    @property
    def kind(self) -> LockKind:
        """The lock kind these options name (see :mod:`lockaspect.kinds`)."""
        return kind_for(self.fair, self.permits, self.mode)

    @classmethod
    def create(
        cls,
        *,
        lease: object = None,
        delay_weight: object = None,
        wait: object = 0.0,
        max_hold: object = None,
        on_lost: object = None,
        wait_strategy: object = "notify",
        fair: object = False,
        permits: object = None,
        mode: object = None,
    ) -> LockSpec:
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"on_lost must be callable, got {type(on_lost).__name__}")
        if wait_strategy not in WAIT_STRATEGIES:
            if not isinstance(wait_strategy, str):
                raise TypeError(f"wait_strategy must be a str, got {type(wait_strategy).__name__}")
            raise ConfigurationError(f"wait_strategy must be 'notify' or 'poll', got {wait_strategy!r}")
        if not isinstance(fair, bool):
            raise TypeError(f"fair must be a bool, got {type(fair).__name__}")
        if permits is not None:
            if isinstance(permits, bool) or not isinstance(permits, int):
                raise TypeError(f"permits must be an int, got {type(permits).__name__}")
            if permits < 1:
                raise ConfigurationError(f"permits must be at least 1, got {permits}")
            if fair:
                raise ConfigurationError("a semaphore cannot be fair (fair=True with permits)")
        if mode is not None:
            if not isinstance(mode, str):
                raise TypeError(f"mode must be a str, got {type(mode).__name__}")
            if mode not in ("read", "write"):
                raise ConfigurationError(f"mode must be 'read' or 'write', got {mode!r}")
            if fair or permits is not None:
                raise ConfigurationError("a read-write lock (mode=) cannot also be fair or a semaphore")
        return cls(
            lease=_policy.lease_seconds(lease),
            delay_weight=None if delay_weight is None else _policy.check_delay_weight(delay_weight),
            wait=_policy.wait_seconds(wait),
            max_hold=_policy.seconds(max_hold, "max_hold", allow_none=True),
            on_lost=on_lost,
            wait_strategy=str(wait_strategy),
            fair=fair,
            permits=permits,
            mode=mode,
        )
