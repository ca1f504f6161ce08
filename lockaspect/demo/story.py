"""The parent's event loop: hand out the work, act on the workers' messages, freeze and
continue the ledger worker, and probe the report job's lock.

The story, in the order the parent drives it: the report job goes to the first idle
worker; once a share of the requests is answered, another worker takes the ledger lock and
is frozen with SIGSTOP; a third takes the lock over and writes the ledger; then the frozen
worker is continued and tries its stale write. The requests fill the gaps.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_connections
from typing import Any

from lockaspect import LockClient, LockNotAcquired

from .pool import DemoFailed, Run, Worker, event, send
from .report import LEDGER_STEPS, Progress
from .scenario import DUPLICATE, LEDGER_BOOK, LEDGER_WAIT, PLACED, REPORT_DAY, SOLD_OUT

__all__ = ["conduct"]


def conduct(run: Run, progress: Progress, probe_client: LockClient) -> None:
    """Run the sale and the story until everything is answered (or the deadline passes)."""
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


def _finished(run: Run, progress: Progress) -> bool:
    ledger = run.ledger
    return (
        progress.requests_done >= progress.requests_total
        and progress.report_done
        and ledger.result is not None
        and (ledger.rescued is not None or "error" in ledger.result)
        and all(w.busy is None for w in run.workers)
    )


def _dispatch(run: Run, progress: Progress) -> None:
    """Keep every idle worker busy: story steps first, then the requests."""
    settings = run.settings
    ledger, report = run.ledger, run.report
    for worker in run.workers:
        if worker.busy is not None or worker.stopped:
            continue
        if not report.dispatched:
            report.dispatched = True
            send(worker, ("report", REPORT_DAY, settings.report_seconds))
            continue
        if not ledger.started and (
            progress.requests_done >= settings.ledger_after * progress.requests_total or not run.requests
        ):
            ledger.started = True
            ledger.zombie = worker.index
            progress.ledger_text = "taking ledger lock"
            send(worker, ("ledger_hold",))
            continue
        if run.specials:
            send(worker, run.specials.popleft())
            continue
        if run.requests:
            number, user = run.requests.popleft()
            send(worker, ("order", number, user))


def _probe_report(run: Run, client: LockClient) -> None:
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
        event(run, f"probe at {age:.1f}s into the report job: {report.key!r} is still locked{ttl}")
    else:
        event(run, f"probe at {age:.1f}s into the report job: {report.key!r} was {report.probe}!")


def _resume_zombie(run: Run, progress: Progress) -> None:
    """SIGCONT the frozen ledger worker and let it go on with its (now stale) write."""
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
    event(run, f"SIGCONT worker {worker.index} after {ledger.paused_for:.1f}s: it still thinks it holds the lock")
    progress.ledger_step, progress.ledger_text = 3, f"worker {worker.index} resumed"


# -- the workers' messages ----------------------------------------------------------------

_Handler = Callable[[Run, Worker, tuple[Any, ...], Progress], None]


def _on_message(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    handler = _MESSAGES.get(message[0])
    if handler is None:
        run.failures.append(f"worker {worker.index} sent an unexpected message {message!r}")
        return
    handler(run, worker, message, progress)


def _on_done(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    """A task is answered: ``("done", task kind, result ...)``."""
    worker.busy = None
    handler = _DONE.get(message[1])
    if handler is not None:
        handler(run, worker, message, progress)


def _order_done(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
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


def _report_done(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    report = run.report
    report.result = message[2]
    progress.report_done = True
    if report.result.get("ok"):
        progress.report_renewals = report.result["renewals"]
        event(
            run,
            f"report job done after {run.settings.report_seconds:g}s on a {run.settings.lease:g}s lease: "
            f"the watchdog renewed it {progress.report_renewals} time(s)",
        )
    else:
        event(run, f"report job failed: {report.result.get('error')}")


def _rescue_done(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    """Another worker took the ledger lock over and wrote the ledger: continue the frozen one."""
    ledger = run.ledger
    ledger.rescued = message[2]
    token = ledger.rescued.get("token")
    ok = "accepted" if ledger.rescued.get("written") else "REJECTED"
    event(run, f"worker {worker.index} took ledger:{LEDGER_BOOK} (fencing token {token}); its fenced write: {ok}")
    progress.ledger_step, progress.ledger_text = 2, f"worker {worker.index} wrote with token {token}"
    _resume_zombie(run, progress)


def _hold_done(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    """The continued worker's verdict: was its stale write rejected, was it told?"""
    ledger = run.ledger
    ledger.result = message[2]
    result = ledger.result
    written = result.get("written")
    verdict = "REJECTED" if written is False else ("accepted!" if written else "not attempted")
    event(run, f"worker {worker.index} resumed; its fenced write with stale token {ledger.zombie_token}: {verdict}")
    if result.get("lock_lost"):
        hook = "on_lost hook ran" if result.get("hook") else "on_lost hook did NOT run"
        event(
            run,
            f"worker {worker.index}: settle_ledger() raised LockLost(reason={result.get('reason')!r}), "
            f"lease.lost={result.get('lease_lost')}, {hook}",
        )
    else:
        event(run, f"worker {worker.index}: settle_ledger() returned normally: the lost lease went unnoticed")
    progress.ledger_step = LEDGER_STEPS
    progress.ledger_text = "stale write rejected" if written is False else "stale write NOT rejected"


def _on_report_started(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    """The report job holds its lock: schedule the probe half a second past its first lease."""
    report = run.report
    _, report.key, token, lease_time = message
    report.started_at = time.monotonic()
    report.probe_at = report.started_at + lease_time + 0.5
    event(
        run,
        f"worker {worker.index} runs a {run.settings.report_seconds:g}s report job on a "
        f"{lease_time:g}s watchdog lease ({report.key!r}, fencing token {token})",
    )


def _on_report_progress(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    progress.report_elapsed, progress.report_renewals = message[1], message[2]


def _on_log(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    _, level, name, text = message
    event(run, f"worker {worker.index} logged {level} {name}: {text}")


def _on_ledger_held(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    """The worker holds the ledger lock and waits for us: freeze it past its lease, and
    queue the rescue for another worker."""
    ledger = run.ledger
    _, pid, token, lease_time = message
    ledger.zombie_pid, ledger.zombie_token = pid, token
    os.kill(pid, signal.SIGSTOP)
    worker.stopped = True
    ledger.stopped_at = time.monotonic()
    event(
        run,
        f"worker {worker.index} (pid {pid}) holds ledger:{LEDGER_BOOK} with fencing token {token}: "
        f"SIGSTOP, frozen past its {lease_time:g}s lease (its watchdog is frozen too)",
    )
    progress.ledger_step, progress.ledger_text = 1, f"worker {worker.index} frozen (token {token})"
    run.specials.append(("ledger_rescue",))


def _on_failed(run: Run, worker: Worker, message: tuple[Any, ...], progress: Progress) -> None:
    """A task raised in the worker: ``("failed", task kind, traceback)``; the run fails."""
    ledger = run.ledger
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


_DONE: dict[str, _Handler] = {
    "order": _order_done,
    "report": _report_done,
    "ledger_rescue": _rescue_done,
    "ledger_hold": _hold_done,
}

_MESSAGES: dict[str, _Handler] = {
    "done": _on_done,
    "report_started": _on_report_started,
    "log": _on_log,
    "report_progress": _on_report_progress,
    "ledger_held": _on_ledger_held,
    "failed": _on_failed,
}
