"""``lockaspect demo`` end to end: real worker processes, real signals, a real server (or a
real SQLite file).

The demo checks its own invariants and exits 1 when one fails; these tests run it the way
a user does (``python -m lockaspect demo``) and read the figures from its final table.
"""

from __future__ import annotations

import fcntl
import importlib.util
import io
import os
import pty
import re
import select
import sqlite3
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from lockaspect.demo import report
from lockaspect.testing import LockServer

DEMO_TIMEOUT = 90.0
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LABELS = [
    "requests handled",
    "orders placed",
    "duplicates prevented",
    "oversold",
    "watchdog renewals",
    "leases lost",
    "lost leases detected",
    "stale writes rejected",
]

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="the demo needs POSIX signals")


def demo_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lockaspect", "demo", "--quick", *args]


def demo_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LOCKASPECT_URL", None)
    env["COLUMNS"] = "200"  # rich wraps at the terminal width; keep table rows on one line
    return env


def figures(output: str) -> dict[str, int]:
    """The value column of the final table, plain (``label  value``) or rich (``│ label │ value │``)."""
    found: dict[str, int] = {}
    for label in LABELS:
        match = re.search(rf"^[\s│|]*{re.escape(label)}[\s│|]+(\d+)[\s│|]", output, re.MULTILINE)
        assert match is not None, f"no {label!r} row in the demo output:\n{output}"
        found[label] = int(match.group(1))
    return found


def check_figures(output: str) -> None:
    numbers = figures(output)
    assert numbers["oversold"] == 0
    assert numbers["duplicates prevented"] >= 1
    assert numbers["watchdog renewals"] >= 1
    assert numbers["lost leases detected"] >= 1
    assert numbers["stale writes rejected"] >= 1
    assert "FAIL" not in output
    assert "All invariants hold" in output


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (or was reused by something else already)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return True
        cmdline = " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return True
    return "valkey-server" not in cmdline and "redis-server" not in cmdline and "multiprocessing" not in cmdline


def run_in_terminal(command: list[str], timeout: float) -> tuple[int, str]:
    """Run ``command`` with a pseudo-terminal as stdout/stderr (so the demo draws its
    live progress with rich); return its exit status and everything it printed."""
    master, replica = pty.openpty()
    fcntl.ioctl(replica, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=replica, stderr=replica, env=demo_env(), close_fds=True
    )
    os.close(replica)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                process.kill()
                process.wait()
                pytest.fail("the demo did not finish in time:\n" + b"".join(chunks).decode(errors="replace"))
            readable, _, _ = select.select([master], [], [], min(remaining, 1.0))
            if readable:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif process.poll() is not None:
                break
        status = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
    return status, ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r", "")


@pytest.mark.slow
def test_demo_on_a_given_server(lock_server: LockServer, raw: Any) -> None:
    result = subprocess.run(
        demo_command("--url", lock_server.url),
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
        env=demo_env(),
        stdin=subprocess.DEVNULL,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    check_figures(result.stdout)
    # Not a terminal: plain progress lines, no escape sequences.
    assert "\x1b[" not in result.stdout
    assert re.search(r"^\[\s*\d+\.\d+s\] requests \d+/\d+", result.stdout, re.MULTILINE), result.stdout
    # It told us where its keys were, and deleted them.
    match = re.search(r"keys live under '([^']+)'", result.stdout)
    assert match is not None, result.stdout
    assert list(raw.scan_iter(match=match.group(1) + "*")) == []
    # No worker process outlives the demo.
    workers = re.search(r"^workers: (.*)$", result.stdout, re.MULTILINE)
    assert workers is not None, result.stdout
    for pid in re.findall(r"pid (\d+)", workers.group(1)):
        assert gone(int(pid)), f"worker pid {pid} is still running"


@pytest.mark.slow
def test_demo_starts_and_stops_its_own_server_in_a_terminal() -> None:
    status, output = run_in_terminal(demo_command(), DEMO_TIMEOUT)
    assert status == 0, output
    check_figures(output)
    if importlib.util.find_spec("rich") is not None:
        assert "lockaspect flash sale (" in output, "on a terminal the demo draws with rich"
    started = re.search(r"started embedded \S+ \S+ \(pid (\d+)\) on (redis://\S+)", output)
    assert started is not None, output
    server_pid = int(started.group(1))
    assert f"stopped embedded server (pid {server_pid})" in output
    assert gone(server_pid), f"the demo left its server (pid {server_pid}) running"
    workers = re.search(r"^workers: (.*)$", output, re.MULTILINE)
    assert workers is not None, output
    for pid in re.findall(r"pid (\d+)", workers.group(1)):
        assert gone(int(pid)), f"worker pid {pid} is still running"


def demo_rows_left(database: Path, prefix: str) -> dict[str, int]:
    """How many rows of the run ``prefix`` each table of the SQLite file still holds."""
    conn = sqlite3.connect(database)
    try:
        tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        left: dict[str, int] = {}
        for table in tables:
            if table.startswith("lockaspect_demo_"):
                (count,) = conn.execute(f"SELECT count(*) FROM {table} WHERE run = ?", (prefix,)).fetchone()
            elif table.startswith("lockaspect_"):
                (count,) = conn.execute(
                    f"SELECT count(*) FROM {table} WHERE substr(name, 1, ?) = ?", (len(prefix), prefix)
                ).fetchone()
            else:
                continue
            left[table] = count
        return left
    finally:
        conn.close()


def run_on_sqlite(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path, str]:
    """Run the quick demo on ``sqlite:///demo.db`` in ``tmp_path`` (a path relative to the
    working directory, as a user types it); return the result, the file and the run's prefix."""
    result = subprocess.run(
        demo_command("--url", "sqlite:///demo.db", *args),
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
        env=demo_env(),
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    database = tmp_path / "demo.db"
    # No server: it says where the database is (absolute), and that its rows go at the end.
    assert "started embedded" not in output
    match = re.search(
        r"^on (/\S+): the demo's rows \(run '([^']+)'.* are deleted at the end", result.stdout, re.MULTILINE
    )
    assert match is not None, output
    assert match.group(1) == str(database.resolve())
    prefix = match.group(2)
    left = demo_rows_left(database, prefix)
    assert {"lockaspect_demo_orders", "lockaspect_holds", "lockaspect_fences"} <= set(left), left
    assert not any(left.values()), f"the demo left rows behind: {left}"
    workers = re.search(r"^workers: (.*)$", result.stdout, re.MULTILINE)
    assert workers is not None, output
    for pid in re.findall(r"pid (\d+)", workers.group(1)):
        assert gone(int(pid)), f"worker pid {pid} is still running"
    return result, database, prefix


@pytest.mark.slow
def test_demo_on_sqlite(tmp_path: Path) -> None:
    result, _, _ = run_on_sqlite(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    check_figures(result.stdout)


@pytest.mark.slow
def test_demo_on_sqlite_without_the_locks_fails(tmp_path: Path) -> None:
    result, _, _ = run_on_sqlite(tmp_path, "--unsafe")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "FAILED: invariants violated (as expected without the locks)" in output
    numbers = figures(result.stdout)
    ordered_twice = re.search(r"(\d+) user\(s\) ordered twice", result.stdout)
    assert numbers["oversold"] > 0 or ordered_twice is not None, output
    # The story that needs no shop lock still holds: the fence rejects the stale write.
    assert numbers["stale writes rejected"] >= 1


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("sqlite:///{tmp}/missing/demo.db", "the directory '{tmp}/missing' does not exist"),
        ("sqlite://host/demo.db", "a SQLite URL is sqlite:///<relative path> or sqlite:////<absolute path>"),
        ("sqlite:///:memory:", "need a database file"),
        ("nosuchstore://x", "the demo runs on redis://"),
    ],
)
def test_demo_with_an_unusable_url_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, error: str
) -> None:
    from lockaspect.demo import DemoOptions, run_demo

    tmp = str(tmp_path)
    assert run_demo(DemoOptions(url=url.format(tmp=tmp), plain=True)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert error.format(tmp=tmp) in err
    assert not (tmp_path / "missing").exists()


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_rich_the_demo_reports_in_plain_text(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")] + ["rich"]:
        monkeypatch.setitem(sys.modules, name, None)  # "import rich..." now raises ImportError
    out = FakeTerminal()
    reporter = report.make_reporter(out=out)
    assert isinstance(reporter, report.PlainReporter)
    progress = report.Progress(requests_total=10, stock=5, report_total=3.0, lease=2.0, requests_done=10, placed=5)
    reporter.start(progress, time.monotonic())
    reporter.event(1.0, "something happened")
    reporter.stop()
    reporter.table(
        [report.Row("oversold", 0, True, "why"), report.Row("stale writes rejected", 1, True, "why")],
        wall=4.2,
    )
    text = out.getvalue()
    assert "something happened" in text
    assert re.search(r"^oversold\s+0\s+ok", text, re.MULTILINE), text
    assert "wall time: 4.2s" in text


def test_cli_without_a_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    from lockaspect.cli import main

    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_cli_rejects_too_few_workers(capsys: pytest.CaptureFixture[str]) -> None:
    from lockaspect.cli import main

    with pytest.raises(SystemExit) as exc_info:
        main(["demo", "--workers", "1"])
    assert exc_info.value.code == 2
    assert "--workers" in capsys.readouterr().err
