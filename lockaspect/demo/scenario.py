"""The scenario: how big and how fast a run is, the shop's constants, and the users'
requests (shared by the parent and the workers)."""

from __future__ import annotations

import datetime
import random
from dataclasses import dataclass

__all__ = [
    "DELAY_WEIGHT",
    "DUPLICATE",
    "FULL",
    "LEDGER_BOOK",
    "LEDGER_WAIT",
    "MAX_WORKERS",
    "MIN_WORKERS",
    "ORDER_WAIT",
    "PLACED",
    "QUICK",
    "REPORT_DAY",
    "SOLD_OUT",
    "STOCK_WAIT",
    "TICK",
    "VOUCHER",
    "WORKER_START_TIMEOUT",
    "Settings",
    "User",
    "make_requests",
]


@dataclass(frozen=True)
class Settings:
    """The size and pace of one demo run."""

    users: int
    stock: int
    max_duplicates: int  # extra requests per user: 0 .. max_duplicates
    pay_time: float  # seconds of "payment" inside the per-user lock
    race_window: float  # seconds between reading and writing the stock (the race)
    lease: float  # watchdog lease of every demo client
    report_seconds: float  # the long job; must outlive the lease
    ledger_after: float  # share of requests answered before the ledger story starts
    deadline: float  # give up (exit 1) after this many seconds
    seed: int = 7


FULL = Settings(
    users=120,
    stock=80,
    max_duplicates=3,
    pay_time=0.1,
    race_window=0.003,
    lease=2.0,
    report_seconds=5.0,
    ledger_after=0.2,
    deadline=55.0,
)
QUICK = Settings(
    users=40,
    stock=25,
    max_duplicates=2,
    pay_time=0.03,
    race_window=0.003,
    lease=2.0,
    report_seconds=3.5,
    ledger_after=0.1,
    deadline=45.0,
)

VOUCHER = "FLASH50"
LEDGER_BOOK = "flash-sale"
REPORT_DAY = datetime.date.today().isoformat()
#: First renewal at half the lease: on a 2 s lease that leaves 1 s for a late timer tick
#: or a slow round trip (the default 0.9 would leave 0.2 s).
DELAY_WEIGHT = 0.5
TICK = 0.05
ORDER_WAIT = 10.0
STOCK_WAIT = 10.0
LEDGER_WAIT = 15.0
WORKER_START_TIMEOUT = 30.0
MIN_WORKERS = 2
MAX_WORKERS = 32

# The outcomes of one order request.
PLACED, DUPLICATE, SOLD_OUT = "placed", "duplicate", "sold-out"


@dataclass(frozen=True)
class User:
    id: int
    name: str


def make_requests(settings: Settings) -> tuple[list[tuple[int, User]], dict[int, int]]:
    """The numbered requests of the sale, and how many each user sends.

    Each user sends 1 + 0..max_duplicates requests: double clicks (sent together, so
    they race on different workers) and a late retry for some."""
    rng = random.Random(settings.seed)
    users = [User(i, f"user-{i}") for i in range(1, settings.users + 1)]
    rng.shuffle(users)
    sequence: list[User] = []
    retries: list[User] = []
    per_user: dict[int, int] = {}
    for user in users:
        extra = rng.randint(0, settings.max_duplicates)
        per_user[user.id] = 1 + extra
        clicks = 1 + (extra + 1) // 2
        sequence.extend([user] * clicks)
        retries.extend([user] * (1 + extra - clicks))
    for user in retries:  # late retries land anywhere after the user's first click
        first = sequence.index(user)
        sequence.insert(rng.randint(first + 1, len(sequence)), user)
    return list(enumerate(sequence)), per_user
