"""Acting on a lease by hand: the round trips behind :meth:`Lease.release
<lockaspect.Lease.release>`, ``extend``, ``owned`` and ``remaining`` (sync and asyncio, every
decision shared), and :class:`Handle`, the lease :meth:`LockClient.acquire
<lockaspect.LockClient.acquire>` and :meth:`~lockaspect.LockClient.adopt` return.

A ``with`` block or a decorated call owns its hold and gives it back itself; a lease taken by
``client.acquire()`` is given back by ``lease.release()``, wherever that runs. The
:class:`Handle` is that lease as the caller sees it: the same state as the engine's lease (the
same holds, the same record, so ``lost``, ``held`` and re-entries agree), plus the one hold its
call took. A handle dropped without a release is reported when it is collected, and its hold
is given back by the watchdog's sweep.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from ..backends.base import AdminStore, AsyncAdminStore, KeyState, ReleaseResult, RenewItem
from ..errors import BackendError, ConfigurationError, LockLost
from ..lease import Lease, _pop_released, fork_epoch
from .holds import Hold
from .outcome import lost_error

__all__ = ["Handle", "arelease", "release"]

log = logging.getLogger("lockaspect.release")

_SHARED = (
    "_epoch", "_family", "_loop", "_on_lost", "_owner", "_record", "_refs", "acquired_at", "fencing_token",
    "key", "kind", "lease_time", "permits", "token", "watchdog",
)  # fmt: skip


class Handle(Lease):
    """The lease a ``client.acquire()`` (or ``client.adopt()``) call returns: the engine's
    lease, seen through the one hold that call took (see the module docstring)."""

    __slots__ = ("_base", "_hold")

    def __init__(self, hold: Hold) -> None:
        base = hold.lease
        for name in _SHARED:
            object.__setattr__(self, name, getattr(base, name))
        self._lost_waiters = None
        self._base = base
        self._hold: Hold | None = hold

    def __del__(self) -> None:
        hold = self._hold
        if hold is None or hold.ref is None or hold.ref not in self._refs:
            return
        hold.ref.told = True
        log.warning(
            "a lease on %r from client.acquire() was garbage-collected without release(); its hold is "
            "given back now (call lease.release(), or use 'with client.lock(...)')",
            self.key,
        )

    def __repr__(self) -> str:
        return "<Handle " + super().__repr__()[1:]


def _hold_of(lease: Lease) -> tuple[Lease, Hold]:
    """The engine's lease and the hold to give back: a handle's own, else the lease's most
    recent; :class:`LockLost` (``"released"``) when there is none."""
    if lease._epoch != fork_epoch():
        raise LockLost(
            f"lease on {lease.key!r} belongs to the process this one was forked from", key=lease.key, reason="forked"
        )
    if isinstance(lease, Handle):
        hold = lease._hold
        if hold is not None and hold.ref is not None and hold.ref in lease._refs:
            return lease._base, hold
    else:
        holds = [hold for hold in (ref() for ref in list(lease._refs)) if hold is not None]
        if holds:
            return lease, max(holds, key=lambda hold: hold.seq)
    message = f"lease on {lease.key!r} was already released"
    raise LockLost(message, key=lease.key, reason="released", lease=lease)


def _given_back(lease: Lease, hold: Hold) -> Lease | None:
    """Count ``hold`` given back; the lease when the store release is ours to send."""
    engine: Any = lease._owner
    ref = hold.ref
    assert ref is not None
    to_release: Lease | None = engine.give_back(ref)
    _pop_released()
    return to_release


def _settle(lease: Lease, code: ReleaseResult | BackendError | None) -> None:
    """After a hand release (whose answer the engine has taken): a store failure, or a loss
    found meanwhile, as an error."""
    if isinstance(code, BackendError):
        raise code
    if lease.lost_reason is not None:
        raise lost_error(lease, " before it was released", None)


def _answered(engine: Any, lease: Lease, code: ReleaseResult | BackendError) -> ReleaseResult | BackendError:
    engine.release_done(lease, code)
    return code


def release(lease: Lease) -> None:
    """:meth:`Lease.release <lockaspect.Lease.release>`."""
    base, hold = _hold_of(lease)
    code: ReleaseResult | BackendError | None = None
    if _given_back(base, hold) is not None:
        engine: Any = base._owner
        try:
            code = _answered(engine, base, engine.store.release(base.key, base.token, base.kind))
        except BackendError as exc:
            code = _answered(engine, base, exc)
        except BaseException:
            engine.release_failed_locally(base)
            raise
    _settle(base, code)


async def _store_release(engine: Any, lease: Lease, store: Any) -> ReleaseResult | BackendError:
    try:
        return _answered(engine, lease, await store.release(lease.key, lease.token, lease.kind))
    except BackendError as exc:
        return _answered(engine, lease, exc)
    except BaseException:
        engine.release_failed_locally(lease)
        raise


async def arelease(lease: Lease) -> None:
    """:meth:`Lease.arelease <lockaspect.Lease.arelease>`: the release runs in a task of its
    own, so a caller cancelled meanwhile stops waiting and the release still completes."""
    base, hold = _hold_of(lease)
    code: ReleaseResult | BackendError | None = None
    if _given_back(base, hold) is not None:
        engine: Any = base._owner
        state = engine.aio.state()
        code = await asyncio.shield(state.spawn(_store_release(engine, base, state.store)))
    _settle(base, code)


# -- extend ------------------------------------------------------------------------------------


def _extension(lease: Lease, seconds: object, replace: bool) -> float:
    """The lease to ask the store for, checked before any I/O."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ConfigurationError(f"extend takes a positive number of seconds, got {seconds!r}", key=lease.key)
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be a bool, got {type(replace).__name__}")
    if lease.watchdog:
        raise ConfigurationError(
            f"the lease on {lease.key!r} is renewed by the watchdog until it is released: extend applies to a "
            "fixed lease (take it with lease=<seconds>)",
            key=lease.key,
        )
    lease.check()
    record = lease._record
    left = 0.0 if replace else max(0.0, record.ends_at - record.clock())
    return float(seconds) + left


def _extended(lease: Lease, status: object, sent: float, asked: float) -> None:
    engine: Any = lease._owner
    if status is None:
        raise BackendError(f"the store could not extend {lease.key!r} (try again)", key=lease.key, transient=True)
    if status is False:
        engine.lost_here(lease, "not-owner")
        raise lost_error(lease, " (the store no longer has it for this owner)", None)
    granted = asked if status is True else min(asked, float(status))  # type: ignore[arg-type]
    with engine.lock:
        lease._record.extend(sent, granted)


def extend(lease: Lease, seconds: float, replace: bool) -> None:
    """:meth:`Lease.extend <lockaspect.Lease.extend>`."""
    base = lease._base if isinstance(lease, Handle) else lease
    asked = _extension(base, seconds, replace)
    engine: Any = base._owner
    sent = engine.clock()
    (status,) = engine.store.renew([RenewItem(base.key, base.token, asked, base.kind)])
    _extended(base, status, sent, asked)


async def aextend(lease: Lease, seconds: float, replace: bool) -> None:
    """:meth:`Lease.aextend <lockaspect.Lease.aextend>`."""
    base = lease._base if isinstance(lease, Handle) else lease
    asked = _extension(base, seconds, replace)
    engine: Any = base._owner
    sent = engine.clock()
    (status,) = await engine.aio.state().store.renew([RenewItem(base.key, base.token, asked, base.kind)])
    _extended(base, status, sent, asked)


# -- owned, remaining ---------------------------------------------------------------------------


def _owned(lease: Lease, held: bool) -> bool:
    if not held and lease._holds > 0:
        engine: Any = lease._owner
        engine.lost_here(lease, "not-owner")
    return held


def owned(lease: Lease) -> bool:
    """:meth:`Lease.owned <lockaspect.Lease.owned>`."""
    base = lease._base if isinstance(lease, Handle) else lease
    engine: Any = base._owner
    store = engine.store
    return _owned(base, bool(store.reenter(base.key, base.token, base.kind)))


async def aowned(lease: Lease) -> bool:
    """:meth:`Lease.aowned <lockaspect.Lease.aowned>`."""
    base = lease._base if isinstance(lease, Handle) else lease
    engine: Any = base._owner
    store = engine.aio.state().store
    return _owned(base, bool(await store.reenter(base.key, base.token, base.kind)))


def _admin(lease: Lease) -> AdminStore:
    engine: Any = lease._owner
    store = engine.store
    if not isinstance(store, AdminStore):
        raise ConfigurationError(f"remaining(): {store!r} cannot describe its locks", key=lease.key)
    return store


def _remaining_in(lease: Lease, states: list[KeyState]) -> float:
    for state in states:
        for holder in state.held_by:
            if holder.token == lease.token:
                return math.inf if holder.remaining is None else max(0.0, holder.remaining)
    return 0.0


def remaining(lease: Lease) -> float:
    """:meth:`Lease.remaining <lockaspect.Lease.remaining>`."""
    return _remaining_in(lease, _admin(lease).describe(lease.key))


async def aremaining(lease: Lease) -> float:
    """:meth:`Lease.aremaining <lockaspect.Lease.aremaining>`."""
    admin = _admin(lease)
    engine: Any = lease._owner
    store = engine.aio.state().store
    if isinstance(store, AsyncAdminStore):
        return _remaining_in(lease, await store.describe(lease.key))
    return _remaining_in(lease, await asyncio.to_thread(admin.describe, lease.key))
