"""The contract suite's fixtures: every test runs on each store (``memory``: a
:class:`~lockaspect.backends.memory.MemoryStore`; ``redis``: the session's Valkey server from
:class:`~lockaspect.testing.LockServer`; ``redis_cluster`` / ``redis_sentinel``: the session's
Valkey Cluster (3 primaries, 3 replicas) and Sentinel set (master, replica, 3 sentinels);
``postgres``: session advisory locks on the session's
PostgreSQL server; ``zookeeper``: the session's ZooKeeper server), through the public API only, so it keeps passing
while the engine behind it is rewritten.

``kind`` names how a test takes a lock: ``lock``, ``fair``, ``semaphore`` (one permit: as
exclusive as a lock), ``write``, ``read`` and ``multi`` (a multi-key lock over the key and a
second key). Kinds a store does not declare are skipped.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lockaspect import Lease, LockClient, MultiLease
from lockaspect.backends import open_store
from lockaspect.backends.base import AdminStore, Capability, Store
from lockaspect.backends.memory import MemoryStore
from lockaspect.backends.redis import RedisBackend
from lockaspect.backends.sql.advisory import open_postgres_store
from lockaspect.testing import LockServer, PostgresServer, ZooKeeperServer

STORES = ["memory", "redis", "redis_cluster", "redis_sentinel", "sqlite", "postgres_table", "postgres", "zookeeper"]
#: Kinds that let one holder in at a time.
EXCLUSIVE = ["lock", "fair", "semaphore", "write", "multi"]
ALL_KINDS = [*EXCLUSIVE, "read"]


@pytest.fixture(params=STORES)
def store_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(store_name: str, request: pytest.FixtureRequest) -> Iterator[Callable[[], Store]]:
    """Stores on one state (memory: one named state; redis: the session server), in a fresh
    namespace, closed after the test."""
    made: list[Store] = []
    tag = uuid.uuid4().hex[:10]

    def make() -> Store:
        store: Store
        if store_name == "memory":
            store = MemoryStore(name=f"contract-{tag}")
        elif store_name == "sqlite":
            path = request.getfixturevalue("tmp_path") / "locks.db"
            store = open_store(f"sqlite:///{path}", namespace=f"c-{tag}:")
        elif store_name == "postgres_table":
            postgres: PostgresServer = request.getfixturevalue("postgres_server")
            url = postgres.url.replace("postgresql://", "postgresql+table://", 1)
            store = open_store(url, namespace=f"c-{tag}:")
        elif store_name == "zookeeper":
            zookeeper: ZooKeeperServer = request.getfixturevalue("zookeeper_server")
            store = open_store(zookeeper.url + "/contract", namespace=f"c-{tag}:")
        elif store_name == "redis_cluster":
            store = open_store(request.getfixturevalue("valkey_cluster").url, namespace=f"c-{tag}:")
        elif store_name == "redis_sentinel":
            store = open_store(request.getfixturevalue("valkey_sentinel").url, namespace=f"c-{tag}:")
        elif store_name == "postgres":
            server_pg: PostgresServer = request.getfixturevalue("postgres_server")
            store = open_postgres_store(server_pg.url, namespace=f"c-{tag}:")
        else:
            server: LockServer = request.getfixturevalue("lock_server")
            store = RedisBackend.from_url(server.url, namespace=f"c-{tag}:")
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def store(make_store: Callable[[], Store]) -> Store:
    return make_store()


@pytest.fixture
def make_client(make_store: Callable[[], Store]) -> Iterator[Callable[..., LockClient]]:
    """Clients on the test's stores: a 0.5 s watchdog lease and a 50 ms tick, so renewals and
    losses show within a second."""
    made: list[LockClient] = []

    def make(**options: Any) -> LockClient:
        options.setdefault("watchdog_lease", 0.5)
        options.setdefault("tick", 0.05)
        client = LockClient(make_store(), **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def client(make_client: Callable[..., LockClient]) -> LockClient:
    return make_client()


def skip_unless_served(client: LockClient, kind: str) -> None:
    backend = client.backend
    if kind == "multi":
        if not backend.capabilities & Capability.MULTI_KEY:
            pytest.skip(f"{backend!r} has no multi-key locks")
    elif kind not in backend.kinds:
        pytest.skip(f"{backend!r} does not serve {kind!r}")


def skip_if_session_bound(store: Store, why: str) -> None:
    """Skip a test that cannot apply to a store whose holds live with a session
    (``Capability.SESSION_BOUND``: no lease expires by itself while the session lives)."""
    if store.capabilities & Capability.SESSION_BOUND:
        pytest.skip(f"{store!r} is SESSION_BOUND: {why}")


def block(client: LockClient, kind: str, key: str, **options: Any) -> Any:
    """The ``with`` / ``async with`` block of ``kind`` on ``key``."""
    if kind == "lock":
        return client.lock(key, **options)
    if kind == "fair":
        return client.fair_lock(key, **options)
    if kind == "semaphore":
        return client.semaphore(key, permits=1, **options)
    if kind in ("read", "write"):
        rw = client.rw_lock(key)
        return rw.read(**options) if kind == "read" else rw.write(**options)
    assert kind == "multi"
    return client.multi_lock([key, key + ":second"], **options)


def fence(lease: Lease | MultiLease, key: str) -> int:
    """The fencing token of ``key`` in what a block gave."""
    if isinstance(lease, MultiLease):
        return lease.fencing_tokens[key]
    return lease.fencing_token


def force_release(store: Store, key: str) -> None:
    """Delete every hold of ``key`` behind its holders' backs: the store's
    :meth:`AdminStore.force_release` (every store of the suite has it)."""
    assert isinstance(store, AdminStore)
    assert store.force_release(key)


def force_release_all(store: Store, key: str, kind: str) -> None:
    force_release(store, key)
    if kind == "multi":
        force_release(store, key + ":second")
