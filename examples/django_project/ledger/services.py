"""The two fencing patterns inside ``transaction.atomic()``.

``deposit``: a lock on the lock store (Valkey/Redis, any database). The lock is taken before
the transaction opens and released after it ends; the write carries the lease's fencing
token, so a holder that paused past its lease and woke up after a newer holder wrote
changes nothing:

    UPDATE ledger_account SET balance = %s, fence = %s WHERE name = %s AND fence <= %s

``issue_invoice``: a transaction-scoped lock (PostgreSQL's ``pg_advisory_xact_lock``) taken
inside the transaction, on Django's connection. It ends when that transaction commits or
rolls back, so the lock and the writes made under it cannot come apart.
"""

from __future__ import annotations

from django.db import connection, transaction
from django.db.models import Max

from lockaspect import LockLost, current_lease, distributed_lock

from .models import Account, Invoice


def fenced_update(account: str, token: int, **values: int) -> bool:
    """Write ``values`` to ``account`` unless a holder with a newer token wrote it first.

    The condition is part of the UPDATE itself (never a read before it): one statement
    compares and writes. ``<=`` lets one holder write several times under one lease.
    """
    return Account.objects.filter(pk=account, fence__lte=token).update(fence=token, **values) == 1


@distributed_lock(policy="ledger.deposit")  # key "account:<account>", wait 1 s: settings.LOCKASPECT
def deposit(account: str, amount: int) -> tuple[int, int]:
    """Add ``amount`` to ``account`` (created at 0); returns the new balance and the token."""
    lease = current_lease()
    assert lease is not None
    with transaction.atomic():
        balance = Account.objects.get_or_create(pk=account)[0].balance + amount
        if not fenced_update(account, lease.fencing_token, balance=balance):
            # A newer holder wrote first: this one's lease ended while it ran. Roll back.
            raise LockLost(f"a newer holder wrote {account!r}", key=lease.key, reason="fenced", lease=lease)
        lease.check()  # the last chance to learn of a lost lease before the commit
    return balance, lease.fencing_token


@transaction.atomic
@distributed_lock("invoice-series:<series>", scope="transaction", connection=connection, wait=10)
def issue_invoice(series: str, amount: int) -> Invoice:
    """The next invoice of ``series``: read the last number and write the next one under a
    lock of the current transaction (``@transaction.atomic`` is outside: the lock needs an
    open transaction, and is released by its commit)."""
    last = Invoice.objects.filter(series=series).aggregate(last=Max("number"))["last"] or 0
    return Invoice.objects.create(series=series, number=last + 1, amount=amount)
