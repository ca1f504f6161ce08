"""The Redis Cluster store on a real Valkey Cluster (3 primaries, 3 replicas, the session's
``valkey_cluster``): URLs and constructors, slots, per-slot renewal in one round trip per
primary, sharded wake-ups, cross-slot multi-key locks, the operator part, and mutual exclusion
across processes. Faults (failover, kill, migration) are in tests/topologies/."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
from redis.crc import key_slot

from lockaspect import LockClient, LockNotAcquired, NotReplicated
from lockaspect.backends import open_store
from lockaspect.backends.base import AcquireRequest, ReleaseResult, RenewItem
from lockaspect.backends.redis.cluster import AsyncClusterStore, ClusterStore
from lockaspect.errors import BackendError, ConfigurationError
from lockaspect.testing import ValkeyCluster

BOUND = 30.0  # a deadlock guard, not a speed expectation


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


def keys_on_every_primary(cluster: ValkeyCluster, per_primary: int = 2) -> list[str]:
    """Keys whose slots are served by each primary, ``per_primary`` each."""
    found: dict[int, list[str]] = {}
    i = 0
    while any(len(found.get(node.port, [])) < per_primary for node in cluster.primaries()):
        key = f"k{i}"
        i += 1
        port = cluster.primary_for(key).port
        if len(found.setdefault(port, [])) < per_primary:
            found[port].append(key)
    return [key for keys in found.values() for key in keys]


def same_slot_keys(count: int) -> list[str]:
    """``count`` distinct keys that hash to one slot (without braces: found by search)."""
    by_slot: dict[int, list[str]] = {}
    i = 0
    while True:
        key = f"s{i}"
        i += 1
        group = by_slot.setdefault(slot(key), [])
        group.append(key)
        if len(group) == count:
            return group


@pytest.fixture
def make_client(make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster) -> Callable[..., LockClient]:
    """Clients on the session's topology, in the test's namespace (closed after the test)."""
    return functools.partial(make_client, valkey_cluster.url)


# -- URLs, options, constructors --


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis+cluster://", "missing host"),
        ("redis+cluster://h:0", "port must be an integer from 1 to 65535"),
        ("redis+cluster://h:70000", "port must be an integer"),
        ("redis+cluster://h:x", "port must be an integer"),
        ("redis+cluster://h1,,h2", "empty host"),
        ("redis+cluster://h/1", "only database 0"),
        ("redis+cluster://h/0/x", "the path must be"),
        ("redis+cluster://::1:7000", "IPv6 host in brackets"),
        ("redis+cluster://[::1:7000", "unclosed"),
        ("redis+cluster://h?sockettimeout=1", "did you mean 'socket_timeout'"),
        ("redis+cluster://h?socket_timeout=abc", "bad value 'abc'"),
        ("redis+sentinel://h1,h2", "missing the service name"),
        ("redis+sentinel://h1/", "missing the service name"),
        ("redis+sentinel://h1/svc/db", "db a non-negative integer"),
        ("Redis+Cluster://h", "unsupported lock store URL"),
        ("valkey+cluster://h", "unsupported lock store URL"),
    ],
)
def test_bad_urls_fail_at_construction(url: str, match: str) -> None:
    """A malformed topology URL is a ConfigurationError naming the problem, raised before any
    connection is tried (the hosts here do not exist)."""
    with pytest.raises(ConfigurationError, match=match):
        LockClient.from_url(url)


def test_a_password_is_never_shown() -> None:
    with pytest.raises(ConfigurationError) as caught:
        LockClient.from_url("redis+cluster://user:s3cr/et?@h:0")
    assert "s3cr" not in str(caught.value)
    assert "user:***@" in str(caught.value)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"read_from_replicas": True}, "primaries only"),
        ({"db": 1}, "only database 0"),
        ({"host": "x"}, "hosts are in the URL"),
        ({"decode_responses": True}, "raw replies"),
        ({"socket_timout": 1}, "did you mean 'socket_timeout'"),
        ({"ssl_certfile": "x"}, "rediss\\+ URL only"),
        ({"sentinel_kwargs": {}}, "unknown option 'sentinel_kwargs'"),
    ],
)
def test_bad_cluster_options_fail_at_construction(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        open_store("redis+cluster://127.0.0.1:1", **options)


def test_sentinel_options_are_checked(valkey_cluster: ValkeyCluster) -> None:
    with pytest.raises(ConfigurationError, match="sentinel_kwargs must be a dict"):
        open_store("redis+sentinel://127.0.0.1:1/svc", sentinel_kwargs="password")
    with pytest.raises(ConfigurationError, match="did you mean 'min_other_sentinels'"):
        open_store("redis+sentinel://127.0.0.1:1/svc", min_other_sentinel=1)


def test_an_unreachable_cluster_is_a_transient_backend_error() -> None:
    """redis-py's cluster client reads the slot map when it is built: with no node reachable,
    building the store fails with a BackendError that names the URL, not a raw driver error."""
    with pytest.raises(BackendError, match=r"127\.0\.0\.1:1") as caught:
        LockClient.from_url("redis+cluster://127.0.0.1:1", socket_connect_timeout=0.5)
    assert caught.value.transient


def test_url_and_repr(make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster) -> None:
    client = make_client()
    assert isinstance(client.backend, ClusterStore)
    assert "redis+cluster://127.0.0.1:" in repr(client.backend)
    with client.lock("order:1") as lease:
        assert lease.fencing_token > 0


def test_from_cluster_sync_and_async(valkey_cluster: ValkeyCluster, namespace: str) -> None:
    """A store on a RedisCluster the user built; its asyncio twin reaches the same cluster."""
    rc = redis.cluster.RedisCluster(host="127.0.0.1", port=valkey_cluster.nodes[0].port)
    client = LockClient(ClusterStore.from_cluster(rc, namespace=namespace))
    try:
        other = LockClient(ClusterStore.from_cluster(rc, namespace=namespace))
        with client.lock("order:7"), pytest.raises(LockNotAcquired), other.lock("order:7", wait=0):
            pass

        async def main() -> None:
            twin = client.backend.asyncio_twin()
            assert isinstance(twin, AsyncClusterStore)
            await twin.aclose()
            async with client.lock("order:8") as lease:
                assert lease.fencing_token > 0
                assert rc.exists(f"{namespace}{{order:8}}") == 1

        asyncio.run(main())
    finally:
        client.close()
        rc.close()


def test_from_cluster_refuses_a_decoding_client(valkey_cluster: ValkeyCluster) -> None:
    rc = redis.cluster.RedisCluster(host="127.0.0.1", port=valkey_cluster.nodes[0].port, decode_responses=True)
    try:
        with pytest.raises(ConfigurationError, match="decode_responses=False"):
            ClusterStore.from_cluster(rc)
    finally:
        rc.close()


# -- slots and renewal --


def test_every_script_call_names_keys_of_one_slot(make_client: Callable[..., LockClient]) -> None:
    """Every kind works on keys spread over all primaries (a script whose keys spanned slots
    would be refused with CROSSSLOT)."""
    client = make_client()
    for key in [f"key-{i}" for i in range(12)]:
        with (
            client.lock(key),
            client.fair_lock(key + ":f"),
            client.semaphore(key + ":s", permits=2),
            client.rw_lock(key + ":rw").read(),
            client.rw_lock(key + ":rw2").write(),
        ):
            pass


class SendCounter:
    """Counts the writes (round trips) sent to each node while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[int] = Counter()
        self.active = False
        original = redis.connection.AbstractConnection.send_packed_command

        def counting(connection: Any, command: Any, check_health: bool = True) -> None:
            if self.active:
                self.counts[int(connection.port)] += 1
            original(connection, command, check_health)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)


def test_5000_renewals_take_one_round_trip_per_primary(
    valkey_cluster: ValkeyCluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5,000 leases over every primary and thousands of slots renew in one call that sends
    one batch to each primary, and every lease is renewed."""
    store = open_store(valkey_cluster.url, namespace=namespace)
    try:
        items = []
        for i in range(5000):
            token = uuid.uuid4().hex
            assert store.acquire(AcquireRequest("lock", (f"job:{i}",), token, 30.0)).acquired
            items.append(RenewItem(f"job:{i}", token, 60.0))
        counter = SendCounter(monkeypatch)
        store.renew(items)  # warm: the cluster pipeline's connections exist now
        counter.active = True
        statuses = store.renew(items)
        counter.active = False
        assert statuses == [True] * 5000
        primaries = {node.port for node in valkey_cluster.primaries()}
        assert set(counter.counts) == primaries
        assert all(count == 1 for count in counter.counts.values()), counter.counts
        assert len({slot(f"job:{i}") for i in range(5000)}) > 3000
        ttl = valkey_cluster.client().pttl(f"{namespace}{{job:4999}}")
        assert ttl > 30_000
    finally:
        store.close()


def test_the_watchdog_renews_in_one_round_trip_per_primary(
    make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held under the watchdog, leases on every primary are renewed at each tick with one
    write per primary (counted during the renewals of 20 leases or more; the watchdog
    renews the leases due at each tick)."""
    client = make_client(watchdog_lease=1.0, tick=0.05)
    store = client.backend
    counter = SendCounter(monkeypatch)
    per_call: list[Counter[int]] = []
    renew = store.renew
    seen = threading.Event()

    def counted(leases: Any) -> Any:
        counter.counts.clear()
        counter.active = True
        try:
            return renew(leases)
        finally:
            counter.active = False
            if len(leases) >= 20:
                per_call.append(Counter(counter.counts))
                if len(per_call) >= 4:
                    seen.set()

    monkeypatch.setattr(store, "renew", counted)
    with ExitStack() as stack:
        for i in range(300):
            stack.enter_context(client.lock(f"w:{i}"))
        assert seen.wait(BOUND)
    primaries = {node.port for node in valkey_cluster.primaries()}
    for counts in per_call[1:]:
        assert set(counts) <= primaries, counts
        assert all(count == 1 for count in counts.values()), counts


# -- wake-ups --


def test_a_release_wakes_the_waiter_with_a_sharded_message(
    make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster, namespace: str
) -> None:
    """The waiter subscribes with SSUBSCRIBE on the primary of its lock's slot (no plain
    SUBSCRIBE anywhere) and the release wakes it."""
    holder, waiter = make_client(), make_client()
    primary = valkey_cluster.primary_for("hot")
    raw = primary.client()
    got = threading.Event()
    channels: list[Any] = []

    def wait() -> None:
        with waiter.lock("hot", wait=BOUND):
            got.set()

    with holder.lock("hot"):
        thread = threading.Thread(target=wait)
        thread.start()
        deadline = BOUND
        while not channels and deadline > 0:
            channels = raw.execute_command("PUBSUB", "SHARDCHANNELS", f"{namespace}*")
            deadline -= 0.01
            threading.Event().wait(0.01)
        assert channels, "the waiter never subscribed on its slot's primary"
        for node in valkey_cluster.primaries():
            assert node.client().execute_command("PUBSUB", "CHANNELS", f"{namespace}*") == []
    assert got.wait(BOUND)
    thread.join(BOUND)


def test_waiters_poll_when_sharded_pubsub_is_refused(valkey_cluster: ValkeyCluster, namespace: str) -> None:
    """A user without pub/sub rights (ACL) still gets the lock after a release: the scripts'
    SPUBLISH fails quietly and the waiter polls."""
    user = f"nopubsub{uuid.uuid4().hex[:6]}"
    for node in valkey_cluster.nodes:
        node.client().execute_command(
            "ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", "-@pubsub", "-ssubscribe", "-spublish"
        )
    url = valkey_cluster.url.replace("redis+cluster://", f"redis+cluster://{user}:pw@")
    holder = LockClient.from_url(url, namespace=namespace)
    waiter = LockClient.from_url(url, namespace=namespace)
    try:
        got = threading.Event()

        def wait() -> None:
            with waiter.lock("polled", wait=BOUND):
                got.set()

        with holder.lock("polled"):
            thread = threading.Thread(target=wait)
            thread.start()
            assert not got.wait(0.2)
        assert got.wait(BOUND)
        thread.join(BOUND)
    finally:
        holder.close()
        waiter.close()
        for node in valkey_cluster.nodes:
            node.client().execute_command("ACL", "DELUSER", user)


# -- multi-key --


def test_cross_slot_multi_key_lock(make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster) -> None:
    keys = keys_on_every_primary(valkey_cluster, 1)
    assert len({slot(key) for key in keys}) == 3
    client, other = make_client(), make_client()
    with client.multi_lock(keys) as leases:
        tokens = leases.fencing_tokens
        assert set(tokens) == set(keys)
        assert all(token > 0 for token in tokens.values())
        for key in keys:
            with pytest.raises(LockNotAcquired), other.lock(key, wait=0):
                pass
    for key in keys:
        with other.lock(key, wait=0):
            pass


def test_multi_key_release_on_one_slot_is_one_script_call(
    make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster
) -> None:
    """Keys of one slot are given back with one multi_release.lua call on the slot's primary
    (counted there: ``INFO commandstats``); a key stolen meanwhile answers NOT_OWNER and stays
    the thief's, the others are released. Keys over several slots go key by key."""
    keys = same_slot_keys(3)
    store = make_client().backend
    assert isinstance(store, ClusterStore)
    owner, thief = uuid.uuid4().hex, uuid.uuid4().hex
    node = store.redis.get_node_from_key(store.lock_key(keys[0]))
    primary = redis.Redis(host=node.host, port=node.port)
    try:
        for _ in range(2):  # the first call caches the script on the primary
            assert store.acquire(AcquireRequest("lock", tuple(keys), owner, 10.0)).acquired
            assert store.force_release(keys[1])
            assert store.acquire(AcquireRequest("lock", (keys[1],), thief, 10.0)).acquired
            before = int(primary.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
            statuses = store.release_many(keys, owner)
            after = int(primary.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
            assert list(statuses) == [ReleaseResult.RELEASED, ReleaseResult.NOT_OWNER, ReleaseResult.RELEASED]
            assert store.reenter(keys[1], thief)
            assert store.release(keys[1], thief) == ReleaseResult.RELEASED
        assert after - before == 1, "one release call for the set"
    finally:
        primary.close()
    spread = sorted(keys_on_every_primary(valkey_cluster, 1))
    assert store.acquire(AcquireRequest("lock", tuple(spread), owner, 10.0)).acquired
    assert list(store.release_many(spread, owner)) == [ReleaseResult.RELEASED] * 3
    assert all(store.describe(key) == [] for key in spread)


def test_cross_slot_multi_key_busy_gives_back_what_it_took(
    make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster
) -> None:
    """A busy key (the last in sorted order) makes the attempt fail naming it, and the keys
    taken before it are given back."""
    keys = sorted(keys_on_every_primary(valkey_cluster, 1))
    client, other = make_client(), make_client()
    with other.lock(keys[-1]):
        with pytest.raises(LockNotAcquired) as caught, client.multi_lock(keys, wait=0):
            pass
        assert caught.value.key == keys[-1]
        for key in keys[:-1]:
            assert client.backend.describe(key) == []
    with client.multi_lock(keys, wait=0):
        pass


def test_cross_slot_multi_key_waits_for_a_busy_key(
    make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster
) -> None:
    keys = keys_on_every_primary(valkey_cluster, 1)
    client, other = make_client(), make_client()
    released = threading.Event()
    got = threading.Event()

    def wait() -> None:
        with client.multi_lock(keys, wait=BOUND):
            assert released.is_set()
            got.set()

    with other.lock(keys[1]):
        thread = threading.Thread(target=wait)
        thread.start()
        assert not got.wait(0.2)
        released.set()
    assert got.wait(BOUND)
    thread.join(BOUND)


def test_same_slot_multi_key_is_one_script(
    make_client: Callable[..., LockClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = same_slot_keys(3)
    client = make_client()
    store = client.backend
    calls: list[str] = []
    monkeypatch.setattr(store, "lock_acquire", lambda *a, **k: calls.append(a[0]))
    with client.multi_lock(keys) as leases:
        assert sorted(leases.fencing_tokens) == sorted(keys)
        assert all(token > 0 for token in leases.fencing_tokens.values())
    assert calls == []


def test_cross_slot_multi_key_async(make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster) -> None:
    keys = keys_on_every_primary(valkey_cluster, 1)
    client, other = make_client(), make_client()

    async def main() -> None:
        async with client.multi_lock(keys) as leases:
            assert set(leases.fencing_tokens) == set(keys)
        async with other.lock(sorted(keys)[-1]):
            with pytest.raises(LockNotAcquired):
                async with client.multi_lock(keys, wait=0):
                    pass
            twin = client.backend.asyncio_twin()
            try:
                for key in sorted(keys)[:-1]:
                    assert await twin.describe(key) == []
            finally:
                await twin.aclose()

    asyncio.run(main())


# -- replicas, operator part, fencing --


def test_wait_replicas(valkey_cluster: ValkeyCluster, namespace: str) -> None:
    """WAIT goes on the connection of the primary that took the lock: its one replica counts."""
    client = LockClient.from_url(valkey_cluster.url, namespace=namespace, wait_replicas=(1, 1.0))
    too_many = LockClient.from_url(valkey_cluster.url, namespace=namespace, wait_replicas=(2, 0.2))
    try:
        for key in keys_on_every_primary(valkey_cluster, 1):
            with client.lock(key):
                pass
            with pytest.raises(NotReplicated), too_many.lock(key):
                pass
    finally:
        client.close()
        too_many.close()


def test_admin_over_every_primary(make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster) -> None:
    client = make_client()
    store = client.backend
    keys = keys_on_every_primary(valkey_cluster, 3)
    with ExitStack() as stack:
        for key in keys:
            assert store.acquire(AcquireRequest("lock", (key,), uuid.uuid4().hex, 30.0)).acquired
        stack.enter_context(client.semaphore("sem", permits=3))
        assert sorted(store.held_keys()) == sorted([*keys, "sem"])
        assert sorted(store.held_keys("k*")) == sorted(keys)
        assert [state.kind for state in store.describe(keys[0])] == ["lock"]
        assert store.force_release(keys[0])
        assert store.describe(keys[0]) == []

        async def held() -> list[str]:
            twin = store.asyncio_twin()
            try:
                return sorted([key async for key in twin.held_keys()])
            finally:
                await twin.aclose()

        assert asyncio.run(held()) == sorted([*keys[1:], "sem"])


def test_redis_fence_on_a_cluster(make_client: Callable[..., LockClient], valkey_cluster: ValkeyCluster) -> None:
    """RedisFence keeps a resource and its high-water mark under one hash tag: one slot, so its
    script runs on a cluster (through the store's own RedisCluster client)."""
    from lockaspect.fencing import RedisFence

    client = make_client()
    fence = RedisFence.for_client(client, namespace=f"fenced-{uuid.uuid4().hex[:6]}:")
    with client.lock("ledger") as lease:
        assert fence.write("ledger", "a", lease.fencing_token)
        assert not fence.write("ledger", "b", lease.fencing_token - 1)
    assert fence.read("ledger") == b"a"
    assert fence.high_water("ledger") == lease.fencing_token


# -- processes --


def _count(url: str, namespace: str, keys: list[str], rounds: int, directory: str, errors: Any) -> None:
    client = LockClient.from_url(url, namespace=namespace)
    try:
        for _ in range(rounds):
            for key in keys:
                with client.lock(key, wait=BOUND):
                    path = Path(directory) / key
                    value = int(path.read_text()) if path.exists() else 0
                    path.write_text(str(value + 1))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        errors.put(repr(exc))
    finally:
        client.close()


def test_mutual_exclusion_across_processes(valkey_cluster: ValkeyCluster, namespace: str, tmp_path: Path) -> None:
    """4 processes increment per-key counters in files under locks on keys of every primary:
    every increment is counted exactly once."""
    keys = keys_on_every_primary(valkey_cluster, 2)
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    rounds = 15
    workers = [
        context.Process(target=_count, args=(valkey_cluster.url, namespace, keys, rounds, str(tmp_path), errors))
        for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert all(worker.exitcode == 0 for worker in workers)
    assert errors.empty(), errors.get()
    assert {key: int((tmp_path / key).read_text()) for key in keys} == dict.fromkeys(keys, 4 * rounds)
