"""The final table: each invariant checked against what the store holds at the end, not
against what the workers say they did."""

from __future__ import annotations

from dataclasses import dataclass

from .data import ShopData
from .pool import Run
from .report import Progress, Row
from .scenario import LEDGER_BOOK, VOUCHER

__all__ = ["rows"]


@dataclass(frozen=True)
class _Sale:
    """The sale as the store records it."""

    orders: int
    customers: int
    left: int  # vouchers left in stock
    sold: int  # vouchers taken out of stock
    expected_duplicates: int  # extra requests of the users who placed an order

    @property
    def oversold(self) -> int:
        # Orders with no voucher behind them: a lost update of the stock (two workers read
        # the same count) leaves an order without its decrement.
        return max(0, self.orders - self.sold)

    @property
    def duplicate_orders(self) -> int:
        return self.orders - self.customers


def rows(run: Run, progress: Progress, store: ShopData) -> list[Row]:
    """The result table; reads the store (and may raise one of ``store.errors``)."""
    sale = _read_sale(run, store)
    stats = [w.stats or {} for w in run.workers]
    renewals = sum(s.get("renewals", 0) for s in stats)
    lost = sum(s.get("lost", 0) for s in stats)
    missing_stats = [w.index for w in run.workers if not w.stats]
    if missing_stats:
        run.failures.append(f"no counters from worker(s) {missing_stats}")
    return [*_sale_rows(run, progress, sale), _watchdog_row(run, renewals), *_ledger_rows(run, lost, store)]


def _read_sale(run: Run, store: ShopData) -> _Sale:
    orders = store.order_count()
    customers = store.customers()
    left = store.stock_left(VOUCHER)
    expected_duplicates = sum(run.requests_per_user[uid] - 1 for uid in customers)
    return _Sale(orders, len(customers), left, run.settings.stock - left, expected_duplicates)


def _sale_rows(run: Run, progress: Progress, sale: _Sale) -> list[Row]:
    """One order per user, nothing oversold, every request answered."""
    settings = run.settings
    requests_total = progress.requests_total
    user_lock = "WITHOUT the lock" if run.unsafe else "inside lock"
    stock_lock = "WITHOUT the lock" if run.unsafe else "under lock"
    duplicate_orders = sale.duplicate_orders
    return [
        Row(
            "requests handled",
            progress.requests_done,
            progress.requests_done == requests_total and progress.errors == 0,
            f"{requests_total} requests from {settings.users} users by {len(run.workers)} worker processes"
            + (f"; {progress.errors} failed" if progress.errors else ""),
        ),
        Row(
            "orders placed",
            sale.orders,
            None,
            f"{settings.stock} vouchers for {settings.users} users; {sale.left} left in stock",
        ),
        Row(
            "duplicates prevented",
            progress.duplicates,
            duplicate_orders == 0 and progress.duplicates == sale.expected_duplicates,
            f"double clicks and retries turned away by the check {user_lock} order:<user.id>"
            + (f"; {duplicate_orders} user(s) ordered twice!" if duplicate_orders else "; nobody ordered twice"),
        ),
        Row(
            "sold out (turned away)",
            progress.sold_out,
            None,
            "requests that found the stock empty",
        ),
        Row(
            "oversold",
            sale.oversold,
            sale.oversold == 0 and sale.left >= 0,
            f"orders without a voucher: the stock is a non-atomic GET, pause, SET {stock_lock} "
            f"stock:{VOUCHER}; {sale.sold} taken from stock, {sale.orders} orders",
        ),
    ]


def _watchdog_row(run: Run, renewals: int) -> Row:
    """The report job outlived its lease and kept its lock (renewed, and the probe found it held)."""
    settings, report = run.settings, run.report
    report_ok = bool(report.result and report.result.get("ok"))
    report_renewals = int(report.result.get("renewals", 0)) if report.result else 0
    probe = (
        f"a probe {settings.lease + 0.5:g}s in found it still locked"
        if report.probe == "held"
        else f"the probe found the lock {report.probe or 'not probed'}"
    )
    return Row(
        "watchdog renewals",
        renewals,
        report_ok and report_renewals >= 1 and report.probe == "held",
        f"the {settings.report_seconds:g}s report job on a {settings.lease:g}s lease was renewed "
        f"{report_renewals} time(s) and finished with its lock; {probe}"
        if report_ok
        else f"the report job failed: {report.result.get('error') if report.result else 'no result'}",
    )


def _ledger_rows(run: Run, lost: int, store: ShopData) -> list[Row]:
    """The frozen worker was told it lost its lock, and its stale write was rejected."""
    settings, ledger = run.settings, run.ledger
    zombie = ledger.result or {}
    detected = int(bool(zombie.get("lock_lost") and zombie.get("lease_lost") and zombie.get("hook")))
    stale_rejected = int(zombie.get("written") is False)
    rescued = ledger.rescued or {}
    ledger_value = store.fenced_read(f"ledger:{LEDGER_BOOK}")
    ledger_text = ledger_value if ledger_value is not None else "nothing"
    rescue_ok = bool(rescued.get("written")) and rescued.get("token") == store.high_water(f"ledger:{LEDGER_BOOK}")
    return [
        Row(
            "leases lost",
            lost,
            None,
            f"worker {ledger.zombie} was frozen {ledger.paused_for:.1f}s on a {settings.lease:g}s lease"
            + ("" if lost <= 1 else f"; {lost - 1} other lease(s) lost (an overloaded machine?)"),
        ),
        Row(
            "lost leases detected",
            detected,
            detected >= 1,
            f"on SIGCONT: settle_ledger() raised LockLost({zombie.get('reason')!r}), "
            f"lease.lost={zombie.get('lease_lost')}, on_lost hook ran={zombie.get('hook')} "
            f"(reason {zombie.get('hook_reason')!r})"
            if zombie.get("lock_lost")
            else f"the frozen worker was not told: {zombie.get('error', 'settle_ledger() returned normally')}",
        ),
        Row(
            "stale writes rejected",
            stale_rejected,
            stale_rejected >= 1 and rescue_ok,
            f"its fenced write with token {ledger.zombie_token} lost to token {rescued.get('token')}; "
            f"the ledger says {ledger_text!r}",
        ),
    ]
