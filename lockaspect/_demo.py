"""``lockaspect demo``: a flash sale run by several worker processes on one lock store.

What it shows, with real processes on a real server:

* **One order per user.** Users double-click and retry. ``place_order(user, voucher)`` is
  decorated with ``@distributed_lock(key="order:<user.id>")``; inside the lock a plain
  "has this user ordered?" check turns every duplicate away.
* **No overselling.** The stock is a deliberately naive read-modify-write (``GET``, a
  pause, ``SET``) that would oversell under concurrency; a nested
  ``client.lock("stock:<voucher>")`` makes it safe. "oversold: 0" is earned by the lock,
  not by an atomic ``DECR``. (``--unsafe`` runs the same sale without the locks.)
* **The watchdog.** A report job runs for longer than its lease; the watchdog renews the
  lease while it runs, and a probe from the parent finds the lock still held after the
  first lease would have ended.
* **The lost-lock signal and fencing.** A worker holding ``ledger:<book>`` is frozen with
  SIGSTOP for longer than its lease. Another worker takes the lock (a larger fencing token)
  and writes the ledger through :class:`~lockaspect.fencing.RedisFence`. When the frozen
  worker is continued it tries its own fenced write with its old token: rejected. Its
  lease reports ``lost``, its ``on_lost`` hook runs, and the decorated call raises
  :class:`~lockaspect.LockLost` instead of returning as if it had been protected.

The parent process is the conductor: it hands out work to the workers over one pipe each
(no lock shared between processes, so freezing a worker cannot block the others), sends
the signals, and checks the invariants against the store at the end. Exit status 0 when
every invariant holds, 1 otherwise.

Not a public module: run it with ``lockaspect demo`` or ``python -m lockaspect demo``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, Protocol

import redis

from . import LockClient, LockLost, LockNotAcquired, configure, current_lease, distributed_lock
from .fencing import RedisFence
from .lease import Lease

if TYPE_CHECKING:
    from .testing import LockServer

__all__ = ["FULL", "QUICK", "DemoOptions", "Settings", "run_demo"]

# -- the scenario -------------------------------------------------------------------------


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

PLACED, DUPLICATE, SOLD_OUT = "placed", "duplicate", "sold-out"


@dataclass(frozen=True)
class User:
    id: int
    name: str


# -- worker side --------------------------------------------------------------------------


class _Shop:
    """One worker process's view of the shop: its lock client, a plain Redis client for
    the shop's own data, and the pipe to the parent."""

    def __init__(self, client: LockClient, store: Any, prefix: str, settings: Settings, conn: Connection) -> None:
        self.client = client
        self.store = store
        self.prefix = prefix
        self.settings = settings
        self.conn = conn
        self.fence = RedisFence(store, namespace=prefix + "fenced:")
        self.unsafe = False
        self.lost = threading.Event()
        self.lost_reason: str | None = None
        self._send_lock = threading.Lock()  # the watchdog thread reports too (logs, hooks)

    def has_ordered(self, user: User) -> bool:
        return bool(self.store.sismember(self.prefix + "customers", user.id))

    def record_order(self, user: User, voucher: str) -> None:
        pipe = self.store.pipeline(transaction=True)
        pipe.rpush(self.prefix + "orders", f"{user.id}:{voucher}")
        pipe.sadd(self.prefix + "customers", user.id)
        pipe.execute()

    def stock_lock(self, voucher: str) -> AbstractContextManager[object]:
        if self.unsafe:
            return nullcontext()
        return self.client.lock(f"stock:{voucher}", wait=STOCK_WAIT, delay_weight=DELAY_WEIGHT)

    def stock_left(self, voucher: str) -> int:
        return int(self.store.get(self.prefix + f"stock:{voucher}") or 0)

    def set_stock(self, voucher: str, left: int) -> None:
        self.store.set(self.prefix + f"stock:{voucher}", left)

    def tell(self, *message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)


class _ForwardToParent(logging.Handler):
    """Show the library's warnings (e.g. "lease ... lost") in the parent's output."""

    def __init__(self, shop: _Shop) -> None:
        super().__init__(logging.WARNING)
        self.shop = shop

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.shop.tell("log", record.levelname, record.name, record.getMessage())
        except Exception:  # noqa: BLE001 - logging must never break the worker
            self.handleError(record)


_shop: _Shop | None = None


def shop() -> _Shop:
    assert _shop is not None, "the demo's functions run in demo worker processes"
    return _shop


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
    return shop().fence.write(
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


def _handle(index: int, task: tuple[Any, ...]) -> tuple[Any, ...]:
    s = shop()
    kind = task[0]
    if kind == "order":
        _, number, user = task
        try:
            if s.unsafe:
                outcome = _checkout(user, VOUCHER)
            else:
                outcome = place_order(user, VOUCHER)
        except LockNotAcquired as exc:
            outcome = f"error: {exc}"
        return ("done", "order", number, user.id, outcome)
    if kind == "report":
        _, day, seconds = task
        try:
            renewals = nightly_report(day, seconds)
        except LockLost as exc:
            return ("done", "report", {"ok": False, "error": f"LockLost: {exc}"})
        return ("done", "report", {"ok": True, "renewals": renewals})
    if kind == "ledger_hold":
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
    if kind == "ledger_rescue":
        written = settle_ledger(LEDGER_BOOK, f"worker {index}", _no_pause)
        # After our write the resource's high-water mark is our fencing token.
        token = s.fence.high_water(f"ledger:{LEDGER_BOOK}")
        return ("done", "ledger_rescue", {"written": written, "token": token})
    raise ValueError(f"unknown task {task!r}")


def _worker_main(index: int, conn: Connection, url: str, prefix: str, settings: Settings, unsafe: bool) -> None:
    """Entry point of a worker process (a fresh interpreter, not a fork of the parent)."""
    global _shop
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C for everyone
    client = LockClient.from_url(url, namespace=prefix + "locks:", watchdog_lease=settings.lease, tick=TICK)
    configure(client)
    store = redis.Redis.from_url(url, socket_timeout=10)
    _shop = shop = _Shop(client, store, prefix, settings, conn)
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
                shop.tell("stats", index, dataclasses.asdict(client.stats()))
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
        store.close()


# -- reporting ----------------------------------------------------------------------------


@dataclass
class Progress:
    """What the parent knows so far; reporters draw it."""

    requests_total: int
    stock: int
    report_total: float
    lease: float
    requests_done: int = 0
    placed: int = 0
    duplicates: int = 0
    sold_out: int = 0
    errors: int = 0
    report_elapsed: float = 0.0
    report_renewals: int = 0
    report_done: bool = False
    ledger_step: int = 0
    ledger_text: str = "waiting"


LEDGER_STEPS = 4


@dataclass(frozen=True)
class Row:
    label: str
    value: int
    ok: bool | None  # None: informational, not an invariant
    why: str


class Reporter(Protocol):
    def start(self, progress: Progress, t0: float) -> None: ...

    def update(self, progress: Progress) -> None: ...

    def event(self, elapsed: float, text: str) -> None: ...

    def stop(self) -> None: ...

    def line(self, text: str) -> None: ...

    def table(self, rows: list[Row], wall: float) -> None: ...


class PlainReporter:
    """Progress lines and a text table: for pipes, logs, CI, and when rich is missing."""

    def __init__(self, out: IO[str] | None = None, interval: float = 1.0) -> None:
        self.out: IO[str] | None = out or sys.stdout
        self.interval = interval
        self._last = 0.0
        self._start = time.monotonic()

    def _print(self, text: str) -> None:
        if self.out is None:
            return
        try:
            print(text, file=self.out, flush=True)
        except BrokenPipeError:
            # The reader went away (``lockaspect demo | head``): go on quietly, so that
            # the workers and the server are still cleaned up.
            if self.out is sys.stdout:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            self.out = None

    def start(self, progress: Progress, t0: float) -> None:
        self._start = t0
        self._last = time.monotonic()

    def update(self, progress: Progress) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        self._progress_line(now - self._start, progress)

    def _progress_line(self, elapsed: float, p: Progress) -> None:
        report = "done" if p.report_done else f"{p.report_elapsed:.1f}/{p.report_total:g}s"
        self._print(
            f"[{elapsed:5.1f}s] requests {p.requests_done}/{p.requests_total}"
            f" | orders {p.placed}/{p.stock} | duplicates {p.duplicates} | sold out {p.sold_out}"
            f" | report job {report}, {p.report_renewals} renewal(s)"
            f" | ledger: {p.ledger_text}"
        )

    def event(self, elapsed: float, text: str) -> None:
        self._print(f"[{elapsed:5.1f}s] {text}")

    def stop(self) -> None:
        return None

    def line(self, text: str) -> None:
        self._print(text)

    def table(self, rows: list[Row], wall: float) -> None:
        width = max(len(r.label) for r in rows)
        self._print("")
        self._print(f"{'result':<{width}}  {'value':>6}  check  why")
        self._print(f"{'-' * width}  {'-' * 6}  -----  {'-' * 40}")
        for r in rows:
            check = "" if r.ok is None else ("ok" if r.ok else "FAIL")
            self._print(f"{r.label:<{width}}  {r.value:>6}  {check:<5}  {r.why}")
        self._print(f"wall time: {wall:.1f}s")


class RichReporter:
    """Live progress bars and a coloured table, on a terminal with rich installed."""

    def __init__(self, out: IO[str] | None = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = Console(file=out)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description:<28}"),
            BarColumn(bar_width=30),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._tasks: dict[str, Any] = {}

    def start(self, progress: Progress, t0: float) -> None:
        add = self.progress.add_task
        self._tasks = {
            "sale": add("Flash sale requests", total=progress.requests_total, info=""),
            "report": add(f"Report job ({progress.lease:g}s lease)", total=progress.report_total, info=""),
            "ledger": add("Ledger pause (SIGSTOP)", total=LEDGER_STEPS, info=""),
        }
        self.progress.start()

    def update(self, p: Progress) -> None:
        tasks = self._tasks
        self.progress.update(
            tasks["sale"],
            completed=p.requests_done,
            info=f"orders {p.placed}/{p.stock}, duplicates {p.duplicates}, sold out {p.sold_out}",
        )
        self.progress.update(
            tasks["report"],
            completed=p.report_total if p.report_done else p.report_elapsed,
            info=f"{p.report_renewals} watchdog renewal(s)",
        )
        self.progress.update(tasks["ledger"], completed=p.ledger_step, info=p.ledger_text)

    def event(self, elapsed: float, text: str) -> None:
        from rich.markup import escape

        self.console.print(f"[dim]{elapsed:5.1f}s[/dim] {escape(text)}")

    def stop(self) -> None:
        self.progress.stop()

    def line(self, text: str) -> None:
        from rich.markup import escape

        self.console.print(escape(text))

    def table(self, rows: list[Row], wall: float) -> None:
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=f"lockaspect flash sale ({wall:.1f}s)", show_lines=False)
        table.add_column("result", style="bold")
        table.add_column("value", justify="right")
        table.add_column("", justify="center")
        table.add_column("why", overflow="fold")
        for r in rows:
            check = "" if r.ok is None else ("[green]ok[/green]" if r.ok else "[bold red]FAIL[/bold red]")
            table.add_row(escape(r.label), str(r.value), check, escape(r.why))
        self.console.print(table)


def make_reporter(*, plain: bool = False, out: IO[str] | None = None) -> Reporter:
    """Rich live output on a terminal when rich is installed; plain lines otherwise."""
    stream = out or sys.stdout
    if not plain and stream.isatty():
        try:
            return RichReporter(stream)
        except ImportError:
            pass
    return PlainReporter(stream)


# -- the conductor (parent process) -------------------------------------------------------


@dataclass
class DemoOptions:
    url: str | None = None
    workers: int = 4
    quick: bool = False
    unsafe: bool = False
    plain: bool = False


class DemoFailed(Exception):
    """The run could not complete (a worker died, the deadline passed, ...)."""


@dataclass
class _Worker:
    index: int
    process: Any
    conn: Connection
    pid: int = 0
    ready: bool = False
    busy: tuple[Any, ...] | None = None
    stats: dict[str, int] | None = None
    stopped: bool = False  # SIGSTOPped by us


@dataclass
class _Ledger:
    started: bool = False
    zombie: int | None = None  # worker index
    zombie_pid: int = 0
    zombie_token: int = 0
    stopped_at: float = 0.0
    paused_for: float = 0.0
    rescued: dict[str, Any] | None = None
    result: dict[str, Any] | None = None


@dataclass
class _Report:
    dispatched: bool = False
    key: str = ""
    started_at: float = 0.0
    probe_at: float = 0.0
    probe: str | None = None  # "held" / "free" / error text
    probe_ttl: float | None = None
    result: dict[str, Any] | None = None


@dataclass
class _Run:
    settings: Settings
    url: str
    prefix: str
    unsafe: bool
    reporter: Reporter
    requests: deque[tuple[int, User]] = field(default_factory=deque)
    requests_per_user: dict[int, int] = field(default_factory=dict)
    specials: deque[tuple[Any, ...]] = field(default_factory=deque)
    workers: list[_Worker] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    ledger: _Ledger = field(default_factory=_Ledger)
    report: _Report = field(default_factory=_Report)
    t0: float = 0.0


def _make_requests(settings: Settings) -> tuple[list[tuple[int, User]], dict[int, int]]:
    """Each user sends 1 + 0..max_duplicates requests: double clicks (sent together, so
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


def _elapsed(run: _Run) -> float:
    return time.monotonic() - run.t0


def _event(run: _Run, text: str) -> None:
    run.reporter.event(_elapsed(run), text)


def _start_workers(run: _Run, count: int) -> None:
    # Fresh interpreters, not forks of this (threaded) process. A fork server imports the
    # demo once and forks the workers from that clean state: cheaper than N spawns.
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx: Any = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
    else:  # pragma: no cover - platforms without fork
        ctx = multiprocessing.get_context("spawn")
    for index in range(count):
        parent_end, child_end = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=_worker_main,
            args=(index, child_end, run.url, run.prefix, run.settings, run.unsafe),
            name=f"lockaspect-demo-worker-{index}",
            daemon=True,
        )
        process.start()
        child_end.close()
        run.workers.append(_Worker(index, process, parent_end))
    deadline = time.monotonic() + WORKER_START_TIMEOUT
    while not all(w.ready for w in run.workers):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DemoFailed(f"workers did not start within {WORKER_START_TIMEOUT:g}s")
        for ready in wait_for_connections([w.conn for w in run.workers if not w.ready], timeout=remaining):
            worker = next(w for w in run.workers if w.conn is ready)
            try:
                message = worker.conn.recv()
            except EOFError:
                raise DemoFailed(f"worker {worker.index} died while starting") from None
            if message[0] != "ready":
                raise DemoFailed(f"worker {worker.index} sent {message!r} while starting")
            worker.pid, worker.ready = message[2], True


def _send(run: _Run, worker: _Worker, task: tuple[Any, ...]) -> None:
    worker.busy = task
    worker.conn.send(task)


def _dispatch(run: _Run, progress: Progress) -> None:
    """Keep every idle worker busy: story steps first, then the requests."""
    settings = run.settings
    ledger, report = run.ledger, run.report
    for worker in run.workers:
        if worker.busy is not None or worker.stopped:
            continue
        if not report.dispatched:
            report.dispatched = True
            _send(run, worker, ("report", REPORT_DAY, settings.report_seconds))
            continue
        if not ledger.started and (
            progress.requests_done >= settings.ledger_after * progress.requests_total or not run.requests
        ):
            ledger.started = True
            ledger.zombie = worker.index
            progress.ledger_text = "taking ledger lock"
            _send(run, worker, ("ledger_hold",))
            continue
        if run.specials:
            _send(run, worker, run.specials.popleft())
            continue
        if run.requests:
            number, user = run.requests.popleft()
            _send(run, worker, ("order", number, user))


def _probe_report(run: _Run, client: LockClient) -> None:
    """After the report job's first lease would have ended, try to take its lock."""
    report = run.report
    try:
        with client.lock(report.key, wait=0):
            report.probe = "free"
    except LockNotAcquired as exc:
        report.probe = "held"
        report.probe_ttl = exc.holder_ttl
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        report.probe = f"{type(exc).__name__}: {exc}"
    age = time.monotonic() - report.started_at
    if report.probe == "held":
        ttl = "" if report.probe_ttl is None else f", {report.probe_ttl:.1f}s left on the renewed lease"
        _event(run, f"probe at {age:.1f}s into the report job: {report.key!r} is still locked{ttl}")
    else:
        _event(run, f"probe at {age:.1f}s into the report job: {report.key!r} was {report.probe}!")


def _on_message(run: _Run, worker: _Worker, message: tuple[Any, ...], progress: Progress) -> None:
    kind = message[0]
    ledger, report = run.ledger, run.report
    if kind == "done":
        worker.busy = None
        what = message[1]
        if what == "order":
            _, _, _, _user_id, outcome = message
            progress.requests_done += 1
            if outcome == PLACED:
                progress.placed += 1
            elif outcome == DUPLICATE:
                progress.duplicates += 1
            elif outcome == SOLD_OUT:
                progress.sold_out += 1
            else:
                progress.errors += 1
                run.failures.append(f"an order request failed: {outcome}")
        elif what == "report":
            report.result = message[2]
            progress.report_done = True
            if report.result.get("ok"):
                progress.report_renewals = report.result["renewals"]
                _event(
                    run,
                    f"report job done after {run.settings.report_seconds:g}s on a {run.settings.lease:g}s lease: "
                    f"the watchdog renewed it {progress.report_renewals} time(s)",
                )
            else:
                _event(run, f"report job failed: {report.result.get('error')}")
        elif what == "ledger_rescue":
            ledger.rescued = message[2]
            token = ledger.rescued.get("token")
            ok = "accepted" if ledger.rescued.get("written") else "REJECTED"
            _event(
                run, f"worker {worker.index} took ledger:{LEDGER_BOOK} (fencing token {token}); its fenced write: {ok}"
            )
            progress.ledger_step, progress.ledger_text = 2, f"worker {worker.index} wrote with token {token}"
            _resume_zombie(run, progress)
        elif what == "ledger_hold":
            ledger.result = message[2]
            result = ledger.result
            written = result.get("written")
            verdict = "REJECTED" if written is False else ("accepted!" if written else "not attempted")
            _event(
                run,
                f"worker {worker.index} resumed; its fenced write with stale token {ledger.zombie_token}: {verdict}",
            )
            if result.get("lock_lost"):
                hook = "on_lost hook ran" if result.get("hook") else "on_lost hook did NOT run"
                _event(
                    run,
                    f"worker {worker.index}: settle_ledger() raised LockLost(reason={result.get('reason')!r}), "
                    f"lease.lost={result.get('lease_lost')}, {hook}",
                )
            else:
                _event(run, f"worker {worker.index}: settle_ledger() returned normally: the lost lease went unnoticed")
            progress.ledger_step = LEDGER_STEPS
            progress.ledger_text = "stale write rejected" if written is False else "stale write NOT rejected"
    elif kind == "report_started":
        _, report.key, token, lease_time = message
        report.started_at = time.monotonic()
        report.probe_at = report.started_at + lease_time + 0.5
        _event(
            run,
            f"worker {worker.index} runs a {run.settings.report_seconds:g}s report job on a "
            f"{lease_time:g}s watchdog lease ({report.key!r}, fencing token {token})",
        )
    elif kind == "log":
        _, level, name, text = message
        _event(run, f"worker {worker.index} logged {level} {name}: {text}")
    elif kind == "report_progress":
        progress.report_elapsed, progress.report_renewals = message[1], message[2]
    elif kind == "ledger_held":
        _, pid, token, lease_time = message
        ledger.zombie_pid, ledger.zombie_token = pid, token
        os.kill(pid, signal.SIGSTOP)
        worker.stopped = True
        ledger.stopped_at = time.monotonic()
        _event(
            run,
            f"worker {worker.index} (pid {pid}) holds ledger:{LEDGER_BOOK} with fencing token {token}: "
            f"SIGSTOP, frozen past its {lease_time:g}s lease (its watchdog is frozen too)",
        )
        progress.ledger_step, progress.ledger_text = 1, f"worker {worker.index} frozen (token {token})"
        run.specials.append(("ledger_rescue",))
    elif kind == "failed":
        worker.busy = None
        run.failures.append(f"worker {worker.index} failed a {message[1]!r} task: {message[2]}")
        if message[1] == "order":
            progress.requests_done += 1
            progress.errors += 1
        elif message[1] == "report":
            progress.report_done = True
            run.report.result = {"ok": False, "error": message[2]}
        elif message[1] == "ledger_rescue":
            ledger.rescued = {"written": False, "token": None, "error": message[2]}
            _resume_zombie(run, progress)
        elif message[1] == "ledger_hold":
            ledger.result = {"error": message[2]}
            progress.ledger_step = LEDGER_STEPS
    else:
        run.failures.append(f"worker {worker.index} sent an unexpected message {message!r}")


def _resume_zombie(run: _Run, progress: Progress) -> None:
    ledger = run.ledger
    if ledger.zombie is None:
        return
    worker = run.workers[ledger.zombie]
    if not worker.stopped:
        return
    ledger.paused_for = time.monotonic() - ledger.stopped_at
    os.kill(worker.pid, signal.SIGCONT)
    worker.stopped = False
    try:
        worker.conn.send(("resume",))
    except OSError as exc:
        run.failures.append(f"could not resume worker {worker.index}: {exc}")
    _event(run, f"SIGCONT worker {worker.index} after {ledger.paused_for:.1f}s: it still thinks it holds the lock")
    progress.ledger_step, progress.ledger_text = 3, f"worker {worker.index} resumed"


def _finished(run: _Run, progress: Progress) -> bool:
    ledger = run.ledger
    return (
        progress.requests_done >= progress.requests_total
        and progress.report_done
        and ledger.result is not None
        and (ledger.rescued is not None or "error" in ledger.result)
        and all(w.busy is None for w in run.workers)
    )


def _conduct(run: _Run, progress: Progress, probe_client: LockClient) -> None:
    settings = run.settings
    deadline = run.t0 + settings.deadline
    run.reporter.start(progress, run.t0)
    while not _finished(run, progress):
        now = time.monotonic()
        if now >= deadline:
            raise DemoFailed(f"the demo did not finish within {settings.deadline:g}s")
        ledger = run.ledger
        worker_stopped = ledger.zombie is not None and run.workers[ledger.zombie].stopped
        if worker_stopped and now - ledger.stopped_at > settings.lease + LEDGER_WAIT + 5:
            run.failures.append("nobody took the ledger lock from the frozen worker")
            _resume_zombie(run, progress)
        if run.report.probe_at and run.report.probe is None and now >= run.report.probe_at and not progress.report_done:
            _probe_report(run, probe_client)
        _dispatch(run, progress)
        run.reporter.update(progress)
        live = [w.conn for w in run.workers]
        for ready in wait_for_connections(live, timeout=0.05):
            worker = next(w for w in run.workers if w.conn is ready)
            try:
                message = worker.conn.recv()
            except EOFError:
                code = worker.process.exitcode
                raise DemoFailed(f"worker {worker.index} (pid {worker.pid}) died (exit code {code})") from None
            _on_message(run, worker, message, progress)
    run.reporter.update(progress)


def _stop_workers(run: _Run, *, graceful: bool) -> None:
    """Collect the workers' counters (if ``graceful``) and make sure none is left running."""
    for worker in run.workers:
        if worker.stopped and worker.pid:
            try:
                os.kill(worker.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            worker.stopped = False
        try:
            worker.conn.send(("stop",))
        except OSError:
            pass
    deadline = time.monotonic() + (5.0 if graceful else 0.0)
    pending = [w for w in run.workers if w.stats is None]
    while pending and time.monotonic() < deadline:
        ready = wait_for_connections([w.conn for w in pending], timeout=max(0.0, deadline - time.monotonic()))
        for conn in ready:
            worker = next(w for w in pending if w.conn is conn)
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                worker.stats = {}
                continue
            if message[0] == "stats":
                worker.stats = message[2]
        pending = [w for w in run.workers if w.stats is None]
    for worker in run.workers:
        worker.process.join(timeout=max(0.1, deadline - time.monotonic()))
    for worker in run.workers:
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join(timeout=2.0)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(timeout=2.0)
        worker.conn.close()


def _rows(run: _Run, progress: Progress, store: Any) -> list[Row]:
    settings, prefix = run.settings, run.prefix
    orders = int(store.llen(prefix + "orders"))
    customers = int(store.scard(prefix + "customers"))
    left = int(store.get(prefix + f"stock:{VOUCHER}") or 0)
    sold = settings.stock - left  # vouchers taken out of stock
    # Orders with no voucher behind them: a lost update of the stock (two workers read the
    # same count) leaves an order without its decrement.
    oversold = max(0, orders - sold)
    duplicate_orders = orders - customers
    expected_duplicates = sum(run.requests_per_user[int(uid)] - 1 for uid in store.smembers(prefix + "customers"))
    stats = [w.stats or {} for w in run.workers]
    renewals = sum(s.get("renewals", 0) for s in stats)
    lost = sum(s.get("lost", 0) for s in stats)
    missing_stats = [w.index for w in run.workers if not w.stats]
    if missing_stats:
        run.failures.append(f"no counters from worker(s) {missing_stats}")

    report, ledger = run.report, run.ledger
    report_ok = bool(report.result and report.result.get("ok"))
    report_renewals = int(report.result.get("renewals", 0)) if report.result else 0
    zombie = ledger.result or {}
    detected = int(bool(zombie.get("lock_lost") and zombie.get("lease_lost") and zombie.get("hook")))
    stale_rejected = int(zombie.get("written") is False)
    rescued = ledger.rescued or {}
    fence = RedisFence(store, namespace=prefix + "fenced:")
    ledger_value = fence.read(f"ledger:{LEDGER_BOOK}")
    ledger_text = ledger_value.decode() if ledger_value is not None else "nothing"
    rescue_ok = bool(rescued.get("written")) and rescued.get("token") == fence.high_water(f"ledger:{LEDGER_BOOK}")

    probe = (
        f"a probe {settings.lease + 0.5:g}s in found it still locked"
        if report.probe == "held"
        else f"the probe found the lock {report.probe or 'not probed'}"
    )
    requests_total = progress.requests_total
    user_lock = "WITHOUT the lock" if run.unsafe else "inside lock"
    stock_lock = "WITHOUT the lock" if run.unsafe else "under lock"
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
            orders,
            None,
            f"{settings.stock} vouchers for {settings.users} users; {left} left in stock",
        ),
        Row(
            "duplicates prevented",
            progress.duplicates,
            duplicate_orders == 0 and progress.duplicates == expected_duplicates,
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
            oversold,
            oversold == 0 and left >= 0,
            f"orders without a voucher: the stock is a non-atomic GET, pause, SET {stock_lock} "
            f"stock:{VOUCHER}; {sold} taken from stock, {orders} orders",
        ),
        Row(
            "watchdog renewals",
            renewals,
            report_ok and report_renewals >= 1 and report.probe == "held",
            f"the {settings.report_seconds:g}s report job on a {settings.lease:g}s lease was renewed "
            f"{report_renewals} time(s) and finished with its lock; {probe}"
            if report_ok
            else f"the report job failed: {report.result.get('error') if report.result else 'no result'}",
        ),
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


def _cleanup(store: Any, prefix: str) -> None:
    keys = list(store.scan_iter(match=prefix + "*", count=500))
    for start in range(0, len(keys), 500):
        store.delete(*keys[start : start + 500])


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C, so the server and workers are always cleaned up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(options: DemoOptions, *, reporter: Reporter | None = None) -> int:
    """Run the demo; return the exit status (0: every invariant held)."""
    if not hasattr(signal, "SIGSTOP"):
        print("lockaspect demo needs POSIX signals (SIGSTOP/SIGCONT)", file=sys.stderr)
        return 1
    if not MIN_WORKERS <= options.workers <= MAX_WORKERS:
        print(f"--workers must be between {MIN_WORKERS} and {MAX_WORKERS}", file=sys.stderr)
        return 2
    out = reporter or make_reporter(plain=options.plain)
    server: LockServer | None = None
    with _terminate_as_interrupt():
        try:
            if options.url is None:
                # The demo is an application of the library, like a user's test suite: it
                # may use the testing kit's server starter (the library itself never does).
                from .testing import LockServer

                try:
                    server = LockServer()
                except FileNotFoundError as exc:
                    print(f"lockaspect demo: {exc}\n(or pass --url redis://host:port/0)", file=sys.stderr)
                    return 1
                try:
                    process = server.start().process
                except (RuntimeError, OSError) as exc:
                    print(f"lockaspect demo: cannot start {server.binary}: {exc}", file=sys.stderr)
                    return 1
                assert process is not None
                url = server.url
                out.line(f"started embedded {server.kind}-server {server.version} (pid {process.pid}) on {url}")
            else:
                url = options.url
            return _run(options, url, out, embedded=server is not None)
        except KeyboardInterrupt:
            out.line("interrupted: stopping the workers and the server")
            return 130
        finally:
            if server is not None:
                pid = server.process.pid if server.process is not None else None
                server.stop()  # also after a failed or interrupted start
                if pid is not None:
                    out.line(f"stopped embedded server (pid {pid})")


def _run(options: DemoOptions, url: str, out: Reporter, *, embedded: bool) -> int:
    settings = QUICK if options.quick else FULL
    prefix = f"lockaspect-demo:{uuid.uuid4().hex[:8]}:"
    store = redis.Redis.from_url(url, socket_timeout=10)
    try:
        try:
            store.ping()
        except redis.RedisError as exc:
            print(f"lockaspect demo: cannot reach {url}: {exc}", file=sys.stderr)
            return 1
        requests, per_user = _make_requests(settings)
        run = _Run(settings, url, prefix, options.unsafe, out)
        run.requests.extend(requests)
        run.requests_per_user = per_user
        store.set(prefix + f"stock:{VOUCHER}", settings.stock)
        progress = Progress(len(requests), settings.stock, settings.report_seconds, settings.lease)
        mode = "WITHOUT locks (--unsafe)" if options.unsafe else "with lockaspect locks"
        out.line(
            f"flash sale {mode}: {settings.stock} x {VOUCHER} for {settings.users} users sending "
            f"{len(requests)} requests, {options.workers} worker processes, {settings.lease:g}s watchdog lease"
        )
        if not embedded:
            out.line(f"on {url}: the demo's keys live under {prefix!r} and are deleted at the end")
        probe_client = LockClient.from_url(url, namespace=prefix + "locks:")
        run.t0 = time.monotonic()
        completed = False
        try:
            _start_workers(run, options.workers)
            out.line("workers: " + ", ".join(f"{w.index}=pid {w.pid}" for w in run.workers))
            _conduct(run, progress, probe_client)
            completed = True
        except DemoFailed as exc:
            run.failures.append(str(exc))
        finally:
            out.stop()
            # After a complete run the workers report their counters and exit; otherwise
            # (Ctrl-C, a failure) they are terminated at once.
            _stop_workers(run, graceful=completed)
            probe_client.close()
        wall = _elapsed(run)
        try:
            rows = _rows(run, progress, store)
        except redis.RedisError as exc:
            for problem in run.failures:
                out.line(f"problem: {problem}")
            out.line(f"FAILED: could not read the final state from {url}: {type(exc).__name__}: {exc}")
            return 1
        out.table(rows, wall)
        failed = [r for r in rows if r.ok is False]
        for problem in run.failures:
            out.line(f"problem: {problem}")
        if failed or run.failures:
            names = ", ".join(r.label for r in failed) or "see the problems above"
            extra = " (as expected without the locks)" if options.unsafe else ""
            out.line(f"FAILED: invariants violated{extra}: {names}")
            return 1
        out.line(
            "All invariants hold: one order per user, nothing oversold, the long job kept its lock, "
            "and the frozen worker was told it lost its lock and could not overwrite the ledger."
        )
        return 0
    finally:
        try:
            _cleanup(store, prefix)
        except redis.RedisError:
            pass
        store.close()
