"""``lockaspect run KEY -- COMMAND``: hold a lock while a command runs (``consul lock``'s
behaviour, not ``etcdctl lock``'s: a lost lock stops the command).

The lock is taken in watchdog mode (``lease=None`` on a client whose ``watchdog_lease`` is
``--lease``), so it is renewed every ~0.9 lease until the command exits, then released. The
command runs in a session of its own (``setsid``: its own process group) so that stopping it
stops what it started too: the signals ``run`` forwards and the SIGTERM/SIGKILL of a lost lock
go to that whole group. Everything that happens (a signal to forward, the command's exit, the
lost lease, told by ``on_lost`` from the hooks thread) arrives on one queue that the main
thread reads; ``SimpleQueue.put`` is reentrant, so signal handlers may use it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ._common import CliError, command, open_client, store_errors
from ._options import EXIT_LOCK_LOST, EXIT_NOT_ACQUIRED, EXIT_STORE, EXIT_USAGE

if TYPE_CHECKING:
    from .. import Lease, LockClient

__all__ = ["run_command"]

#: Signals sent to ``run`` that it passes on to the command's process group.
FORWARDED = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)  # fmt: skip
#: Signals that abort the wait for the lock (before the command started).
ABORTING = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

#: The shells' statuses for a command that could not be executed / was not found.
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

Event = tuple[str, Any]


class _Aborted(BaseException):
    """A signal arrived while waiting for the lock."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _say(text: str) -> None:
    print(f"lockaspect run: {text}", file=sys.stderr, flush=True)


def _lock_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.permits is not None:
        if args.kind != "lock":
            raise CliError(f"--permits takes a semaphore's permit: it does not combine with --kind {args.kind}", 2)
        return {"permits": args.permits}
    if args.kind == "fair":
        return {"fair": True}
    if args.kind in ("read", "write"):
        return {"mode": args.kind}
    return {}


@contextmanager
def _handlers(signals: tuple[int, ...], handler: Callable[[int, Any], None]) -> Iterator[None]:
    previous = {signum: signal.signal(signum, handler) for signum in signals}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _acquire(client: LockClient, args: argparse.Namespace, events: queue.SimpleQueue[Event]) -> Lease:
    """The lease on ``args.key``; a signal meanwhile aborts the wait (:class:`_Aborted`)."""
    from ..errors import LockNotAcquired

    def abort(signum: int, frame: Any) -> None:
        raise _Aborted(signum)

    def lost(lease: Lease) -> None:
        events.put(("lost", lease.lost_reason or "lost"))

    with _handlers(ABORTING, abort), store_errors():
        # One round trip first: a store that cannot be reached fails now, not after --wait
        # (acquiring retries transient errors for as long as it may wait).
        client.locked(args.key)
        try:
            return client.acquire(args.key, lease=None, wait=args.wait, on_lost=lost, **_lock_options(args))
        except LockNotAcquired as exc:
            raise CliError(f"not acquired: {exc}", EXIT_NOT_ACQUIRED) from exc


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _supervise(
    child: subprocess.Popen[bytes], events: queue.SimpleQueue[Event], grace: float, key: str
) -> tuple[int, bool]:
    """Forward signals until the command exits; stop it if the lease is lost. Returns the
    command's exit status (``-N``: killed by signal N) and whether the lease was lost."""
    lost = False
    kill_at: float | None = None
    while True:
        try:
            timeout = None if kill_at is None else max(0.0, kill_at - time.monotonic())
            kind, value = events.get(timeout=timeout)
        except queue.Empty:
            _say(f"the command did not exit within {grace:g}s of SIGTERM: sending SIGKILL")
            _signal_group(child.pid, signal.SIGKILL)
            kill_at = None
            continue
        if kind == "exit":
            return int(value), lost
        if kind == "signal":
            _signal_group(child.pid, value)
        elif kind == "lost" and not lost:
            lost = True
            _say(f"lost the lock on {key!r} ({value}): stopping the command (SIGTERM, then SIGKILL after {grace:g}s)")
            _signal_group(child.pid, signal.SIGTERM)
            kill_at = time.monotonic() + grace


def _spawn(words: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | int:
    """The running command, or the shells' status when it cannot start."""
    try:
        return subprocess.Popen(words, env=env, start_new_session=True)
    except FileNotFoundError:
        _say(f"command not found: {words[0]!r}")
        return EXIT_NOT_FOUND
    except OSError as exc:
        _say(f"cannot execute {words[0]!r}: {exc.strerror or exc}")
        return EXIT_NOT_EXECUTABLE


def _release(lease: Lease) -> bool:
    """Release; ``False`` when the store says the lease was lost meanwhile."""
    from ..errors import BackendError, LockLost

    try:
        lease.release()
    except LockLost:
        return False
    except BackendError as exc:
        _say(f"could not release the lock ({exc}); it expires with its lease")
    return True


def _report(args: argparse.Namespace, outcome: str, status: int, token: int | None = None) -> int:
    if args.json:
        record = {"key": args.key, "outcome": outcome, "exit_status": status, "fencing_token": token}
        print(json.dumps(record), file=sys.stderr, flush=True)
    return status


@command("run")
def run_command(args: argparse.Namespace) -> int:
    words: list[str] = list(args.command or [])
    if not words:
        raise CliError("no command to run: lockaspect run KEY [options] -- COMMAND [ARGS...]", EXIT_USAGE)
    _lock_options(args)
    client = open_client(args, watchdog_lease=args.lease)
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    try:
        try:
            lease = _acquire(client, args, events)
        except _Aborted as exc:
            return _report(args, "interrupted", 128 + exc.signum)
        except CliError as exc:
            outcome = {EXIT_NOT_ACQUIRED: "not-acquired", EXIT_STORE: "store-error"}.get(exc.status, "error")
            _say(str(exc))
            return _report(args, outcome, exc.status)
        token = lease.fencing_token
        with _handlers(FORWARDED, lambda signum, frame: events.put(("signal", signum))):
            env = dict(
                os.environ, LOCKASPECT_KEY=args.key, LOCKASPECT_FENCING_TOKEN="" if token is None else str(token)
            )
            child = _spawn(words, env)
            if isinstance(child, int):
                _release(lease)
                return _report(args, "not-started", child, token)
            waiter = threading.Thread(
                target=lambda: events.put(("exit", child.wait())), name="lockaspect-run-wait", daemon=True
            )
            waiter.start()
            status, lost = _supervise(child, events, args.grace, args.key)
            kept = _release(lease) and not lost
    finally:
        client.close()
    if not kept:
        if not lost:
            _say(f"the lock on {args.key!r} was lost while the command ran (found at its release)")
        return _report(args, "lost", EXIT_LOCK_LOST, token)
    return _report(args, "exited", status if status >= 0 else 128 - status, token)
