"""The memory store's semantics on a clock moved by hand (:class:`ManualClock`): expiry,
the fair queue's drop-out, semaphore permits, read-write writer preference, fencing."""

from __future__ import annotations

import pytest

import lockaspect.backends as backends
from lockaspect import ConfigurationError, LockClient, LockLost
from lockaspect._policy import FAIR_GONE_AFTER
from lockaspect.backends import open_store, register_store, registered_schemes
from lockaspect.backends.base import AcquireRequest, ReleaseResult, RenewItem
from lockaspect.backends.memory import MemoryStore
from lockaspect.testing import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> MemoryStore:
    return MemoryStore(clock=clock)


def req(kind: str, key: str, owner: str, lease: float = 10.0, **fields: object) -> AcquireRequest:
    return AcquireRequest(kind, (key,), owner, lease, **fields)  # type: ignore[arg-type]


def test_lease_ends_exactly_when_the_clock_says(store: MemoryStore, clock: ManualClock) -> None:
    first = store.acquire(req("lock", "k", "a", 5.0))
    clock.advance(4.999)
    busy = store.acquire(req("lock", "k", "b"))
    assert not busy.acquired
    assert busy.holder_ttl == pytest.approx(0.001)
    clock.advance(0.001)
    later = store.acquire(req("lock", "k", "b"))
    assert later.acquired
    assert later.fencing_token == first.fencing_token + 1
    assert store.renew([RenewItem("k", "a", 5.0)]) == [False]
    assert store.release("k", "a") == ReleaseResult.NOT_OWNER


def test_renewal_extends_from_now(store: MemoryStore, clock: ManualClock) -> None:
    store.acquire(req("lock", "k", "a", 5.0))
    clock.advance(4.0)
    assert store.renew([RenewItem("k", "a", 5.0)]) == [True]
    clock.advance(4.0)
    assert store.reenter("k", "a")
    clock.advance(1.0)
    assert not store.reenter("k", "a")


def test_fencing_survives_force_release_and_expiry(store: MemoryStore, clock: ManualClock) -> None:
    tokens = [store.acquire(req("lock", "f", "a", 1.0)).fencing_token]
    assert store.force_release("f")
    tokens.append(store.acquire(req("write", "f", "b", 1.0)).fencing_token)  # one counter per key
    clock.advance(1.0)
    tokens.append(store.acquire(req("semaphore", "f", "c", 1.0, permits=1)).fencing_token)
    assert tokens == [1, 2, 3]


def test_fair_waiter_that_stops_trying_drops_out(store: MemoryStore, clock: ManualClock) -> None:
    assert store.acquire(req("fair", "q", "holder")).acquired
    assert not store.acquire(req("fair", "q", "t1", waiter="p-first")).acquired
    clock.advance(1.0)
    assert not store.acquire(req("fair", "q", "t2", waiter="p-second")).acquired
    assert not store.acquire(req("fair", "q", "t3")).acquired
    clock.advance(FAIR_GONE_AFTER)  # the first made no attempt for FAIR_GONE_AFTER + 1 s
    assert store.release("q", "holder", "fair") == ReleaseResult.RELEASED
    # the first is gone: the release hands the lock to the second, not to a try without an id
    assert not store.acquire(req("fair", "q", "t3")).acquired
    assert not store.reenter("q", "t1", "fair")
    second = store.acquire(req("fair", "q", "t2", waiter="p-second"))
    assert second.acquired
    assert second.fencing_token == 2


def test_fair_grant_to_a_dead_head_waiter_expires_with_its_lease(store: MemoryStore, clock: ManualClock) -> None:
    """The release makes the first live waiter the owner with the lease it registered: if it
    died meanwhile, the lock is held by nobody alive for that lease, no longer."""
    notifier = store.notifier()
    assert notifier is not None
    notifier.subscribe("q", 1.0, "n-first")  # its wake-up is received, never read
    assert store.acquire(req("fair", "q", "holder")).acquired
    assert not store.acquire(req("fair", "q", "dead", 2.0, waiter="n-first")).acquired
    assert not store.acquire(req("fair", "q", "t2", waiter="p-second")).acquired
    assert store.release("q", "holder", "fair") == ReleaseResult.RELEASED
    assert store.reenter("q", "dead", "fair")
    assert not store.acquire(req("fair", "q", "t2", waiter="p-second")).acquired
    clock.advance(2.0)
    assert store.acquire(req("fair", "q", "t2", waiter="p-second")).acquired


def test_fair_queue_order(store: MemoryStore) -> None:
    store.acquire(req("fair", "o", "holder"))
    for waiter in ("p1", "p2", "p3"):
        assert not store.acquire(req("fair", "o", "t-" + waiter, waiter=waiter)).acquired
    store.release("o", "holder", "fair")
    assert not store.acquire(req("fair", "o", "t-p2", waiter="p2")).acquired
    assert store.acquire(req("fair", "o", "t-p1", waiter="p1")).acquired
    store.release("o", "t-p1", "fair")
    assert not store.acquire(req("fair", "o", "t-p3", waiter="p3")).acquired
    assert store.acquire(req("fair", "o", "t-p2", waiter="p2")).acquired


def test_semaphore_permits_each_with_a_lease(store: MemoryStore, clock: ManualClock) -> None:
    assert store.acquire(req("semaphore", "s", "a", 2.0, permits=2)).acquired
    clock.advance(1.0)
    assert store.acquire(req("semaphore", "s", "b", 2.0, permits=2)).acquired
    busy = store.acquire(req("semaphore", "s", "c", 2.0, permits=2))
    assert not busy.acquired
    assert busy.holder_ttl == pytest.approx(1.0)
    assert store.acquire(req("semaphore", "s", "c", permits=3)).permits == 2
    assert store.permits("s") == (2, 2)
    clock.advance(1.0)
    assert store.permits("s") == (2, 1)
    assert store.acquire(req("semaphore", "s", "c", 2.0, permits=2)).acquired
    assert store.permits("s", 1) == (1, 2)  # lowering takes no permit away
    store.release("s", "b", "semaphore")
    assert not store.acquire(req("semaphore", "s", "d", permits=1)).acquired
    store.release("s", "c", "semaphore")
    assert store.acquire(req("semaphore", "s", "d", permits=1)).acquired


def test_waiting_writer_keeps_new_readers_out_until_it_is_gone(store: MemoryStore, clock: ManualClock) -> None:
    assert store.acquire(req("read", "rw", "r1")).acquired
    assert not store.acquire(req("write", "rw", "w", waiter="nw")).acquired
    assert not store.acquire(req("read", "rw", "r2")).acquired  # the waiting writer goes first
    clock.advance(FAIR_GONE_AFTER + 0.001)  # the writer stopped trying
    assert store.acquire(req("read", "rw", "r2")).acquired
    store.unqueue("rw", "nw", "write")
    store.release("rw", "r1", "read")
    store.release("rw", "r2", "read")
    assert store.acquire(req("write", "rw", "w")).acquired
    assert store.describe("rw")[0].kind == "write"


def test_unqueue_of_the_last_waiting_writer_lets_readers_in(store: MemoryStore) -> None:
    store.acquire(req("read", "u", "r1"))
    store.acquire(req("write", "u", "w", waiter="nw"))
    assert not store.acquire(req("read", "u", "r2")).acquired
    store.unqueue("u", "nw", "write")
    assert store.acquire(req("read", "u", "r2")).acquired


def test_bad_requests(store: MemoryStore) -> None:
    for bad in (
        req("mutex", "k", "a"),
        req("lock", "k", "a", 0.0),
        req("semaphore", "k", "a"),
        AcquireRequest("fair", ("a", "b"), "t", 1.0),
        AcquireRequest("lock", (), "t", 1.0),
    ):
        with pytest.raises(ConfigurationError):
            store.acquire(bad)
    with pytest.raises(ConfigurationError):
        store.wait_for_replicas(1, 0.1)


def test_named_stores_share_state_and_namespaces_separate() -> None:
    one, two = open_store("memory://unit-shared"), open_store("memory://unit-shared")
    private = open_store("memory://")
    other_ns = open_store("memory://unit-shared", namespace="other:")
    assert one.acquire(req("lock", "k", "a")).acquired
    assert not two.acquire(req("lock", "k", "b")).acquired
    assert private.acquire(req("lock", "k", "b")).acquired
    assert other_ns.acquire(req("lock", "k", "b")).acquired


def test_memory_url_errors() -> None:
    with pytest.raises(ConfigurationError, match="'socket_timeout'"):
        open_store("memory://", socket_timeout=1.0)
    with pytest.raises(ConfigurationError, match="memory://<name>"):
        open_store("memory://x/y")
    schemes = (
        r"memory://, postgres://, .*redis://, redis\+cluster://, redis\+sentinel://, rediss://, .*sqlite://, unix://"
    )
    with pytest.raises(ConfigurationError, match=schemes):
        open_store("nosuch://x")
    with pytest.raises(ConfigurationError):
        LockClient.from_url("memory://", wait_replicas=(1, 0.5))


def test_register_store_at_run_time(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []

    def factory(url: str, *, namespace: str = "lockaspect:") -> MemoryStore:
        made.append(url)
        return MemoryStore(namespace=namespace)

    registered_schemes()  # the entry points are read, so that the registry can be restored after
    monkeypatch.setattr(backends, "_factories", dict(backends._factories))
    register_store("unittest-mem", factory)
    assert "unittest-mem" in registered_schemes()
    with LockClient.from_url("unittest-mem://x") as client, client.lock("k") as lease:
        assert lease.fencing_token == 1
    assert made == ["unittest-mem://x"]


def test_client_on_a_manual_clock(clock: ManualClock) -> None:
    """A client's lease ends when the store's clock says: another owner takes the key, and
    the holder's block raises ``LockLost`` (its release finds the lock gone)."""
    store = MemoryStore(clock=clock)
    assert store.threads() == []

    def hold(client: LockClient) -> None:
        with client.lock("c", lease=5.0):
            assert not store.acquire(req("lock", "c", "x")).acquired
            clock.advance(5.0)
            assert store.acquire(req("lock", "c", "x")).acquired

    with LockClient(store) as client, pytest.raises(LockLost, match="not-owner"):
        hold(client)
