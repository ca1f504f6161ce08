"""What the subcommands share: the store URL, opening a client, errors as exit codes, and the
output (JSON, or a table drawn with rich on a terminal and as plain text elsewhere)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ._options import EXIT_STORE, EXIT_USAGE

if TYPE_CHECKING:
    from .. import LockClient

__all__ = ["CliError", "Output", "command", "open_client", "store_errors", "store_url"]

#: Where an operator's eye lands first: the width every human output fits (a wider terminal
#: gets wider tables; a pipe gets 80 unless COLUMNS says otherwise).
DEFAULT_WIDTH = 80


class CliError(Exception):
    """A failure to report in one line, with the exit status it maps to."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def store_url(args: argparse.Namespace) -> str:
    """``--url``, else ``LOCKASPECT_URL``, else a usage error naming both."""
    url: str | None = args.url or os.environ.get("LOCKASPECT_URL")
    if not url:
        raise CliError(
            "no lock store given: pass --url URL or set the environment variable LOCKASPECT_URL "
            "(e.g. redis://127.0.0.1:6379/0)",
            EXIT_USAGE,
        )
    return url


def open_client(args: argparse.Namespace, **options: Any) -> LockClient:
    """A client on the store the arguments name (no connection is made yet)."""
    from .. import LockClient

    with store_errors():
        return LockClient.from_url(store_url(args), namespace=args.namespace, **options)


@contextmanager
def store_errors() -> Iterator[None]:
    """A store's :class:`~lockaspect.ConfigurationError` as a usage error, its
    :class:`~lockaspect.BackendError` as :data:`EXIT_STORE`."""
    from ..errors import BackendError, ConfigurationError, KeyTemplateError

    try:
        yield
    except (ConfigurationError, KeyTemplateError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    except BackendError as exc:
        raise CliError(f"the store failed: {exc}", EXIT_STORE) from exc


def command(name: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """A handler whose :class:`CliError` is printed as ``lockaspect <name>: <message>`` with its
    status; Ctrl-C exits 130, a closed pipe (``| head``) 141, quietly."""

    def wrap(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args)
            except CliError as exc:
                print(f"lockaspect {name}: {exc}", file=sys.stderr)
                return exc.status
            except KeyboardInterrupt:
                return 130
            except BrokenPipeError:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
                return 141

        return run

    return wrap


class Output:
    """Where a subcommand writes: JSON, rich (a terminal with rich installed, unless
    ``--plain`` or ``LOCKASPECT_PLAIN``) or plain text, at the terminal's width."""

    def __init__(self, args: argparse.Namespace, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.json = bool(getattr(args, "json", False))
        plain = bool(getattr(args, "plain", False)) or os.environ.get("LOCKASPECT_PLAIN", "") not in ("", "0")
        self.rich = (
            not self.json and not plain and self.stream.isatty() and importlib.util.find_spec("rich") is not None
        )
        self.width = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns or DEFAULT_WIDTH
        self._console: Any = None

    @property
    def console(self) -> Any:
        """The rich console (only when :attr:`rich`)."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.stream, width=self.width, highlight=False, soft_wrap=False)
        return self._console

    def emit_json(self, value: object) -> None:
        print(json.dumps(value, ensure_ascii=False), file=self.stream, flush=True)

    def line(self, text: str = "") -> None:
        """One line of prose, wrapped to the width."""
        if self.rich:
            from rich.markup import escape

            self.console.print(escape(text))
            return
        import textwrap

        lines = textwrap.wrap(text, self.width, break_on_hyphens=False, break_long_words=True) or [""]
        print("\n".join(lines), file=self.stream, flush=True)
