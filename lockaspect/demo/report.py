"""What the parent shows: the progress so far, the final table, and two reporters (rich
live bars on a terminal, plain lines everywhere else)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Protocol

__all__ = ["LEDGER_STEPS", "PlainReporter", "Progress", "Reporter", "RichReporter", "Row", "make_reporter"]


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


#: The ledger story in steps: frozen, rescued by another worker, resumed, its stale write judged.
LEDGER_STEPS = 4


@dataclass(frozen=True)
class Row:
    """One line of the final table: an invariant (``ok``) or an informational figure."""

    label: str
    value: int
    ok: bool | None  # None: informational, not an invariant
    why: str


class Reporter(Protocol):
    """What the conductor calls to show the run: live progress, events, lines, the final table."""

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
        from rich.table import Column

        self.console = Console(file=out)
        # Three rows of description, bar, figures and elapsed time; on a narrow terminal (80
        # columns) the bar shrinks and the elapsed time goes (the events carry it), so that the
        # figures still fit on their row instead of being cut.
        width = self.console.width
        columns: list[Any] = [
            SpinnerColumn(),
            TextColumn("[bold]{task.description}", table_column=Column(width=22, no_wrap=True)),
            BarColumn(bar_width=max(10, min(30, width - 90))),
            TextColumn("{task.fields[info]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
        ]
        if width >= 100:
            columns.append(TimeElapsedColumn())
        self.progress = Progress(*columns, console=self.console)
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
