"""The parent process: start the server (or use ``--url``: a Redis server, or a SQLite file
and no server at all), prepare the sale, run the workers through the story, and judge the
invariants. :func:`run_demo` is what ``lockaspect demo`` calls."""

from __future__ import annotations

import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

from lockaspect import LockClient, LockError

from .data import DataUnavailable, ShopData, open_data, resolve_url
from .invariants import rows
from .pool import DemoFailed, Run, elapsed, start_workers, stop_workers
from .report import Progress, Reporter, make_reporter
from .scenario import FULL, MAX_WORKERS, MIN_WORKERS, QUICK, VOUCHER, make_requests
from .story import conduct

if TYPE_CHECKING:
    from lockaspect.testing import LockServer

__all__ = ["DemoOptions", "run_demo"]


@dataclass
class DemoOptions:
    """The options of ``lockaspect demo`` (see ``lockaspect demo --help``)."""

    url: str | None = None
    workers: int = 4
    quick: bool = False
    unsafe: bool = False
    plain: bool = False


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
                from lockaspect.testing import LockServer

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
            out.line("interrupted: stopping the workers" + (" and the server" if server is not None else ""))
            return 130
        finally:
            if server is not None:
                pid = server.process.pid if server.process is not None else None
                server.stop()  # also after a failed or interrupted start
                if pid is not None:
                    out.line(f"stopped embedded server (pid {pid})")


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


def _run(options: DemoOptions, url: str, out: Reporter, *, embedded: bool) -> int:
    """One run on the store at ``url``; the demo's data is deleted at the end, whatever happens."""
    prefix = f"lockaspect-demo:{uuid.uuid4().hex[:8]}:"
    try:
        url = resolve_url(url)  # a relative SQLite path made absolute, for every process
        store = open_data(url, prefix, create=True)
    except DataUnavailable as exc:
        print(f"lockaspect demo: {exc}", file=sys.stderr)
        return 1
    try:
        try:
            probe_client = LockClient.from_url(url, namespace=prefix + "locks:")
        except LockError as exc:
            print(f"lockaspect demo: cannot open the lock store at {url}: {exc}", file=sys.stderr)
            return 1
        try:
            run, progress = _prepare(options, url, prefix, out, store, embedded=embedded)
            _perform(run, progress, options.workers, probe_client)
        finally:
            probe_client.close()
        return _verdict(run, progress, store)
    finally:
        try:
            store.cleanup()
        except store.errors:
            pass
        store.close()


def _prepare(
    options: DemoOptions, url: str, prefix: str, out: Reporter, store: ShopData, *, embedded: bool
) -> tuple[Run, Progress]:
    """Stock the shop, line up the requests, and say what is about to happen."""
    settings = QUICK if options.quick else FULL
    requests, per_user = make_requests(settings)
    run = Run(settings, url, prefix, options.unsafe, out)
    run.requests.extend(requests)
    run.requests_per_user = per_user
    store.set_stock(VOUCHER, settings.stock)
    progress = Progress(len(requests), settings.stock, settings.report_seconds, settings.lease)
    mode = "WITHOUT locks (--unsafe)" if options.unsafe else "with lockaspect locks"
    out.line(
        f"flash sale {mode}: {settings.stock} x {VOUCHER} for {settings.users} users sending "
        f"{len(requests)} requests, {options.workers} worker processes, {settings.lease:g}s watchdog lease"
    )
    if not embedded:
        out.line(f"on {store.where}: {store.footprint}")
    return run, progress


def _perform(run: Run, progress: Progress, workers: int, probe_client: LockClient) -> None:
    """Start the workers, conduct the sale and the story, and stop the workers again.
    A failure of the run itself is recorded in ``run.failures``."""
    out = run.reporter
    run.t0 = time.monotonic()
    completed = False
    try:
        start_workers(run, workers)
        out.line("workers: " + ", ".join(f"{w.index}=pid {w.pid}" for w in run.workers))
        conduct(run, progress, probe_client)
        completed = True
    except DemoFailed as exc:
        run.failures.append(str(exc))
    finally:
        out.stop()
        # After a complete run the workers report their counters and exit; otherwise
        # (Ctrl-C, a failure) they are terminated at once.
        stop_workers(run, graceful=completed)


def _verdict(run: Run, progress: Progress, store: ShopData) -> int:
    """Print the table and the problems; 0 when every invariant held, 1 otherwise."""
    out = run.reporter
    wall = elapsed(run)
    try:
        table = rows(run, progress, store)
    except store.errors as exc:
        for problem in run.failures:
            out.line(f"problem: {problem}")
        out.line(f"FAILED: could not read the final state from {run.url}: {type(exc).__name__}: {exc}")
        return 1
    out.table(table, wall)
    failed = [r for r in table if r.ok is False]
    for problem in run.failures:
        out.line(f"problem: {problem}")
    if failed or run.failures:
        names = ", ".join(r.label for r in failed) or "see the problems above"
        extra = " (as expected without the locks)" if run.unsafe else ""
        out.line(f"FAILED: invariants violated{extra}: {names}")
        return 1
    out.line(
        "All invariants hold: one order per user, nothing oversold, the long job kept its lock, "
        "and the frozen worker was told it lost its lock and could not overwrite the ledger."
    )
    return 0
