"""``lockaspect doctor`` against real servers started with the settings it judges: AOF on
(exit 0), ``allkeys-lru`` (1), no persistence (1), unreachable (2), a user without a command
lockaspect needs (2, asked both ways: ``ACL DRYRUN`` and ``redis.acl_check_cmd``), and a user
with exactly the rule doctor prints (every command allowed; locks work); and the other
stores."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import LockClient, LockLost
from lockaspect.testing import LockServer, PostgresServer, ValkeyCluster, ZooKeeperServer

from ._support import assert_fits, lockaspect


def doctor(url: str, *args: str) -> tuple[int, dict[str, Any]]:
    """Run doctor twice, human then JSON: both exit the same; the human output fits 80
    columns; the JSON report."""
    human = lockaspect("doctor", "--url", url, *args)
    assert_fits(human.stdout)
    machine = lockaspect("doctor", "--url", url, "--json", *args)
    assert human.returncode == machine.returncode, human.stdout + human.stderr
    assert f"exit status {human.returncode}" in human.stdout
    report = json.loads(machine.stdout)
    assert report["exit_status"] == machine.returncode
    return machine.returncode, report


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    """check name -> verdict, over every section."""
    return {check["check"]: check["verdict"] for section in report["sections"] for check in section["checks"]}


@pytest.fixture
def aof_server() -> Iterator[LockServer]:
    """A server as production should run one: AOF on, noeviction (the default)."""
    with LockServer(args=["--appendonly", "yes"]) as server:
        yield server


def user_url(server: LockServer, user: str) -> str:
    return f"redis://{user}:pw@127.0.0.1:{server.port}/0"


def test_a_well_configured_server_is_all_ok(aof_server: LockServer) -> None:
    status, report = doctor(aof_server.url)
    assert status == 0, report
    found = verdicts(report)
    for name in ("reachable", "version", "scripts", "pub/sub", "acl", "maxmemory-policy", "persistence", "clock"):
        assert found[name] == "ok", (name, report)
    assert found["replicas"] == "info"  # none: informational
    assert found["latency"] == "info"
    rule = report["acl_rule"]
    assert rule.startswith("ACL SETUSER default on ~lockaspect:* &lockaspect:* +evalsha +eval ")
    assert "+hset" in rule
    assert "+publish" in rule
    assert "+scan" in rule
    assert "+wait" not in rule
    _, waiting = doctor(aof_server.url, "--wait-replicas", "1")
    assert verdicts(waiting)["replicas"] == "error"
    assert "+wait" in waiting["acl_rule"]


def test_allkeys_lru_is_a_warning() -> None:
    with LockServer(args=["--appendonly", "yes", "--maxmemory-policy", "allkeys-lru"]) as server:
        status, report = doctor(server.url)
    assert status == 1
    found = verdicts(report)
    assert found["maxmemory-policy"] == "warn"
    assert [name for name, verdict in found.items() if verdict == "warn"] == ["maxmemory-policy"]


def test_no_persistence_is_a_warning(lock_server: LockServer) -> None:
    status, report = doctor(lock_server.url)
    assert status == 1
    assert verdicts(report)["persistence"] == "warn"


def test_an_unreachable_server_is_an_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        status, report = doctor(f"redis://127.0.0.1:{port}/0")
    assert status == 2
    assert verdicts(report) == {"reachable": "error"}


@pytest.mark.parametrize(
    ("rules", "method"),
    [
        (["+@all", "-hset"], "ACL DRYRUN"),  # a user who may ask ACL DRYRUN
        (["+@all", "-@dangerous", "-hset"], "redis.acl_check_cmd"),  # one who may not (nor INFO)
    ],
)
def test_a_user_without_a_needed_command_is_an_error(aof_server: LockServer, rules: list[str], method: str) -> None:
    aof_server.redis().execute_command("ACL", "SETUSER", "app", "on", ">pw", "~lockaspect:*", "&lockaspect:*", *rules)
    status, report = doctor(user_url(aof_server, "app"))
    assert status == 2
    found = verdicts(report)
    assert found["acl hset"] == "error"
    assert [name for name, verdict in found.items() if verdict == "error"] == ["acl hset"]
    assert method in json.dumps(report)
    assert report["acl_rule"].startswith("ACL SETUSER app on ")


def test_the_printed_acl_rule_is_enough_to_lock(aof_server: LockServer) -> None:
    _, report = doctor(aof_server.url, "--namespace", "app:")
    grants = report["acl_rule"].split()[3:]  # after "ACL SETUSER default"
    admin = aof_server.redis()
    admin.execute_command("ACL", "SETUSER", "locker", "on", ">pw", "-@all", *grants)
    status, restricted = doctor(user_url(aof_server, "locker"), "--namespace", "app:")
    found = verdicts(restricted)
    assert found["acl"] == "ok", restricted
    assert "error" not in found.values(), restricted
    assert status == 1  # INFO and CONFIG are not granted: the server settings are unread (warn)
    assert found["maxmemory-policy"] == "warn"
    client = LockClient.from_url(user_url(aof_server, "locker"), namespace="app:", watchdog_lease=1.0)
    try:
        with client.lock("order:1") as lease:
            assert client.describe("order:1") is not None
            assert [info.key for info in client.held_locks()] == ["order:1"]
        with client.semaphore("pool", permits=2), client.rw_lock("doc").read(), client.fair_lock("queue"):
            pass
        with client.rw_lock("doc").write():
            held = client.acquire("stuck")
            assert client.force_release("stuck")
            assert not held.owned()
            with pytest.raises(LockLost):
                held.release()
        assert lease.fencing_token is not None
    finally:
        client.close()


@pytest.mark.slow
def test_each_primary_of_a_cluster_is_checked(valkey_cluster: ValkeyCluster) -> None:
    status, report = doctor(valkey_cluster.url)
    assert status == 1  # the test cluster runs without persistence
    assert len(report["sections"]) == 3
    for section in report["sections"]:
        found = {check["check"]: check["verdict"] for check in section["checks"]}
        assert found["sharded pub/sub"] == "ok"
        assert found["acl"] == "ok"
        assert found["persistence"] == "warn"
        assert "error" not in found.values()
    assert "+spublish" in report["acl_rule"]
    assert "+cluster|slots" in report["acl_rule"]


def test_memory_and_sqlite(tmp_path: Path) -> None:
    status, report = doctor("memory://")
    assert status == 0
    assert verdicts(report)["reachable"] == "ok"
    status, report = doctor(f"sqlite:///{tmp_path}/locks.db")
    assert status == 0, report
    found = verdicts(report)
    assert found["tables"] == found["journal"] == found["file"] == "ok"
    assert report["acl_rule"] is None


def test_postgresql(postgres_server: PostgresServer) -> None:
    for url in (postgres_server.url, postgres_server.url.replace("postgresql://", "postgresql+table://")):
        status, report = doctor(url)
        assert status == 0, report
        found = verdicts(report)
        assert found["role"] == "ok"
        assert any(name.startswith("privileges lockaspect") for name in found)


def test_zookeeper(zookeeper_server: ZooKeeperServer) -> None:
    status, report = doctor(zookeeper_server.url)
    assert status == 0, report
    found = verdicts(report)
    assert found["version"] == "ok"
    assert found["clock"] == "info"  # not checked, and said so


def test_unreachable_other_stores_are_errors(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        status, report = doctor(f"postgresql://nobody@127.0.0.1:{port}/db")
    assert status == 2
    assert verdicts(report) == {"reachable": "error"}
    bad = lockaspect("doctor", "--url", f"sqlite:///{tmp_path}/missing/locks.db")
    assert bad.returncode == 2
    assert "does not exist" in bad.stderr
