"""The ``lockaspect`` command.

    lockaspect demo [--url URL] [--workers N] [--quick] [--unsafe] [--plain]

``--url`` is a Redis server or a SQLite file (``sqlite:///demo.db``).

Subcommands are registered in :func:`build_parser`; each sets ``handler`` to a function
taking the parsed arguments and returning the exit status. (``inspect`` and ``release``
are planned.) Heavy imports happen inside the handlers, so ``lockaspect --help`` is fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _workers(text: str) -> int:
    from .demo import MAX_WORKERS, MIN_WORKERS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not MIN_WORKERS <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be between {MIN_WORKERS} and {MAX_WORKERS}, got {value}")
    return value


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(url=args.url, workers=args.workers, quick=args.quick, unsafe=args.unsafe, plain=args.plain)
    )


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="lockaspect",
        description="Distributed locks as a decorator, on Redis and Valkey.",
    )
    parser.add_argument("--version", action="version", version=f"lockaspect {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

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
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lockaspect`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        print("\nlockaspect: a command is required (try: lockaspect demo)", file=sys.stderr)
        return 2
    status: int = handler(args)
    return status
