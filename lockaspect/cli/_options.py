"""The subcommands' arguments, help texts and exit codes (argparse only: nothing heavy here)."""

from __future__ import annotations

import argparse
import math
import textwrap
from typing import Any

__all__ = [
    "EXIT_LOCK_LOST",
    "EXIT_NOT_ACQUIRED",
    "EXIT_STORE",
    "EXIT_USAGE",
    "add_common",
    "add_demo",
    "add_doctor",
    "add_inspect",
    "add_list",
    "add_release",
    "add_run",
]

#: A usage error: a bad option, a missing URL, a refused confirmation (argparse uses 2 too).
EXIT_USAGE = 2
#: The store could not be reached or failed (list, inspect, release, run before the command).
EXIT_STORE = 69
#: ``run``: the lock was not acquired within ``--wait`` (sysexits' EX_TEMPFAIL: try later).
EXIT_NOT_ACQUIRED = 75
#: ``run``: the lock was lost while the command ran (it was stopped).
EXIT_LOCK_LOST = 76

_COMMON_CODES = f"""
  {EXIT_USAGE}   a usage error (a bad option, no --url and no LOCKASPECT_URL, a bad URL)
  {EXIT_STORE}  the store could not be reached, or failed"""

_Subparsers = Any  # argparse._SubParsersAction, private in typeshed


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


#: ``--help`` texts fit an 80-column terminal.
_HELP_WIDTH = 79


def _exit_statuses(codes: str) -> str:
    """The ``exit status:`` list, each entry wrapped under its own text."""
    lines = ["exit status:"]
    for entry in codes.strip("\n").splitlines():
        lines += textwrap.wrap(entry, _HELP_WIDTH, subsequent_indent=" " * 6)
    return "\n".join(lines)


def _parser(commands: _Subparsers, name: str, help_text: str, description: str, codes: str) -> Any:
    return commands.add_parser(
        name,
        help=help_text,
        description=textwrap.fill(description, _HELP_WIDTH),
        epilog=_exit_statuses(codes),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_common(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--url``, ``--namespace``, ``--json`` and ``--plain``."""
    group = parser.add_argument_group("store and output")
    group.add_argument(
        "--url",
        help="the lock store: redis://host:6379/0, rediss://, unix:///path.sock, redis+cluster://, "
        "redis+sentinel://, postgresql://, postgresql+table://, sqlite:///path.db, zookeeper://, memory:// "
        "(default: the environment variable LOCKASPECT_URL)",
    )
    group.add_argument(
        "--namespace",
        default="lockaspect:",
        help="the prefix of the locks' keys, as given to LockClient.from_url (default: %(default)s)",
    )
    group.add_argument("--json", action="store_true", help="machine-readable output (JSON)")
    group.add_argument(
        "--plain",
        action="store_true",
        help="plain text tables even on a terminal where rich is installed (also: LOCKASPECT_PLAIN=1)",
    )
    return parser


def add_list(commands: _Subparsers) -> Any:
    parser = _parser(
        commands,
        "list",
        "the locks held now: kind, holders, fencing token, remaining lease, waiters",
        "The locks held now in the namespace whose key matches PATTERN (a glob: *, ?, [...]), one row per "
        "holder: host/pid and function (or thread), fencing token, remaining lease, waiters. Redis walks "
        "the namespace with SCAN, never KEYS. --json prints a list of the describe() objects (with --watch: "
        "one list per line and refresh).",
        "\n  0   listed (also when nothing is held)" + _COMMON_CODES,
    )
    parser.add_argument("pattern", nargs="?", default="*", metavar="PATTERN", help="a glob over keys (default: *)")
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted (Ctrl-C)")
    parser.add_argument(
        "--interval", type=_positive_seconds, default=2.0, metavar="S", help="seconds between refreshes (default: 2)"
    )
    parser.set_defaults(handler="_inspect:list_command")
    return parser


def add_inspect(commands: _Subparsers) -> Any:
    parser = _parser(
        commands,
        "inspect",
        "everything the store knows about one lock",
        "Who holds KEY (host, pid, thread or task, decorated function and key template, when it was taken, "
        "its fencing token and the first characters of its token, its remaining lease), how many wait, and "
        "a semaphore's permits. A key's name may carry a lock, a read-write lock and a semaphore at once: "
        "--kind picks one, otherwise the first held in that order.",
        "\n  0   the key is held (its holders were printed)"
        "\n  1   nobody holds the key (--json prints null)" + _COMMON_CODES,
    )
    parser.add_argument("key", metavar="KEY", help="the lock's key, without the namespace (e.g. order:42)")
    parser.add_argument(
        "--kind", choices=["lock", "fair", "read", "write", "rw", "semaphore"], help="which lock at KEY to show"
    )
    parser.set_defaults(handler="_inspect:inspect_command")
    return parser


def add_release(commands: _Subparsers) -> Any:
    parser = _parser(
        commands,
        "release",
        "force-release a lock: evict whoever holds it (needs --force)",
        "Delete the lock of every kind at KEY, whoever holds it, with its queue state, and wake its waiters. "
        "The evicted holder learns it at its next renewal (its on_lost hook runs, its call raises LockLost); "
        "the fencing counter is kept, so the next holder's token is larger. Asks for confirmation on the "
        "terminal unless --yes; without a terminal and without --yes it refuses.",
        "\n  0   something was held, and was evicted (who is printed)"
        "\n  1   nothing was released: nothing was held, or the confirmation was answered no"
        "\n  2   refused: no --force, or no --yes and no terminal to ask on (and the usage errors)"
        f"\n  {EXIT_STORE}  the store could not be reached, or failed",
    )
    parser.add_argument("key", metavar="KEY", help="the lock's key, without the namespace")
    parser.add_argument("--force", action="store_true", help="yes, evict the holder (required)")
    parser.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    parser.set_defaults(handler="_inspect:release_command")
    return parser


def add_run(commands: _Subparsers) -> Any:
    parser = _parser(
        commands,
        "run",
        "run a command while holding a lock (renewed); stop it if the lock is lost",
        "Take the lock KEY, run COMMAND while the watchdog renews it, release it when COMMAND exits. "
        "COMMAND gets LOCKASPECT_KEY and LOCKASPECT_FENCING_TOKEN in its environment. It runs in a session "
        "(process group) of its own: SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to "
        "'lockaspect run' are forwarded to that whole group, and the lock is released after COMMAND "
        "exits. If the lock is lost (force-released, or not renewable in time) the group gets SIGTERM, "
        "then SIGKILL after --grace seconds. If 'lockaspect run' itself is killed with SIGKILL, COMMAND "
        "keeps running and the lock expires within --lease seconds.",
        "\n  N   COMMAND's own exit status (128+S when it died of signal S, as shells report it)"
        f"\n  {EXIT_NOT_ACQUIRED}  the lock was not acquired within --wait (COMMAND did not run)"
        f"\n  {EXIT_LOCK_LOST}  the lock was lost while COMMAND ran (COMMAND was stopped)"
        "\n  126 COMMAND could not be executed (127: it was not found); the lock is released" + _COMMON_CODES,
    )
    parser.add_argument("key", metavar="KEY", help="the lock's key, without the namespace")
    parser.add_argument("command", nargs="*", metavar="-- COMMAND", help="the command and its arguments, after --")
    parser.add_argument(
        "--wait",
        type=_seconds,
        default=None,
        metavar="S",
        help=f"give up (exit {EXIT_NOT_ACQUIRED}) if the lock is not acquired within S seconds; 0 tries once "
        "(default: wait as long as it takes)",
    )
    parser.add_argument(
        "--lease",
        type=_positive_seconds,
        default=30.0,
        metavar="S",
        help="the lease the watchdog keeps renewing (every ~0.9 S) while COMMAND runs; if this process dies, "
        "the lock frees within S seconds (default: 30)",
    )
    parser.add_argument(
        "--kind",
        choices=["lock", "fair", "read", "write"],
        default="lock",
        help="a plain lock (default), a fair one (first come, first served), or a read-write lock's read or write side",
    )
    parser.add_argument(
        "--permits", type=_count, metavar="N", help="take one permit of a semaphore of N permits instead of a lock"
    )
    parser.add_argument(
        "--grace",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when the lock is lost (default: 10)",
    )
    parser.set_defaults(handler="_run:run_command")
    return parser


def add_doctor(commands: _Subparsers) -> Any:
    parser = _parser(
        commands,
        "doctor",
        "check the store for what lockaspect needs, one verdict per line",
        "Redis and Valkey: server version and features (scripts, pub/sub, sharded pub/sub), the connecting "
        "user's ACL against the exact commands lockaspect sends (and the minimal ACL rule to grant), "
        "maxmemory-policy, persistence, replicas, round-trip latency and the clock. The other stores: "
        "reachability, version, latency and what is cheap to check there. Verdicts: ok, warn, error, "
        "info (nothing is called ok that was not checked).",
        "\n  0   every check passed (info lines are not problems)"
        "\n  1   warnings: e.g. an eviction policy that can evict held locks, no persistence, a setting "
        "doctor could not read"
        "\n  2   errors: the store cannot be reached, the user lacks a command lockaspect needs (and the "
        "usage errors)",
    )
    parser.add_argument(
        "--wait-replicas",
        type=_count,
        metavar="N",
        help="your clients use wait_replicas=(N, ...): check that N replicas are connected",
    )
    parser.set_defaults(handler="_doctor:doctor_command")
    return parser


def _workers(text: str) -> int:
    from ..demo import MAX_WORKERS, MIN_WORKERS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not MIN_WORKERS <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be between {MIN_WORKERS} and {MAX_WORKERS}, got {value}")
    return value


def add_demo(commands: _Subparsers) -> Any:
    demo = commands.add_parser(
        "demo",
        help="run the flash-sale demo (embedded server unless --url)",
        description=(
            "A flash sale run by several worker processes: one order per user, no overselling, "
            "a long job kept alive by the watchdog, and a worker frozen with SIGSTOP past its "
            "lease whose stale write is rejected by the fencing token. Exits 0 when every "
            "invariant holds, 1 otherwise."
        ),
    )
    demo.add_argument(
        "--url",
        help="use this Redis/Valkey server (redis://host:port/db) instead of starting an embedded one, "
        "or a SQLite file and no server at all (sqlite:///demo.db, sqlite:////abs/path.db); "
        "the demo writes only keys (rows) under 'lockaspect-demo:' and deletes them at the end",
    )
    demo.add_argument("--workers", type=_workers, default=4, metavar="N", help="worker processes (default: 4)")
    demo.add_argument("--quick", action="store_true", help="a smaller, faster run (a few seconds)")
    demo.add_argument(
        "--unsafe",
        action="store_true",
        help="take the orders WITHOUT the locks, to see what they prevent (expect duplicates, overselling, exit 1)",
    )
    demo.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    demo.set_defaults(handler="_demo:demo_command")
    return demo
