"""``lockaspect run KEY -- COMMAND`` as a user runs it: a subprocess holding a lock on the
session's real server while a real command runs; the test reads what both print (no sleeps)
and sends real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from lockaspect import LockClient
from lockaspect.testing import LockServer

from ._support import TIMEOUT, cli_env, command, lockaspect, need_owner_records, read_until

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="run forwards POSIX signals")

#: A command that says where it runs, then waits for a line on stdin (or a signal).
WAITER = (
    "import os, sys; print('child', os.getpid(), os.environ['LOCKASPECT_KEY'], "
    "os.environ['LOCKASPECT_FENCING_TOKEN'], flush=True); sys.stdin.readline(); print('child done', flush=True)"
)
#: A command that reports the signals it gets and exits 0 on the first.
HANDLES = (
    "import os, signal, sys\n"
    "def got(signum, frame):\n"
    "    print('child got', signum, flush=True); sys.exit(0)\n"
    "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP): signal.signal(s, got)\n"
    "print('child', os.getpid(), flush=True)\n"
    "while True: signal.pause()\n"
)
#: A command that ignores SIGTERM (it must be SIGKILLed).
STUBBORN = (
    "import os, signal\n"
    "signal.signal(signal.SIGTERM, lambda *a: print('child ignores SIGTERM', flush=True))\n"
    "print('child', os.getpid(), flush=True)\n"
    "while True: signal.pause()\n"
)


def store(url: str, namespace: str) -> list[str]:
    return ["--url", url, "--namespace", namespace]


def start_run(*args: str) -> subprocess.Popen[str]:
    """``lockaspect run ARGS`` with a pipe as stdin (the command inherits it)."""
    return subprocess.Popen(
        command("run", *args),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    finally:
        process.kill()
    return process.returncode, out, err


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_run_exports_the_key_and_token_and_exits_with_the_commands_status(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    code = "import os, sys; print(os.environ['LOCKASPECT_KEY'], os.environ['LOCKASPECT_FENCING_TOKEN']); sys.exit(3)"
    result = lockaspect("run", *store(lock_server.url, namespace), "nightly:report", "--", sys.executable, "-c", code)
    assert result.returncode == 3, result.stderr
    key, token = result.stdout.split()
    assert key == "nightly:report"
    assert int(token) > 0
    client = make_client()
    assert not client.locked("nightly:report")
    lease = client.acquire("nightly:report")
    assert lease.fencing_token is not None
    assert lease.fencing_token > int(token)
    lease.release()


def test_run_holds_the_lock_while_the_command_runs(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient], owner_records: bool
) -> None:
    client = make_client()
    run = start_run(*store(lock_server.url, namespace), "--lease", "1", "job", "--", sys.executable, "-c", WAITER)
    _, _, key, token = read_until(run.stdout, "child")[-1].split()
    assert key == "job"
    info = client.describe("job")
    assert info is not None
    assert info.kind == "lock"
    assert info.fencing_token == int(token)
    assert run.stdin is not None
    run.stdin.write("go on\n")
    run.stdin.flush()
    status, out, err = finish(run)
    assert status == 0, err
    assert "child done" in out
    assert not client.locked("job")

    need_owner_records(owner_records)
    assert info.holders[0].pid == run.pid


@pytest.mark.parametrize("wait", ["0", "0.2"])
def test_run_not_acquired_in_time_exits_75_without_running_the_command(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient], tmp_path: Path, wait: str
) -> None:
    lease = make_client().acquire("busy")
    marker = tmp_path / "ran"
    result = lockaspect(
        "run", *store(lock_server.url, namespace), "--wait", wait, "--json", "busy", "--", "touch", str(marker)
    )
    assert result.returncode == 75, result.stderr
    assert "not acquired" in result.stderr
    assert json.loads(result.stderr.splitlines()[-1])["outcome"] == "not-acquired"
    assert not marker.exists()
    lease.release()


@pytest.mark.slow
def test_a_lost_lock_stops_the_command_then_kills_it_after_the_grace(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    run = start_run(
        *store(lock_server.url, namespace), "--lease", "1", "--grace", "1", "job", "--", sys.executable, "-c", STUBBORN
    )
    child = int(read_until(run.stdout, "child")[-1].split()[1])
    first = make_client().describe("job")
    assert first is not None
    assert make_client().force_release("job")
    status, out, err = finish(run)
    assert status == 76, err
    assert "child ignores SIGTERM" in out
    assert "lost the lock on 'job' (not-owner)" in err
    assert "sending SIGKILL" in err
    assert gone(child)
    lease = make_client().acquire("job")
    assert first.fencing_token is not None
    assert lease.fencing_token is not None
    assert lease.fencing_token > first.fencing_token
    lease.release()


@pytest.mark.slow
def test_a_lost_lock_whose_command_stops_on_sigterm_still_exits_76(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    run = start_run(*store(lock_server.url, namespace), "--lease", "1", "job", "--", sys.executable, "-c", HANDLES)
    read_until(run.stdout, "child")
    assert make_client().force_release("job")
    status, out, err = finish(run)
    assert status == 76, err
    assert f"child got {int(signal.SIGTERM)}" in out
    assert "SIGKILL" not in err.replace("then SIGKILL after", "")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signals_are_forwarded_and_the_lock_released_after_the_command(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient], signum: int
) -> None:
    run = start_run(*store(lock_server.url, namespace), "job", "--", sys.executable, "-c", HANDLES)
    read_until(run.stdout, "child")
    run.send_signal(signum)
    status, out, err = finish(run)
    assert status == 0, err  # the command handled it and exited 0
    assert f"child got {int(signum)}" in out
    assert not make_client().locked("job")


def test_a_forwarded_signal_reaches_the_commands_own_children(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    """The command runs in a process group of its own: a shell and what it started both get
    the signal (the shell waits for its child, which would otherwise outlive it)."""
    grandchild = (
        f"{sys.executable} -c \"import os, time; print('grandchild', os.getpid(), flush=True); time.sleep(600)\""
    )
    run = start_run(*store(lock_server.url, namespace), "job", "--", "sh", "-c", f"{grandchild}; echo after")
    pid = int(read_until(run.stdout, "grandchild")[-1].split()[1])
    run.send_signal(signal.SIGTERM)
    status, _, err = finish(run)
    assert status == 128 + signal.SIGTERM, err  # the shell died of the forwarded SIGTERM
    assert gone(pid)
    assert not make_client().locked("job")


def test_a_command_killed_by_a_signal_of_its_own_exits_128_plus_it(lock_server: LockServer, namespace: str) -> None:
    result = lockaspect("run", *store(lock_server.url, namespace), "job", "--", "sh", "-c", "kill -KILL $$")
    assert result.returncode == 128 + signal.SIGKILL, result.stderr


def test_a_missing_command_exits_127_and_releases(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    result = lockaspect("run", *store(lock_server.url, namespace), "job", "--", "no-such-command-anywhere")
    assert result.returncode == 127
    assert "command not found" in result.stderr
    assert not make_client().locked("job")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["job"], "no command to run"),
        (["job", "--kind", "read", "--permits", "2", "--", "true"], "--permits"),
        (["job", "echo", "--", "true"], "after '--'"),
        (["job", "--lease", "0", "--", "true"], "--lease"),
    ],
)
def test_usage_errors_exit_2(lock_server: LockServer, namespace: str, args: list[str], message: str) -> None:
    result = lockaspect("run", *store(lock_server.url, namespace), *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_an_unreachable_store_exits_69_at_once(namespace: str) -> None:
    result = lockaspect("run", *store("redis://127.0.0.1:1/0", namespace), "job", "--", "true")
    assert result.returncode == 69
    assert "the store failed" in result.stderr


def test_read_write_and_semaphore_kinds(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    client = make_client()
    reader = client.acquire("config", mode="read")
    shares = lockaspect(
        "run", *store(lock_server.url, namespace), "--kind", "read", "--wait", "0", "config", "--", "true"
    )
    assert shares.returncode == 0, shares.stderr
    excluded = lockaspect(
        "run", *store(lock_server.url, namespace), "--kind", "write", "--wait", "0", "config", "--", "true"
    )
    assert excluded.returncode == 75
    reader.release()
    permit = client.acquire("pool", permits=1)
    full = lockaspect("run", *store(lock_server.url, namespace), "--permits", "1", "--wait", "0", "pool", "--", "true")
    assert full.returncode == 75
    permit.release()
    free = lockaspect("run", *store(lock_server.url, namespace), "--permits", "1", "--wait", "0", "pool", "--", "true")
    assert free.returncode == 0, free.stderr


def test_run_on_a_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/locks.db"
    code = "import os; print(os.environ['LOCKASPECT_FENCING_TOKEN'])"
    first = lockaspect("run", "--url", url, "--kind", "fair", "job", "--", sys.executable, "-c", code)
    second = lockaspect("run", "--url", url, "--kind", "fair", "job", "--", sys.executable, "-c", code)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert int(second.stdout) > int(first.stdout) > 0
