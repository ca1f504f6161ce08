from django.db import models


class Account(models.Model):
    """A balance, written only by fenced updates (``ledger.services.fenced_update``)."""

    name = models.CharField(primary_key=True, max_length=64)
    balance = models.BigIntegerField(default=0)
    #: The fencing token of the last write: a write with an older token changes nothing.
    fence = models.BigIntegerField(default=0)


class Invoice(models.Model):
    """Numbered 1, 2, 3, ... per series, with no gap and no duplicate (PostgreSQL only:
    the numbering takes a transaction-scoped advisory lock)."""

    series = models.CharField(max_length=16)
    number = models.PositiveIntegerField()
    amount = models.BigIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["series", "number"], name="unique_invoice_number")]
