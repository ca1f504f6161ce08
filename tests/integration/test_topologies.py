"""``ValkeyCluster`` and ``ValkeySentinel`` against real valkey-server processes: the shapes of
their addresses, and that each fault leaves the topology in the state it promises (a moved
slot, a promoted replica, a rejoined node, the ASK window of a migration, a read-only old
master), and that stop leaves no process and no directory behind.

Tests that only look use the session fixtures; each test that injects a fault starts a
topology of its own.
"""

from __future__ import annotations

import os
import re
import uuid

import pytest
import redis
from redis.crc import key_slot
from redis.sentinel import Sentinel

from lockaspect.testing import SlotMigration, ValkeyCluster, ValkeyNode, ValkeySentinel

WAIT = 30.0  # a deadline against hanging, not a timing threshold


@pytest.fixture
def key() -> str:
    return f"topo-{uuid.uuid4().hex[:12]}"


def assert_stopped(pids: list[int], directory: str) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(directory)


def live_pids(nodes: list[ValkeyNode]) -> list[int]:
    return [node.pid for node in nodes if node.pid is not None]


class TestClusterShape:
    def test_url_names_the_primaries_and_startup_nodes_every_node(self, valkey_cluster: ValkeyCluster) -> None:
        ports = re.fullmatch(r"redis\+cluster://((?:127\.0\.0\.1:\d+,?)+)", valkey_cluster.url)
        assert ports is not None
        assert len(ports.group(1).split(",")) == 3
        assert valkey_cluster.startup_nodes == [("127.0.0.1", node.port) for node in valkey_cluster.nodes]
        assert len(valkey_cluster.nodes) == 6

    def test_roles_pair_every_primary_with_a_replica(self, valkey_cluster: ValkeyCluster) -> None:
        primaries, replicas = valkey_cluster.primaries(), valkey_cluster.replicas()
        assert len(primaries) == 3
        assert len(replicas) == 3
        assert {valkey_cluster.replica_of(primary).name for primary in primaries} == {r.name for r in replicas}

    def test_primary_for_a_key_is_the_primary_for_its_slot(self, valkey_cluster: ValkeyCluster, key: str) -> None:
        primary = valkey_cluster.primary_for(key)
        assert primary is valkey_cluster.primary_for(key_slot(key.encode()))
        assert primary is valkey_cluster.primary_for(key.encode())
        with valkey_cluster.client() as client:
            client.set(key, b"v")
        assert primary.client().get(key) == b"v"

    def test_nodes_report_their_process(self, valkey_cluster: ValkeyCluster) -> None:
        for node in valkey_cluster.nodes:
            assert node.alive
            assert node.pid is not None
            assert os.path.exists(node.log_path)


class TestClusterFaults:
    def test_failover_moves_the_keys_slot_to_the_old_replica_and_back(self, cluster: ValkeyCluster, key: str) -> None:
        old = cluster.primary_for(key)
        replica = cluster.replica_of(old)
        old.client().set(key, b"v")
        new = cluster.failover(key)
        assert new is replica
        assert cluster.primary_for(key) is new
        assert new.client().get(key) == b"v"
        with pytest.raises(redis.exceptions.MovedError):
            old.client().get(key)
        assert cluster.replica_of(new) is old
        # Given the primary node, with FORCE: its replica (the old primary) takes over again.
        assert cluster.failover(new, mode="FORCE") is old
        assert (old.role(), new.role()) == ("master", "slave")

        sha = old.client().script_load("return 1")
        cluster.flush_scripts()
        with pytest.raises(redis.exceptions.NoScriptError):
            old.client().evalsha(sha, 1, key)

    def test_kill_promotes_the_replica_restart_rejoins_and_stop_cleans_up(
        self, cluster: ValkeyCluster, key: str
    ) -> None:
        slot = key_slot(key.encode())
        old = cluster.primary_for(slot)
        replica = cluster.replica_of(old)
        old.client().set(key, b"v")
        cluster.kill(old)
        assert not old.alive
        assert old.pid is None
        new = cluster.wait_primary_changed(slot, old, timeout=WAIT)
        assert new is replica
        assert new.client().get(key) == b"v"

        cluster.restart(old)
        assert old.alive
        assert old.role() == "slave"
        assert cluster.replica_of(new) is old

        pids, directory = live_pids(cluster.nodes), cluster.directory
        assert len(pids) == 6
        cluster.stop()
        assert_stopped(pids, directory)
        assert not any(node.alive for node in cluster.nodes)

    def test_migrate_slot_answers_ask_until_finished_then_moved(self, cluster: ValkeyCluster, key: str) -> None:
        moved, stays = f"{{{key}}}:moved", f"{{{key}}}:stays"
        slot = key_slot(moved.encode())
        source = cluster.primary_for(slot)
        target = next(node for node in cluster.primaries() if node is not source)
        source.client().mset({moved: b"m", stays: b"s"})

        migration = cluster.migrate_slot(slot, target)
        assert isinstance(migration, SlotMigration)
        assert (migration.slot, migration.source, migration.target) == (slot, source, target)
        assert migration.move_keys([moved]) == 1
        with pytest.raises(redis.exceptions.AskError):
            source.client().get(moved)
        assert source.client().get(stays) == b"s"
        with cluster.client() as client:  # redis-py follows ASK by itself
            assert client.get(moved) == b"m"
        elsewhere = next(f"{key}-{i}" for i in range(1000) if key_slot(f"{key}-{i}".encode()) != slot)
        with pytest.raises(ValueError, match="is in slot"):
            migration.move_keys([elsewhere])

        migration.finish()
        with pytest.raises(redis.exceptions.MovedError):
            source.client().get(stays)
        assert target.client().get(stays) == b"s"
        assert cluster.primary_for(slot) is target
        assert migration.move_keys() == 0


class TestSentinelShape:
    def test_addresses(self, valkey_sentinel: ValkeySentinel) -> None:
        ports = ",".join(f"127.0.0.1:{port}" for _, port in valkey_sentinel.sentinel_addrs)
        assert valkey_sentinel.url == f"redis+sentinel://{ports}/mymaster"
        assert valkey_sentinel.service == "mymaster"
        assert len(valkey_sentinel.sentinels) == 3
        assert len(valkey_sentinel.data_nodes) == 2
        assert valkey_sentinel.master.role() == "master"
        assert [node.role() for node in valkey_sentinel.replicas] == ["slave"]

    def test_a_sentinel_client_writes_to_the_master(self, valkey_sentinel: ValkeySentinel, key: str) -> None:
        client = Sentinel(valkey_sentinel.sentinel_addrs, socket_timeout=5).master_for(valkey_sentinel.service)
        client.set(key, b"v")
        assert valkey_sentinel.master.client().get(key) == b"v"
        client.close()


class TestSentinelFaults:
    def test_failover_demotes_the_old_master(self, sentinel: ValkeySentinel, key: str) -> None:
        old = sentinel.master
        connection = old.client()
        connection.set(key, b"1")
        new = sentinel.failover(demote_old=True)
        assert new is not old
        assert sentinel.master is new
        assert sentinel.replicas == [old]
        with pytest.raises(redis.exceptions.ReadOnlyError):
            connection.set(key, b"2")
        for host, port in sentinel.sentinel_addrs:
            reported = redis.Redis(host=host, port=port).sentinel_get_master_addr_by_name(sentinel.service)
            assert int(reported[1]) == new.port

    def test_kill_master_promotes_restart_rejoins_and_stop_cleans_up(self, sentinel: ValkeySentinel, key: str) -> None:
        old = sentinel.master
        new = sentinel.kill_master()
        assert new is not old
        assert not old.alive
        assert sentinel.master is new

        sentinel.restart(old)
        role = old.client().execute_command("ROLE")
        assert (role[0], int(role[2])) == (b"slave", new.port)
        assert sentinel.replicas == [old]
        with new.client() as writer:
            writer.set(key, b"v")
            assert writer.execute_command("WAIT", 1, int(WAIT * 1000)) == 1
        assert old.client().get(key) == b"v"

        pids = live_pids([*sentinel.data_nodes, *sentinel.sentinels])
        assert len(pids) == 5
        sentinel.stop()
        assert_stopped(pids, sentinel.directory)

    def test_restart_of_a_sentinel(self, sentinel: ValkeySentinel) -> None:
        node = sentinel.sentinels[1]
        node.kill()
        sentinel.restart(node)
        assert node.alive
        assert node.role() == "sentinel"
