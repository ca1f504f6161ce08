"""The parent's side of the worker processes: the state of a run, and starting, feeding
and stopping the workers.

Each worker has a pipe of its own to the parent (no lock shared between processes, so
freezing one worker with SIGSTOP cannot block the others).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import Any

from . import workers as worker_module
from .report import Reporter
from .scenario import WORKER_START_TIMEOUT, Settings, User

__all__ = [
    "DemoFailed",
    "Ledger",
    "ReportJob",
    "Run",
    "Worker",
    "elapsed",
    "event",
    "send",
    "start_workers",
    "stop_workers",
]


class DemoFailed(Exception):
    """The run could not complete (a worker died, the deadline passed, ...)."""


@dataclass
class Worker:
    """One worker process, as the parent sees it."""

    index: int
    process: Any
    conn: Connection
    pid: int = 0
    ready: bool = False
    busy: tuple[Any, ...] | None = None
    stats: dict[str, int] | None = None
    stopped: bool = False  # SIGSTOPped by us


@dataclass
class Ledger:
    """The ledger story: a worker frozen past its lease, another taking the lock over."""

    started: bool = False
    zombie: int | None = None  # worker index
    zombie_pid: int = 0
    zombie_token: int = 0
    stopped_at: float = 0.0
    paused_for: float = 0.0
    rescued: dict[str, Any] | None = None
    result: dict[str, Any] | None = None


@dataclass
class ReportJob:
    """The long report job kept alive by the watchdog, and the parent's probe of its lock."""

    dispatched: bool = False
    key: str = ""
    started_at: float = 0.0
    probe_at: float = 0.0
    probe: str | None = None  # "held" / "free" / error text
    probe_ttl: float | None = None
    result: dict[str, Any] | None = None


@dataclass
class Run:
    """Everything the parent knows about one run."""

    settings: Settings
    url: str
    prefix: str
    unsafe: bool
    reporter: Reporter
    requests: deque[tuple[int, User]] = field(default_factory=deque)
    requests_per_user: dict[int, int] = field(default_factory=dict)
    specials: deque[tuple[Any, ...]] = field(default_factory=deque)
    workers: list[Worker] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    report: ReportJob = field(default_factory=ReportJob)
    t0: float = 0.0


def elapsed(run: Run) -> float:
    return time.monotonic() - run.t0


def event(run: Run, text: str) -> None:
    run.reporter.event(elapsed(run), text)


def send(worker: Worker, task: tuple[Any, ...]) -> None:
    worker.busy = task
    worker.conn.send(task)


def start_workers(run: Run, count: int) -> None:
    """Start ``count`` worker processes and wait until each has said it is ready."""
    # Fresh interpreters, not forks of this (threaded) process. A fork server imports the
    # demo once and forks the workers from that clean state: cheaper than N spawns.
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx: Any = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([worker_module.__name__])
    else:  # pragma: no cover - platforms without fork
        ctx = multiprocessing.get_context("spawn")
    for index in range(count):
        parent_end, child_end = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=worker_module.worker_main,
            args=(index, child_end, run.url, run.prefix, run.settings, run.unsafe),
            name=f"lockaspect-demo-worker-{index}",
            daemon=True,
        )
        process.start()
        child_end.close()
        run.workers.append(Worker(index, process, parent_end))
    _await_ready(run)


def _await_ready(run: Run) -> None:
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


def stop_workers(run: Run, *, graceful: bool) -> None:
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
    _collect_counters(run, deadline)
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


def _collect_counters(run: Run, deadline: float) -> None:
    """Read each worker's ``stats`` reply until ``deadline`` (``{}`` when its pipe closed)."""
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
