"""The ``lockaspect`` command.

    lockaspect list    [PATTERN] [--watch] [--interval S]           held locks, a table
    lockaspect inspect KEY [--kind K]                              everything known about one key
    lockaspect release KEY --force [--yes]                         evict whoever holds KEY
    lockaspect run     KEY [--wait S] [--lease S] [--kind K] [--permits N] [--grace S] -- COMMAND ...
    lockaspect doctor  [--wait-replicas N]                         check the store for what lockaspect needs
    lockaspect demo    [--url URL] [--workers N] [--quick] [--unsafe] [--plain]

Every subcommand but ``demo`` takes ``--url`` (default: the environment variable
``LOCKASPECT_URL``), ``--namespace`` (default ``lockaspect:``), ``--json`` and ``--plain``
after its name. The exit codes are in each subcommand's ``--help`` and in
docs/operations.md.

Subcommands are registered in :func:`build_parser`; each sets ``handler`` to the name of a
function (``module:function`` in this package) taking the parsed arguments and returning the
exit status. Handlers are imported when they run, so ``lockaspect --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._options import add_common, add_demo, add_doctor, add_inspect, add_list, add_release, add_run

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (no I/O, nothing heavy imported)."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="lockaspect",
        description=(
            "Distributed locks as a decorator, on Redis and Valkey, PostgreSQL, ZooKeeper and SQLite: "
            "see who holds what, evict a stuck holder, run a command under a lock, check a store."
        ),
        epilog="Options go after the command's name: lockaspect run --url URL --lease 2 KEY -- CMD",
    )
    parser.add_argument("--version", action="version", version=f"lockaspect {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in (add_list, add_inspect, add_release, add_run, add_doctor):
        add_common(add(commands))
    add_demo(commands)
    return parser


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``run``'s own arguments and the command after its ``--`` (``None``: no ``--``)."""
    if argv and argv[0] == "run" and "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lockaspect`` console script; returns the exit status."""
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    own, after = _split_command(words)
    args = parser.parse_args(own)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        print("\nlockaspect: a command is required (try: lockaspect list, or lockaspect demo)", file=sys.stderr)
        return 2
    if after is not None:
        if args.command:
            words_before = " ".join(args.command)
            print(
                f"lockaspect run: put the whole command after '--' (found {words_before!r} before it)",
                file=sys.stderr,
            )
            return 2
        args.command = after
    module_name, _, function_name = handler.partition(":")
    module = importlib.import_module(f".{module_name}", __name__)
    status: int = getattr(module, function_name)(args)
    return status
