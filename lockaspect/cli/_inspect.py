"""``lockaspect list``, ``inspect`` and ``release``: the operator's view of the locks, through
:meth:`LockClient.held_locks <lockaspect.LockClient.held_locks>`, ``describe`` and
``force_release``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import textwrap
import threading
import time
from typing import TYPE_CHECKING, Any

from ._common import CliError, Output, command, open_client, store_errors, store_url
from ._format import LIST_COLUMNS, detail_rows, list_rows, who
from ._options import EXIT_USAGE
from ._table import Column, plain_lines, rich_table, shorten

if TYPE_CHECKING:
    from .. import LockClient
    from ..info import LockInfo

__all__ = ["inspect_command", "list_command", "release_command"]

_DETAIL_COLUMNS = (Column("", min_width=10), Column("", flexible=True, min_width=10, wrap=True))


def _label(args: argparse.Namespace) -> str:
    from ..backends.base import redacted

    return redacted(store_url(args))


def _held(client: LockClient, pattern: str) -> list[LockInfo]:
    with store_errors():
        return list(client.held_locks(pattern))


def _summary(infos: list[LockInfo], namespace: str, pattern: str) -> str:
    holders = sum(len(info.holders) + info.unknown_holders for info in infos)
    if not infos:
        return f"no lock held in namespace {namespace!r} matching {pattern!r}"
    return f"{len(infos)} lock(s), {holders} holder(s) in namespace {namespace!r} matching {pattern!r}"


def _show_list(out: Output, infos: list[LockInfo], args: argparse.Namespace, header: str = "") -> Any:
    """Print (plain) or return (rich) the table of ``infos``."""
    rows = list_rows(infos)
    summary = _summary(infos, args.namespace, args.pattern)
    if out.rich:
        from rich.console import Group
        from rich.text import Text

        parts: list[Any] = [Text(header, style="bold")] if header else []
        if rows:
            parts.append(rich_table(LIST_COLUMNS, rows, out.width))
        parts.append(Text(summary, style="dim"))
        return Group(*parts)
    if header:
        out.line(header)
    if rows:
        print("\n".join(plain_lines(LIST_COLUMNS, rows, out.width)), file=out.stream)
    out.line(summary)
    out.stream.flush()
    return None


@command("list")
def list_command(args: argparse.Namespace) -> int:
    out = Output(args)
    client = open_client(args)
    try:
        if not args.watch:
            infos = _held(client, args.pattern)
            if out.json:
                out.emit_json([info.to_dict() for info in infos])
            else:
                shown = _show_list(out, infos, args)
                if shown is not None:
                    out.console.print(shown)
            return 0
        return _watch(out, client, args)
    finally:
        client.close()


def _watch(out: Output, client: LockClient, args: argparse.Namespace) -> int:
    """Refresh every ``--interval`` seconds until Ctrl-C (or SIGTERM): exit 0.

    The signal sets an event instead of raising KeyboardInterrupt, so it never lands inside
    a store call (a connection pool's lock taken and never given back would hang the close)."""
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signals go to the main thread only
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def header() -> str:
        return f"{_label(args)}  {time.strftime('%H:%M:%S')}  every {args.interval:g}s, Ctrl-C to stop"

    try:
        if out.rich:
            from rich.live import Live

            with Live(console=out.console, auto_refresh=False, transient=False) as live:
                while not stop.is_set():
                    live.update(_show_list(out, _held(client, args.pattern), args, header()), refresh=True)
                    stop.wait(args.interval)
            return 0
        while not stop.is_set():
            infos = _held(client, args.pattern)
            if out.json:
                out.emit_json([info.to_dict() for info in infos])
            else:
                if out.stream.isatty():
                    out.stream.write("\x1b[H\x1b[2J")  # clear the screen, as watch(1) does
                _show_list(out, infos, args, header())
                out.line()
            stop.wait(args.interval)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@command("inspect")
def inspect_command(args: argparse.Namespace) -> int:
    out = Output(args)
    client = open_client(args)
    try:
        with store_errors():
            info = client.describe(args.key, kind=args.kind)
    finally:
        client.close()
    if out.json:
        out.emit_json(None if info is None else info.to_dict())
        return 0 if info is not None else 1
    if info is None:
        kind = f" as {args.kind}" if args.kind else ""
        out.line(f"{args.key!r} is not held{kind} (namespace {args.namespace!r})")
        return 1
    rows = detail_rows(info)
    if out.rich:
        out.console.print(rich_table(_DETAIL_COLUMNS, rows, out.width, headers=False))
    else:
        print("\n".join(plain_lines(_DETAIL_COLUMNS, rows, out.width, headers=False)), file=out.stream)
    return 0


def _confirm(key: str, infos: list[LockInfo], width: int) -> bool:
    """Ask on the terminal whether to evict; ``False`` unless the answer is yes."""
    lines = [f"{key!r} is held by:"]
    lines += [f"  {line}" for info in infos for line in who(info)]
    lines += textwrap.wrap(
        "Force-releasing evicts them: each learns it at its next renewal (LockLost, on_lost), and may still "
        "be running.",
        width,
    )
    print("\n".join(shorten(line, width) for line in lines), file=sys.stderr)
    sys.stderr.write(f"Force-release {key!r}? [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")


def _holders(client: LockClient, key: str) -> list[LockInfo]:
    """Every lock held at ``key`` (a key's name may carry a lock, a read-write lock and a
    semaphore): what a force-release evicts."""
    found = []
    for kind in ("lock", "rw", "semaphore"):
        info = client.describe(key, kind=kind)
        if info is not None:
            found.append(info)
    return found


@command("release")
def release_command(args: argparse.Namespace) -> int:
    out = Output(args)
    if not args.force:
        raise CliError(
            f"not releasing {args.key!r}: this evicts whoever holds it, while that holder may still be "
            "working (it learns at its next renewal). Look first (lockaspect inspect KEY), then run again "
            "with --force (and --yes to skip the question)",
            EXIT_USAGE,
        )
    if not args.yes and not sys.stdin.isatty():
        raise CliError(
            f"not releasing {args.key!r}: confirmation needed and stdin is not a terminal; "
            "add --yes to force-release without asking",
            EXIT_USAGE,
        )
    client = open_client(args)
    # The eviction is printed below; the library's WARNING about it would say it twice.
    admin_log = logging.getLogger("lockaspect.admin")
    level = admin_log.level
    admin_log.setLevel(logging.ERROR)
    try:
        with store_errors():
            infos = _holders(client, args.key)
            if infos and not args.yes and not _confirm(args.key, infos, out.width):
                out.line(f"not released: {args.key!r} is still held")
                return 1
            released = client.force_release(args.key)
    finally:
        admin_log.setLevel(level)
        client.close()
    if out.json:
        out.emit_json({"key": args.key, "released": released, "evicted": [info.to_dict() for info in infos]})
    elif not released:
        out.line(f"nothing to release: {args.key!r} is not held (namespace {args.namespace!r})")
    else:
        out.line(f"released {args.key!r}; evicted:")
        lines = [line for info in infos for line in who(info)] or ["a holder that released meanwhile"]
        for line in lines:
            out.line(f"  {line}")
    return 0 if released else 1
