"""``manage.py apply_interest``: a job that must not run twice at once (cron on several hosts)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from lockaspect import FailureContext, distributed_lock

from ...models import Account
from ...services import deposit


def _already_running(ctx: FailureContext) -> None:
    ttl = ctx.error.holder_ttl
    more = f" (its lease has {ttl:.0f} s left)" if ttl is not None else ""
    raise CommandError(f"apply_interest is already running elsewhere{more}: {ctx.key} is held")


@distributed_lock("ledger:apply-interest", wait=0, on_failure=_already_running)
def apply_interest(percent: int) -> int:
    """Credit ``percent`` % interest to every account, each under its own deposit lock."""
    names = list(Account.objects.order_by("name").values_list("name", flat=True))
    for name in names:
        balance = Account.objects.get(pk=name).balance
        deposit(name, balance * percent // 100)
    return len(names)


class Command(BaseCommand):
    help = "Credit interest to every account (one run at a time across all hosts)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--percent", type=int, default=1)

    def handle(self, *args: Any, percent: int, **options: Any) -> None:
        count = apply_interest(percent)
        self.stdout.write(f"interest credited to {count} account(s)")
