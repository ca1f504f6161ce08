"""The ``with`` / ``async with`` blocks over the runners: :class:`LockBlock` (``client.lock``,
``fair_lock``, ``semaphore``, the read-write lock's sides), :class:`MultiLockBlock`
(``client.multi_lock``) and :class:`RWLock`; plus the decorated call with ``keys=``."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .engine._loop import LostCancel, cancelling
from .engine.core import Engine
from .engine.holds import Hold
from .engine.outcome import lost_error, raise_if_lost
from .errors import LockLost, LockNotAcquired
from .lease import _HELD, Lease, MultiLease, _push
from .options import LockSpec, OnLost

__all__ = ["LockBlock", "MultiLockBlock", "RWLock", "arun_multi", "run_multi"]


class _Done:
    """Stands in for a finished task in a :class:`LostCancel` that must not cancel any more."""

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False


_DONE: Any = _Done()


def _uncancel_lost(lost_cancel: LostCancel | None, exc: BaseException | None, leases: tuple[Lease, ...]) -> None:
    """An ``async with`` block cancelled because its lease was lost: take the cancellation
    back (it was ours, not the caller's) and raise :class:`LockLost` instead."""
    if lost_cancel is None or not lost_cancel.fired or not isinstance(exc, asyncio.CancelledError):
        return
    uncancel = getattr(asyncio.current_task(), "uncancel", None)
    if uncancel is not None:
        uncancel()  # the cancellation was ours, not the caller's
    if not cancelling():
        lost = next((lease for lease in leases if lease.lost), leases[0])
        raise lost_error(lost, "; the block was cancelled", exc) from exc


def _given(hold: Hold) -> bool:
    """Whether ``hold`` was given back already (``lease.release()`` inside the block)."""
    return hold.ref is None or hold.ref not in hold.lease._refs


class LockBlock:
    """The context manager returned by :meth:`LockClient.lock <lockaspect.LockClient.lock>`,
    for ``with`` and ``async with``.

    ``async with`` takes the lock without blocking the event loop and, if the lease is lost
    while the block runs, cancels the task running the block; the block then ends with
    :class:`~lockaspect.LockLost` (chained to that cancellation) instead of ``CancelledError``.
    """

    __slots__ = ("_engine", "_hold", "_key", "_lost_cancel", "_spec", "_token")

    def __init__(self, engine: Engine, key: str, spec: LockSpec) -> None:
        self._engine = engine
        self._key = key
        self._spec = spec
        self._hold: Hold | None = None
        self._token: Any = None
        self._lost_cancel: LostCancel | None = None

    def __enter__(self) -> Lease:
        if self._hold is not None:
            raise RuntimeError("this lock block is already entered; call client.lock() again")
        hold = self._engine.sync.acquire(self._key, self._spec)
        self._hold = hold
        self._token = _push(hold.lease)
        return hold.lease

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        hold, self._hold = self._hold, None
        assert hold is not None
        given = _given(hold)
        try:
            _HELD.reset(self._token)
        finally:
            self._engine.sync.release(hold)
        if not given:
            raise_if_lost(hold.lease, exc)

    async def __aenter__(self) -> Lease:
        if self._hold is not None:
            raise RuntimeError("this lock block is already entered; call client.lock() again")
        hold = await self._engine.aio.acquire(self._key, self._spec)
        self._hold = hold
        lease = hold.lease
        self._token = _push(lease)
        task = asyncio.current_task()
        if task is not None:
            self._lost_cancel = LostCancel(asyncio.get_running_loop(), task)
            lease._add_lost_waiter(self._lost_cancel)
        return lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        hold, self._hold = self._hold, None
        assert hold is not None
        lease = hold.lease
        given = _given(hold)
        lost_cancel, self._lost_cancel = self._lost_cancel, None
        if lost_cancel is not None:
            lost_cancel.task = _DONE  # from here on a loss must not cancel the task
            lease._remove_lost_waiter(lost_cancel)
        runner = self._engine.aio
        try:
            _HELD.reset(self._token)
        finally:
            await runner.release(hold, runner.state())
        _uncancel_lost(lost_cancel, exc, (lease,))
        if not given:
            raise_if_lost(lease, exc)


class MultiLockBlock:
    """The context manager returned by :meth:`LockClient.multi_lock
    <lockaspect.LockClient.multi_lock>`, for ``with`` and ``async with``; like
    :class:`LockBlock`, with a :class:`~lockaspect.lease.MultiLease`."""

    __slots__ = ("_engine", "_holds", "_keys", "_lost_cancel", "_multi", "_spec", "_tokens")

    def __init__(self, engine: Engine, keys: tuple[str, ...], spec: LockSpec) -> None:
        self._engine = engine
        self._keys = keys
        self._spec = spec
        self._multi: MultiLease | None = None
        self._holds: list[Hold] = []
        self._tokens: list[Any] = []
        self._lost_cancel: LostCancel | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys, deduplicated and sorted."""
        return self._keys

    def _entered(self, holds: list[Hold]) -> MultiLease:
        self._holds = holds
        self._multi = multi = MultiLease([hold.lease for hold in holds])
        self._tokens = [_push(lease) for lease in multi.leases]
        return multi

    def _unwind(self) -> tuple[MultiLease, list[Hold]]:
        multi, self._multi = self._multi, None
        assert multi is not None
        holds, self._holds = self._holds, []
        tokens, self._tokens = self._tokens, []
        for token in reversed(tokens):
            _HELD.reset(token)
        return multi, holds

    def __enter__(self) -> MultiLease:
        if self._multi is not None:
            raise RuntimeError("this lock block is already entered; call client.multi_lock() again")
        return self._entered(self._engine.sync.acquire_multi(self._keys, self._spec))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        holds = self._holds
        try:
            multi, holds = self._unwind()
        finally:
            self._engine.sync.release_all(holds)
        for lease in multi.leases:
            raise_if_lost(lease, exc)

    async def __aenter__(self) -> MultiLease:
        if self._multi is not None:
            raise RuntimeError("this lock block is already entered; call client.multi_lock() again")
        multi = self._entered(await self._engine.aio.acquire_multi(self._keys, self._spec))
        task = asyncio.current_task()
        if task is not None:
            self._lost_cancel = LostCancel(asyncio.get_running_loop(), task)
            for lease in multi.leases:
                lease._add_lost_waiter(self._lost_cancel)
        return multi

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        multi = self._multi
        assert multi is not None
        lost_cancel, self._lost_cancel = self._lost_cancel, None
        if lost_cancel is not None:
            lost_cancel.task = _DONE
            for lease in multi.leases:
                lease._remove_lost_waiter(lost_cancel)
        runner = self._engine.aio
        holds = self._holds
        try:
            multi, holds = self._unwind()
        finally:
            await runner.release_all(holds, runner.state())
        _uncancel_lost(lost_cancel, exc, multi.leases)
        for lease in multi.leases:
            raise_if_lost(lease, exc)


class RWLock:
    """A read-write lock on one key (see :meth:`LockClient.rw_lock <lockaspect.LockClient.rw_lock>`)."""

    __slots__ = ("_engine", "key")

    def __init__(self, engine: Engine, key: str) -> None:
        self._engine = engine
        self.key = key

    def read(
        self,
        *,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
    ) -> LockBlock:
        """A block holding the lock for reading, shared with other readers."""
        return self._block("read", lease, wait, delay_weight, on_lost, max_hold, wait_strategy)

    def write(
        self,
        *,
        lease: float | None = None,
        wait: float | None = 0.0,
        delay_weight: float | None = None,
        on_lost: OnLost | None = None,
        max_hold: float | None = None,
        wait_strategy: str = "notify",
    ) -> LockBlock:
        """A block holding the lock for writing, alone."""
        return self._block("write", lease, wait, delay_weight, on_lost, max_hold, wait_strategy)

    def _block(
        self,
        mode: str,
        lease: float | None,
        wait: float | None,
        delay_weight: float | None,
        on_lost: OnLost | None,
        max_hold: float | None,
        wait_strategy: str,
    ) -> LockBlock:
        spec = LockSpec.create(
            lease=lease,
            delay_weight=delay_weight,
            wait=wait,
            max_hold=max_hold,
            on_lost=on_lost,
            wait_strategy=wait_strategy,
            mode=mode,
        )
        return LockBlock(self._engine, self.key, spec)

    def __repr__(self) -> str:
        return f"<RWLock {self.key!r}>"


def _with_result(lost: LockLost, result: Any) -> LockLost:
    """``lost`` again, carrying the body's result (as a single-key call's LockLost does)."""
    return LockLost(str(lost), key=lost.key, reason=lost.reason, lease=lost.lease, result=result)


def run_in(block: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
           on_failure: Callable[[LockNotAcquired], Any] | None) -> Any:  # fmt: skip
    """A decorated call's body run inside ``block`` (entered and exited here): ``on_failure``
    answers a busy lock; a lease lost meanwhile raises :class:`LockLost` carrying the result."""
    try:
        block.__enter__()
    except LockNotAcquired as exc:
        if on_failure is None:
            raise
        return on_failure(exc)
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        block.__exit__(type(exc), exc, exc.__traceback__)
        raise
    try:
        block.__exit__(None, None, None)
    except LockLost as lost:
        raise _with_result(lost, result) from None
    return result


async def arun_in(block: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  on_failure: Callable[[LockNotAcquired], Any] | None) -> Any:  # fmt: skip
    """:func:`run_in` for ``async def`` (``on_failure`` may return an awaitable)."""
    try:
        await block.__aenter__()
    except LockNotAcquired as exc:
        if on_failure is None:
            raise
        outcome = on_failure(exc)
        return await outcome if inspect.isawaitable(outcome) else outcome
    try:
        result = await fn(*args, **kwargs)
    except BaseException as exc:
        await block.__aexit__(type(exc), exc, exc.__traceback__)
        raise
    try:
        await block.__aexit__(None, None, None)
    except LockLost as lost:
        raise _with_result(lost, result) from None
    return result


def run_multi(
    engine: Engine,
    keys: tuple[str, ...],
    spec: LockSpec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_failure: Callable[[LockNotAcquired], Any] | None,
) -> Any:
    """A decorated call with ``keys=``: the body runs inline under :class:`MultiLockBlock`."""
    return run_in(MultiLockBlock(engine, keys, spec), fn, args, kwargs, on_failure)


async def arun_multi(
    engine: Engine,
    keys: tuple[str, ...],
    spec: LockSpec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_failure: Callable[[LockNotAcquired], Any] | None,
) -> Any:
    """:func:`run_multi` for ``async def``: the calling task is cancelled if a lease is lost."""
    return await arun_in(MultiLockBlock(engine, keys, spec), fn, args, kwargs, on_failure)
