"""The ``lockaspect`` command's pieces that need no server: its parser, the tables fitted to
the terminal, and how a lock reads in them."""

from __future__ import annotations

import io
import math

import pytest

from lockaspect.cli import _split_command, build_parser, main
from lockaspect.cli._format import LIST_COLUMNS, detail_rows, duration, holder_label, list_rows
from lockaspect.cli._table import Column, plain_lines, rich_table, shorten
from lockaspect.info import Holder, LockInfo


def holder(**fields: object) -> Holder:
    values: dict[str, object] = {
        "host": "web-1",
        "pid": 4242,
        "thread": "MainThread",
        "function": "app.orders.create_order",
        "template": "order:<user.id>",
        "acquired_at": 1_700_000_000.0,
        "fencing_token": 1795295988622953,
        "token_prefix": "a1b2c3d4",
        "remaining": 27.5,
    }
    values.update(fields)
    return Holder(**values)  # type: ignore[arg-type]


def info(key: str, *holders: Holder, kind: str = "lock", permits: int | None = None, unknown: int = 0) -> LockInfo:
    return LockInfo(
        key, kind, holders, 0, permits, max((h.fencing_token or 0 for h in holders), default=None), 27.5, unknown
    )


def test_the_run_command_is_split_at_the_first_double_dash() -> None:
    assert _split_command(["run", "--url", "u", "k", "--", "sh", "-c", "x -- y"]) == (
        ["run", "--url", "u", "k"],
        ["sh", "-c", "x -- y"],
    )
    assert _split_command(["list", "--", "x"]) == (["list", "--", "x"], None)
    args = build_parser().parse_args(["run", "--lease", "2", "--wait", "0", "k"])
    assert (args.lease, args.wait, args.grace, args.kind, args.permits) == (2.0, 0.0, 10.0, "lock", None)


@pytest.mark.parametrize("name", ["list", "inspect", "release", "run", "doctor"])
def test_each_subcommand_documents_its_exit_status(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "exit status:" in text
    assert "--url" in text
    assert "LOCKASPECT_URL" in text
    assert "--json" in text


def test_durations() -> None:
    assert duration(2.04) == "2.0s"
    assert duration(65) == "1m05s"
    assert duration(7322) == "2h02m"
    assert duration(math.inf) == "session"


def test_holders_read_host_pid_function_with_question_marks_for_the_unknown() -> None:
    assert holder_label(holder()) == "web-1/4242 orders.create_order"
    assert holder_label(holder(function="test_a_long_test_name.<locals>.create_order")) == "web-1/4242 create_order"
    assert holder_label(holder(host=None, pid=None, function=None, thread=None)) == "?/?"
    assert holder_label(holder(function=None, permits=3)) == "web-1/4242 MainThread x3"


@pytest.mark.parametrize("width", [80, 100, 120])
def test_the_list_table_fits_the_width(width: int) -> None:
    long = "report:" + "daily-sales-by-region-" * 6
    infos = [
        info(long, holder(function="x" * 90)),
        info("pool", holder(), holder(host=None, pid=None), kind="semaphore", permits=3),
        info("doc", holder(kind="write"), holder(kind="read"), kind="rw"),
        info("foreign", unknown=1),
    ]
    lines = plain_lines(LIST_COLUMNS, list_rows(infos), width)
    assert all(len(line) <= width for line in lines), lines
    assert lines[0].split() == ["KEY", "KIND", "HOLDER", "FENCE", "LEFT", "WAIT"]
    assert "1795295988622953" in lines[1]  # the fencing token is never cut
    assert lines[1].startswith("report:daily")
    assert "…" in lines[1]
    assert any(line.startswith("pool") and "sem 2/3" in line for line in lines)
    assert any("?/?" in line for line in lines)
    assert any(line.startswith("doc") and " write " in line for line in lines)
    assert any("(1 not recorded" in line for line in lines)
    assert all(len(line) <= 50 for line in plain_lines(LIST_COLUMNS, list_rows(infos), 50))  # a last resort cuts


def test_wrapped_columns_and_shortening() -> None:
    columns = (Column("A"), Column("DETAIL", flexible=True, min_width=10, wrap=True))
    lines = plain_lines(columns, [["ok", "word " * 30]], 40)
    assert len(lines) > 2
    assert all(len(line) <= 40 for line in lines)
    assert shorten("abcdef", 4) == "abc…"
    assert shorten("abc", 4) == "abc"


def test_the_rich_table_keeps_every_column_within_the_width() -> None:
    rich = pytest.importorskip("rich.console")
    out = io.StringIO()
    console = rich.Console(file=out, width=80, force_terminal=False)
    rows = list_rows([info("report:" + "x" * 100, holder(function="y" * 80))])
    console.print(rich_table(LIST_COLUMNS, rows, 80))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[0].split() == ["KEY", "KIND", "HOLDER", "FENCE", "LEFT", "WAIT"]
    assert "1795295988622953" in out.getvalue()


def test_inspect_rows_name_every_field() -> None:
    rows = {label.strip(): value for label, value in detail_rows(info("k", holder()), now=1_700_000_010.0)}
    assert rows["host"] == "web-1"
    assert rows["pid"] == "4242"
    assert rows["token"] == "a1b2c3d4…"
    assert rows["acquired at"].endswith("(10.0s ago)")
    unknown = {label.strip(): value for label, value in detail_rows(info("k", holder(host=None, pid=None)))}
    assert unknown["host"] == unknown["pid"] == "?"


@pytest.mark.parametrize("columns", [80, 120])
def test_the_demo_progress_rows_fit_the_terminal_with_their_figures_whole(
    columns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("rich")
    from lockaspect.demo import report

    monkeypatch.setenv("COLUMNS", str(columns))
    out = io.StringIO()
    reporter = report.RichReporter(out)
    progress = report.Progress(requests_total=85, stock=25, report_total=3.5, lease=2.0)
    progress.requests_done, progress.placed, progress.duplicates, progress.sold_out = 85, 25, 30, 30
    progress.ledger_text = "worker 1 wrote with token 1795513749164241"
    reporter.start(progress, 0.0)
    reporter.update(progress)
    reporter.progress.stop()
    out.seek(0)
    out.truncate()  # what the live display drew; the rows alone follow
    reporter.console.print(reporter.progress.make_tasks_table(reporter.progress.tasks))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= columns for line in lines), lines
    assert any("orders 25/25, duplicates 30, sold out 30" in line for line in lines), lines
    assert any("worker 1 wrote with token 1795513749164241" in line for line in lines), lines
    [sale] = [line for line in lines if "Flash sale requests" in line]
    assert sale.count("━") >= 10, sale  # a bar, not a sliver
    assert "…" not in out.getvalue()  # nothing cut (the elapsed time goes on a narrow terminal)
