"""How a locked call or block ends: the body's outcome settled into its result or
:class:`~lockaspect.LockLost`, built in one place (:func:`lost_error`)."""

from __future__ import annotations

from typing import Any

from ..errors import _NO_RESULT, LockLost
from ..executor import Outcome
from ..lease import Lease

__all__ = ["lost_error", "raise_if_lost", "settle"]


def lost_error(lease: Lease, when: str, exception: BaseException | None = None, result: Any = _NO_RESULT) -> LockLost:
    """The one :class:`LockLost` factory: ``lease`` was lost, then ``when`` (e.g. " before the
    call completed", "; the body was cancelled"), with the body's exception or result if it
    has one."""
    reason = lease.lost_reason or "expired"
    return LockLost(
        f"lease on {lease.key!r} lost ({reason}){when}",
        key=lease.key,
        reason=reason,
        lease=lease,
        result=result,
        exception=exception,
    )


def settle(lease: Lease, outcome: Outcome) -> Any:
    """Turn a finished (or abandoned) body into the call's result or exception."""
    if outcome.interrupt is not None:
        raise outcome.interrupt
    exception = outcome.exception
    if outcome.abandoned or lease.lost:
        when = (
            " while the body was still running; it keeps running in its executor"
            if outcome.abandoned
            else " before the call completed"
        )
        finished = exception is None and not outcome.abandoned
        raise lost_error(lease, when, exception, outcome.result if finished else _NO_RESULT) from exception
    if exception is not None:
        raise exception
    return outcome.result


def raise_if_lost(lease: Lease, exc: BaseException | None) -> None:
    """At the end of a block: raise :class:`LockLost` if the lease was lost meanwhile (chained
    to the block's own exception; a ``BaseException`` such as a cancellation wins)."""
    if lease.lost and (exc is None or isinstance(exc, Exception)):
        raise lost_error(lease, " before the block completed", exc) from exc
