"""The example project's tests (Django's test runner): real lock store, real database.

``manage.py test ledger``. Requests run concurrently in threads, each with its own database
connection (TransactionTestCase: the rows are committed, so every connection sees them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from io import StringIO
from typing import Any, TypeVar
from unittest import skipUnless

from django.apps import apps
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, connections, transaction
from django.test import Client, SimpleTestCase, TransactionTestCase

from lockaspect import LockNotAcquired, config

from .models import Account, Invoice
from .observers import LockEventCounter
from .services import deposit, fenced_update

T = TypeVar("T")


def concurrently(calls: list[Callable[[], T]]) -> list[T]:
    """Run ``calls`` in threads started together (each a caller of its own: a lock held by
    the test's thread is busy for them); each thread closes its database connections."""
    start = threading.Barrier(len(calls))

    def run(call: Callable[[], T]) -> T:
        try:
            start.wait()
            return call()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def client() -> Any:
    return config.default_client()


class DepositTests(TransactionTestCase):
    def test_a_deposit(self) -> None:
        response = Client().post("/accounts/alice/deposit", {"amount": "10"})
        self.assertEqual(response.status_code, 200, response.content)
        body = response.json()
        self.assertEqual(body["balance"], 10)
        self.assertEqual(Account.objects.get(pk="alice").fence, body["fencing_token"])

    def test_concurrent_deposits_lose_nothing(self) -> None:
        def five_deposits() -> list[int]:
            http = Client()
            return [http.post("/accounts/bob/deposit", {"amount": "1"}).status_code for _ in range(5)]

        statuses = [status for batch in concurrently([five_deposits] * 8) for status in batch]
        self.assertLessEqual(set(statuses), {200, 409})  # busy past the 1 s wait: 409, never a 500
        self.assertEqual(Account.objects.get(pk="bob").balance, statuses.count(200))
        self.assertGreater(statuses.count(200), 0)

    def test_a_busy_account_answers_409_with_retry_after(self) -> None:
        with client().lock("account:carol", lease=60):  # held here; the request runs in another thread
            [response] = concurrently([lambda: Client().post("/accounts/carol/deposit", {"amount": "1"})])
        self.assertEqual(response.status_code, 409)
        self.assertEqual(response.json(), {"error": "busy", "key": "account:carol"})
        self.assertGreater(int(response["Retry-After"]), 50)
        self.assertFalse(Account.objects.filter(pk="carol").exists())

    def test_a_stale_token_writes_nothing(self) -> None:
        with client().lock("account:dave") as paused:  # a holder that will wake up too late
            stale = paused.fencing_token
        _, newer = deposit("dave", 5)
        self.assertGreater(newer, stale)
        self.assertFalse(fenced_update("dave", stale, balance=999))
        self.assertEqual(Account.objects.get(pk="dave").balance, 5)
        self.assertTrue(fenced_update("dave", newer, balance=6))  # the holder itself may write again


@skipUnless(connection.vendor == "postgresql", "transaction-scoped locks are PostgreSQL advisory locks")
class InvoiceTests(TransactionTestCase):
    def test_concurrent_invoices_are_numbered_without_gaps(self) -> None:
        def three_invoices() -> list[int]:
            http = Client()
            responses = [http.post("/invoices/2025", {"amount": "7"}) for _ in range(3)]
            assert all(r.status_code == 201 for r in responses), [r.content for r in responses]
            return [r.json()["number"] for r in responses]

        numbers = [n for batch in concurrently([three_invoices] * 6) for n in batch]
        self.assertEqual(sorted(numbers), list(range(1, 19)))
        self.assertEqual(Invoice.objects.filter(series="2025").count(), 18)

    def test_the_lock_is_held_until_the_transaction_commits(self) -> None:
        def try_lock() -> bool:
            with transaction.atomic():
                try:
                    with client().lock("invoice-series:X", scope="transaction", connection=connection, wait=0):
                        return True
                except LockNotAcquired:
                    return False

        with transaction.atomic():
            with client().lock("invoice-series:X", scope="transaction", connection=connection) as lease:
                self.assertGreater(lease.fencing_token, 0)
            self.assertEqual(concurrently([try_lock]), [False])  # the block ended, the transaction not
        self.assertEqual(concurrently([try_lock]), [True])


class ApplyInterestTests(TransactionTestCase):
    def test_it_credits_every_account(self) -> None:
        Account.objects.create(name="erin", balance=1000)
        Account.objects.create(name="frank", balance=200)
        out = StringIO()
        call_command("apply_interest", percent=10, stdout=out)
        self.assertIn("interest credited to 2 account(s)", out.getvalue())
        self.assertEqual(dict(Account.objects.values_list("name", "balance")), {"erin": 1100, "frank": 220})

    def test_a_second_run_is_refused_while_one_runs(self) -> None:
        Account.objects.create(name="gina", balance=1000)

        def run() -> None:
            call_command("apply_interest", stdout=StringIO())

        with client().lock("ledger:apply-interest"), self.assertRaisesMessage(CommandError, "already running"):
            concurrently([run])  # another thread: this one's context would re-enter its own lock
        self.assertEqual(Account.objects.get(pk="gina").balance, 1000)


class SettingsTests(SimpleTestCase):
    def test_the_app_configured_the_default_client_from_settings(self) -> None:
        from django.conf import settings

        app = apps.get_app_config("lockaspect")
        self.assertIs(config.default_client(), app.client)
        self.assertEqual(app.client.backend.namespace, settings.LOCKASPECT["OPTIONS"]["namespace"])
        self.assertEqual(config.get_policy("ledger.deposit"), {"key": "account:<account>"})

    def test_the_observer_named_by_its_path_sees_the_locks(self) -> None:
        before = LockEventCounter.counts["acquired"]
        with client().lock("account:observed"):
            pass
        self.assertEqual(LockEventCounter.counts["acquired"], before + 1)
