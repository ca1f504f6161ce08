"""``lockaspect list``, ``inspect`` and ``release`` as a user runs them: subprocesses against
the session's real server (and a SQLite file), their JSON parsed, their tables at 80 columns
on a pipe (plain) and on a terminal (rich)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lockaspect import LockClient, LockLost
from lockaspect.info import Holder, LockInfo
from lockaspect.testing import LockServer

from ._support import (
    TIMEOUT,
    assert_fits,
    cli_env,
    in_terminal,
    lockaspect,
    need_owner_records,
    read_until,
    start,
    start_python,
)

INFO_FIELDS = {"key", "kind", "holders", "waiters", "permits", "fencing_token", "remaining", "unknown_holders"}
HOLDER_FIELDS = set(Holder.__dataclass_fields__)

#: A process that holds a lock until it is told it lost it, printing what it sees.
HOLDER = """
import sys, threading
from lockaspect import LockClient, LockLost
url, namespace, key = sys.argv[1:4]
client = LockClient.from_url(url, namespace=namespace, watchdog_lease=1.0)
lost = threading.Event()
def on_lost(lease):
    print("on_lost", lease.lost_reason, flush=True)
    lost.set()
try:
    with client.lock(key, on_lost=on_lost) as lease:
        print("holding", lease.fencing_token, flush=True)
        lost.wait(60)
        lease.check()
    print("released without losing it", flush=True)
except LockLost as exc:
    print("LockLost", exc.reason, flush=True)
finally:
    client.close()
"""


def store(url: str, namespace: str) -> list[str]:
    return ["--url", url, "--namespace", namespace]


def holders_of(info: dict[str, object]) -> int:
    holders = info["holders"]
    assert isinstance(holders, list)
    unknown = info["unknown_holders"]
    assert isinstance(unknown, int)
    return len(holders) + unknown


@pytest.fixture
def held(make_client: Callable[..., LockClient]) -> Iterator[dict[str, int | None]]:
    """A lock, a semaphore with two holders and a read lock with two readers, held by two
    clients of this process during the test; the lock's fencing token."""
    first, second = make_client(), make_client()
    leases = [
        first.acquire("order:42"),
        first.acquire("pool", permits=3),
        second.acquire("pool", permits=3),
        first.acquire("config", mode="read"),
        second.acquire("config", mode="read"),
    ]
    yield {"order:42": leases[0].fencing_token}
    for lease in leases:
        lease.release()


def test_list_json_has_the_describe_fields(
    lock_server: LockServer, namespace: str, held: dict[str, int | None], owner_records: bool
) -> None:
    result = lockaspect("list", "--json", *store(lock_server.url, namespace))
    assert result.returncode == 0, result.stderr
    infos = {info["key"]: info for info in json.loads(result.stdout)}
    assert set(infos) == {"order:42", "pool", "config"}
    for info in infos.values():
        assert set(info) == INFO_FIELDS
        for holder in info["holders"]:
            assert set(holder) == HOLDER_FIELDS
    assert infos["order:42"]["kind"] == "lock"
    assert infos["order:42"]["fencing_token"] == held["order:42"]
    assert 0 < infos["order:42"]["remaining"] <= 30
    assert holders_of(infos["order:42"]) == 1
    assert infos["pool"]["kind"] == "semaphore"
    assert infos["pool"]["permits"] == 3
    assert holders_of(infos["pool"]) == 2
    assert infos["config"]["kind"] == "read"
    assert holders_of(infos["config"]) == 2
    only = lockaspect("list", "order:*", "--json", *store(lock_server.url, namespace))
    assert [info["key"] for info in json.loads(only.stdout)] == ["order:42"]

    need_owner_records(owner_records)
    [holder] = infos["order:42"]["holders"]
    assert holder["host"] == socket.gethostname()
    assert holder["pid"] == os.getpid()
    assert holder["fencing_token"] == held["order:42"]
    assert 4 <= len(holder["token_prefix"]) < 32


def test_inspect_json_and_a_free_key(lock_server: LockServer, namespace: str, held: dict[str, int | None]) -> None:
    result = lockaspect("inspect", "order:42", "--json", *store(lock_server.url, namespace))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert set(info) == INFO_FIELDS
    assert (info["key"], info["kind"], info["fencing_token"]) == ("order:42", "lock", held["order:42"])
    pool = json.loads(
        lockaspect("inspect", "pool", "--kind", "semaphore", "--json", *store(lock_server.url, namespace)).stdout
    )
    assert (pool["kind"], pool["permits"], holders_of(pool)) == ("semaphore", 3, 2)

    free = lockaspect("inspect", "nobody:holds:this", "--json", *store(lock_server.url, namespace))
    assert (free.returncode, json.loads(free.stdout)) == (1, None)
    free = lockaspect("inspect", "nobody:holds:this", *store(lock_server.url, namespace))
    assert free.returncode == 1
    assert "'nobody:holds:this' is not held" in free.stdout
    wrong_kind = lockaspect("inspect", "order:42", "--kind", "semaphore", *store(lock_server.url, namespace))
    assert wrong_kind.returncode == 1


def test_human_output_fits_80_columns_on_a_pipe(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient], owner_records: bool
) -> None:
    client = make_client()
    long_key = "report:" + "daily-sales-by-region-and-channel-" * 3 + "2024-07-01"
    leases = [client.acquire(long_key), client.acquire("order:7", permits=5)]  # held until the test ends
    listed = lockaspect("list", *store(lock_server.url, namespace))
    assert listed.returncode == 0, listed.stderr
    assert "\x1b[" not in listed.stdout  # a pipe: plain text
    assert_fits(listed.stdout)
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["KEY", "KIND", "HOLDER", "FENCE", "LEFT", "WAIT"]
    assert any(line.startswith("report:daily-sales") and "…" in line for line in lines), listed.stdout
    assert any(line.startswith("order:7") and "sem 1/5" in line for line in lines), listed.stdout
    assert str(leases[0].fencing_token) in listed.stdout
    assert "2 lock(s)" in lines[-1]

    inspected = lockaspect("inspect", long_key, *store(lock_server.url, namespace))
    assert inspected.returncode == 0, inspected.stderr
    assert_fits(inspected.stdout)
    assert f"fencing token  {leases[0].fencing_token}" in inspected.stdout

    need_owner_records(owner_records)
    assert f"{socket.gethostname()}/{os.getpid()}" in listed.stdout or "/" + str(os.getpid()) in listed.stdout
    assert re.search(rf"^\s+pid\s+{os.getpid()}$", inspected.stdout, re.MULTILINE), inspected.stdout


@pytest.mark.skipif(importlib.util.find_spec("rich") is None, reason="rich is not installed")
def test_on_a_terminal_the_tables_are_drawn_by_rich_within_80_columns(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    client = make_client()
    leases = [client.acquire("report:" + "x" * 120), client.acquire("order:7", mode="write")]
    status, output = in_terminal(["list", *store(lock_server.url, namespace)])
    assert status == 0, output
    assert "─" * 20 in output  # rich's header rule
    assert "report:xxx" in output
    assert "order:7" in output
    assert_fits(output)
    status, output = in_terminal(["inspect", "order:7", *store(lock_server.url, namespace)])
    assert status == 0, output
    assert "fencing token" in output
    assert_fits(output)
    status, output = in_terminal(["list", "--plain", *store(lock_server.url, namespace)])
    assert status == 0, output
    assert "─" not in output
    assert output.splitlines()[0].split() == ["KEY", "KIND", "HOLDER", "FENCE", "LEFT", "WAIT"]
    assert all(lease.held for lease in leases)


def test_list_of_nothing_and_the_url_from_the_environment(lock_server: LockServer, namespace: str) -> None:
    result = lockaspect("list", "--namespace", namespace, env=cli_env(LOCKASPECT_URL=lock_server.url))
    assert result.returncode == 0, result.stderr
    assert f"no lock held in namespace {namespace!r} matching '*'" in result.stdout
    assert json.loads(lockaspect("list", "--json", *store(lock_server.url, namespace)).stdout) == []


@pytest.mark.parametrize("subcommand", [["list"], ["inspect", "k"], ["release", "k", "--force", "--yes"], ["doctor"]])
def test_without_a_url_it_names_both_ways_to_give_one(subcommand: list[str]) -> None:
    result = lockaspect(*subcommand)
    assert result.returncode == 2
    assert "--url" in result.stderr
    assert "LOCKASPECT_URL" in result.stderr
    assert result.stderr.count("\n") == 1


def test_an_unreachable_store_exits_69(namespace: str) -> None:
    result = lockaspect("list", *store("redis://127.0.0.1:1/0", namespace))
    assert result.returncode == 69
    assert "lockaspect list: the store failed" in result.stderr


def test_list_watch_refreshes_until_interrupted(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    watcher = start("list", "--watch", "--interval", "0.1", "--json", *store(lock_server.url, namespace))
    try:
        assert json.loads(read_until(watcher.stdout, lambda line: line.startswith("["))[-1]) == []
        lease = make_client().acquire("job:nightly")
        seen = read_until(watcher.stdout, "job:nightly")
        assert json.loads(seen[-1])[0]["fencing_token"] == lease.fencing_token
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=TIMEOUT) == 0
    finally:
        watcher.kill()
        watcher.communicate()


def test_list_on_a_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/locks.db"
    client = LockClient.from_url(url)
    try:
        lease = client.acquire("backup", permits=2)
        result = lockaspect("list", "--json", "--url", url)
        assert result.returncode == 0, result.stderr
        [info] = json.loads(result.stdout)
        assert (info["key"], info["kind"], info["permits"], info["fencing_token"]) == (
            "backup",
            "semaphore",
            2,
            lease.fencing_token,
        )
        lease.release()
    finally:
        client.close()


def test_release_evicts_another_process_which_gets_lock_lost(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient], owner_records: bool
) -> None:
    holder = start_python(HOLDER, lock_server.url, namespace, "order:42")
    try:
        token = int(read_until(holder.stdout, "holding")[-1].split()[1])
        result = lockaspect("release", "order:42", "--force", "--yes", "--json", *store(lock_server.url, namespace))
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert answer["released"] is True
        [evicted] = answer["evicted"]
        assert (evicted["key"], evicted["fencing_token"]) == ("order:42", token)
        # The holder learns at its next renewal: its on_lost hook, then LockLost.
        assert read_until(holder.stdout, "on_lost")[-1] == "on_lost not-owner"
        assert read_until(holder.stdout, "LockLost")[-1] == "LockLost not-owner"
        assert holder.wait(timeout=TIMEOUT) == 0
    finally:
        holder.kill()
        holder.communicate()
    # The fencing counter was kept: the next holder's token is larger.
    lease = make_client().acquire("order:42")
    assert lease.fencing_token is not None
    assert lease.fencing_token > token
    lease.release()

    need_owner_records(owner_records)
    assert evicted["holders"][0]["pid"] == holder.pid


def test_release_prints_who_it_evicted(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    lease = make_client(watchdog_lease=1.0).acquire("order:9", lease=30)
    result = lockaspect("release", "order:9", "--force", "--yes", *store(lock_server.url, namespace))
    assert result.returncode == 0, result.stderr
    assert "released 'order:9'; evicted:" in result.stdout
    assert f"fencing token {lease.fencing_token}" in result.stdout or "did not record" in result.stdout
    assert_fits(result.stdout)
    assert result.stderr == ""  # the library's own eviction warning is not printed twice
    again = lockaspect("release", "order:9", "--force", "--yes", *store(lock_server.url, namespace))
    assert again.returncode == 1
    assert "nothing to release" in again.stdout


def test_release_refuses_without_force_or_confirmation(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    client = make_client()
    lease = client.acquire("order:1")
    no_force = lockaspect("release", "order:1", *store(lock_server.url, namespace))
    assert no_force.returncode == 2
    assert "--force" in no_force.stderr
    assert "inspect" in no_force.stderr
    no_terminal = lockaspect("release", "order:1", "--force", *store(lock_server.url, namespace))
    assert no_terminal.returncode == 2
    assert "stdin is not a terminal" in no_terminal.stderr
    assert "--yes" in no_terminal.stderr
    assert client.locked("order:1")
    lease.release()


def test_release_asks_on_the_terminal(
    lock_server: LockServer, namespace: str, make_client: Callable[..., LockClient]
) -> None:
    client = make_client()
    lease = client.acquire("order:2")
    status, output = in_terminal(["release", "order:2", "--force", *store(lock_server.url, namespace)], answer="n")
    assert status == 1, output
    assert_fits(output)
    assert "Force-release 'order:2'? [y/N]" in output
    assert "still held" in output
    assert client.locked("order:2")
    status, output = in_terminal(["release", "order:2", "--force", *store(lock_server.url, namespace)], answer="y")
    assert status == 0, output
    assert "released 'order:2'" in output
    assert not client.locked("order:2")
    assert lease.lost or not lease.owned()


def test_infos_round_trip_through_json(held: dict[str, int | None], make_client: Callable[..., LockClient]) -> None:
    """The JSON the CLI prints is LockInfo.to_dict(): the same names as the Python API."""
    info = make_client().describe("order:42")
    assert isinstance(info, LockInfo)
    assert set(info.to_dict()) == INFO_FIELDS


def test_who_holds_is_shown_from_the_owner_records(capsys: pytest.CaptureFixture[str]) -> None:
    """On a store that records owners (the memory store, shared by name within this process,
    run through the command's own main()): host, pid, thread, function and template."""
    from lockaspect import distributed_lock
    from lockaspect.cli import main

    url = f"memory://cli-{os.getpid()}"
    client = LockClient.from_url(url)
    inside = threading.Event()
    leave = threading.Event()

    @distributed_lock(key="order:<user_id>", client=client)
    def create_order(user_id: int) -> None:
        inside.set()
        leave.wait(TIMEOUT)

    outcome: list[str] = []

    def work() -> None:
        try:
            create_order(42)
        except LockLost as exc:
            outcome.append(exc.reason)

    worker = threading.Thread(target=work, name="worker-7")
    worker.start()
    try:
        assert inside.wait(TIMEOUT)
        assert main(["list", "--url", url, "--json"]) == 0
        [info] = json.loads(capsys.readouterr().out)
        [holder] = info["holders"]
        assert (holder["host"], holder["pid"], holder["thread"]) == (socket.gethostname(), os.getpid(), "worker-7")
        assert holder["function"].endswith("create_order")
        assert holder["template"] == "order:<user_id>"
        assert main(["list", "--url", url, "--plain"]) == 0
        listed = capsys.readouterr().out
        assert_fits(listed)
        assert re.search(rf"^order:42\s+lock\s+\S*/{os.getpid()} \S*create_order\s", listed, re.MULTILINE), listed
        assert main(["inspect", "order:42", "--url", url, "--plain"]) == 0
        inspected = capsys.readouterr().out
        assert re.search(r"^\s+thread/task\s+worker-7$", inspected, re.MULTILINE), inspected
        assert re.search(r"^\s+template\s+order:<user_id>$", inspected, re.MULTILINE), inspected
        assert main(["release", "order:42", "--url", url, "--force", "--yes"]) == 0
        assert f"/{os.getpid()} " in capsys.readouterr().out
    finally:
        leave.set()
        worker.join(TIMEOUT)
        client.close()
    assert outcome == ["not-owner"]  # the evicted call raised LockLost when it ended
