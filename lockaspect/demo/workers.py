"""The worker processes: the shop's decorated functions and the loop that runs the
parent's tasks.

Each worker is a fresh interpreter with its own :class:`~lockaspect.LockClient` (configured
as the default client, so the decorators find it) and its own connection to the shop's
data (:mod:`.data`: Redis or SQLite, the same store as the locks). It answers one task at
a time over its pipe to the parent.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from multiprocessing.connection import Connection
from typing import Any

from lockaspect import Lease, LockClient, LockLost, LockNotAcquired, configure, current_lease, distributed_lock

from .data import ShopData, open_data
from .scenario import (
    DELAY_WEIGHT,
    DUPLICATE,
    LEDGER_BOOK,
    LEDGER_WAIT,
    ORDER_WAIT,
    PLACED,
    SOLD_OUT,
    STOCK_WAIT,
    TICK,
    VOUCHER,
    Settings,
    User,
)

__all__ = ["Shop", "nightly_report", "place_order", "settle_ledger", "worker_main"]


class Shop:
    """One worker process's view of the shop: its lock client, its connection to the shop's
    own data, and the pipe to the parent."""

    def __init__(self, client: LockClient, data: ShopData, settings: Settings, conn: Connection) -> None:
        self.client = client
        self.data = data
        self.settings = settings
        self.conn = conn
        self.unsafe = False
        self.lost = threading.Event()
        self.lost_reason: str | None = None
        self._send_lock = threading.Lock()  # the watchdog thread reports too (logs, hooks)

    def has_ordered(self, user: User) -> bool:
        return self.data.has_ordered(user.id)

    def record_order(self, user: User, voucher: str) -> None:
        self.data.record_order(user.id, voucher)

    def stock_lock(self, voucher: str) -> AbstractContextManager[object]:
        if self.unsafe:
            return nullcontext()
        return self.client.lock(f"stock:{voucher}", wait=STOCK_WAIT, delay_weight=DELAY_WEIGHT)

    def stock_left(self, voucher: str) -> int:
        return self.data.stock_left(voucher)

    def set_stock(self, voucher: str, left: int) -> None:
        self.data.set_stock(voucher, left)

    def tell(self, *message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)


class _ForwardToParent(logging.Handler):
    """Show the library's warnings (e.g. "lease ... lost") in the parent's output."""

    def __init__(self, shop: Shop) -> None:
        super().__init__(logging.WARNING)
        self.shop = shop

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.shop.tell("log", record.levelname, record.name, record.getMessage())
        except Exception:  # noqa: BLE001 - logging must never break the worker
            self.handleError(record)


_shop: Shop | None = None


def shop() -> Shop:
    assert _shop is not None, "the demo's functions run in demo worker processes"
    return _shop


# -- the shop's functions -----------------------------------------------------------------


@distributed_lock(key="order:<user.id>", wait=ORDER_WAIT, delay_weight=DELAY_WEIGHT)
def place_order(user: User, voucher: str) -> str:
    """Take one order. The per-user lock makes "check, then order" safe against a double
    click landing on another worker at the same moment."""
    return _checkout(user, voucher)


def _checkout(user: User, voucher: str) -> str:
    s = shop()
    if s.has_ordered(user):
        return DUPLICATE  # a retry or a double click: this user already has an order
    with s.stock_lock(voucher):
        # Deliberately naive read-modify-write. Without the stock lock two workers read
        # the same value in the window below and both sell "the last voucher".
        left = s.stock_left(voucher)
        if left <= 0:
            return SOLD_OUT
        time.sleep(s.settings.race_window)
        s.set_stock(voucher, left - 1)
    time.sleep(s.settings.pay_time)  # payment, still under the user's lock
    s.record_order(user, voucher)
    return PLACED


@distributed_lock(key="report:<day>", delay_weight=DELAY_WEIGHT)
def nightly_report(day: str, seconds: float) -> int:
    """A job that outlives its lease: watchdog mode (no ``lease=``) keeps the lock."""
    s = shop()
    lease = current_lease()
    assert lease is not None
    s.tell("report_started", lease.key, lease.fencing_token, lease.lease_time)
    start = time.monotonic()
    renewals_before = s.client.stats().renewals
    while (elapsed := time.monotonic() - start) < seconds:
        time.sleep(min(0.2, seconds - elapsed))
        lease.check()  # a long sync body polls: raises LockLost if the lease is gone
        s.tell("report_progress", min(time.monotonic() - start, seconds), s.client.stats().renewals - renewals_before)
    return s.client.stats().renewals - renewals_before


def _ledger_lost(lease: Lease) -> None:
    """``on_lost`` hook: runs once, on a lockaspect thread, when the lease is lost."""
    s = shop()
    s.lost_reason = lease.lost_reason
    s.lost.set()


@distributed_lock(key="ledger:<book>", wait=LEDGER_WAIT, delay_weight=DELAY_WEIGHT, on_lost=_ledger_lost)
def settle_ledger(book: str, writer: str, before_write: Callable[[Lease], None]) -> bool:
    """Write the ledger through the fence. ``before_write`` is where a real program would
    compute the settlement, and where the demo freezes one worker."""
    lease = current_lease()
    assert lease is not None
    lease.check()  # still ours here ...
    before_write(lease)  # ... a pause longer than the lease ...
    # ... and the write. Only the fence can tell that this token is stale by now.
    return shop().data.fenced_write(
        f"ledger:{book}", f"settled by {writer} with fencing token {lease.fencing_token}", lease.fencing_token
    )


def _hold_for_the_pause(lease: Lease) -> None:
    s = shop()
    s.tell("ledger_held", os.getpid(), lease.fencing_token, lease.lease_time)
    message = s.conn.recv()  # the parent SIGSTOPs us while we wait here, then says "resume"
    if message != ("resume",):
        raise SystemExit(0)  # the parent is shutting down (Ctrl-C): leave at once


def _no_pause(lease: Lease) -> None:
    return None


# -- the tasks the parent hands out -------------------------------------------------------


def _order(index: int, task: tuple[Any, ...]) -> tuple[Any, ...]:
    _, number, user = task
    try:
        if shop().unsafe:
            outcome = _checkout(user, VOUCHER)
        else:
            outcome = place_order(user, VOUCHER)
    except LockNotAcquired as exc:
        outcome = f"error: {exc}"
    return ("done", "order", number, user.id, outcome)


def _report(index: int, task: tuple[Any, ...]) -> tuple[Any, ...]:
    _, day, seconds = task
    try:
        renewals = nightly_report(day, seconds)
    except LockLost as exc:
        return ("done", "report", {"ok": False, "error": f"LockLost: {exc}"})
    return ("done", "report", {"ok": True, "renewals": renewals})


def _ledger_hold(index: int, task: tuple[Any, ...]) -> tuple[Any, ...]:
    """Take the ledger lock and wait, frozen, past the lease; then try the stale write."""
    s = shop()
    result: dict[str, Any] = {"pid": os.getpid()}
    try:
        settle_ledger(LEDGER_BOOK, f"worker {index}", _hold_for_the_pause)
    except LockLost as exc:
        result["lock_lost"] = True
        result["reason"] = exc.reason
        result["written"] = exc.result if exc.has_result else None
        result["lease_lost"] = exc.lease is not None and exc.lease.lost
        result["token"] = exc.lease.fencing_token if exc.lease is not None else None
        # The hook runs on the watchdog thread; it may trail the caller by a moment.
        result["hook"] = s.lost.wait(5.0)
        result["hook_reason"] = s.lost_reason
    else:
        result["lock_lost"] = False
    return ("done", "ledger_hold", result)


def _ledger_rescue(index: int, task: tuple[Any, ...]) -> tuple[Any, ...]:
    """Take the ledger lock from the frozen worker and write the ledger."""
    written = settle_ledger(LEDGER_BOOK, f"worker {index}", _no_pause)
    # After our write the resource's high-water mark is our fencing token.
    token = shop().data.high_water(f"ledger:{LEDGER_BOOK}")
    return ("done", "ledger_rescue", {"written": written, "token": token})


_TASKS: dict[str, Callable[[int, tuple[Any, ...]], tuple[Any, ...]]] = {
    "order": _order,
    "report": _report,
    "ledger_hold": _ledger_hold,
    "ledger_rescue": _ledger_rescue,
}


def _handle(index: int, task: tuple[Any, ...]) -> tuple[Any, ...]:
    run_task = _TASKS.get(task[0])
    if run_task is None:
        raise ValueError(f"unknown task {task!r}")
    return run_task(index, task)


def _counters(client: LockClient) -> dict[str, int]:
    """The client's counters the parent adds up (see :meth:`~lockaspect.LockClient.stats`)."""
    stats = client.stats()
    return {"renewals": stats.renewals, "lost": stats.lost}


def worker_main(index: int, conn: Connection, url: str, prefix: str, settings: Settings, unsafe: bool) -> None:
    """Entry point of a worker process (a fresh interpreter, not a fork of the parent)."""
    global _shop
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C for everyone
    client = LockClient.from_url(url, namespace=prefix + "locks:", watchdog_lease=settings.lease, tick=TICK)
    configure(client)
    data = open_data(url, prefix)
    _shop = shop = Shop(client, data, settings, conn)
    shop.unsafe = unsafe
    library_log = logging.getLogger("lockaspect")
    library_log.addHandler(_ForwardToParent(shop))
    library_log.propagate = False
    try:
        shop.tell("ready", index, os.getpid())
        while True:
            try:
                task = conn.recv()
            except EOFError:
                return  # the parent is gone
            if task[0] == "stop":
                shop.tell("stats", index, _counters(client))
                return
            try:
                reply = _handle(index, task)
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
                reply = ("failed", task[0], f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            shop.tell(*reply)
    except (BrokenPipeError, EOFError, KeyboardInterrupt):
        return
    finally:
        client.close()
        data.close()
