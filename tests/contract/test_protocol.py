"""The store protocol itself (:mod:`lockaspect.backends.base`), store by store: what each call
answers, below the engine."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable

import pytest

from lockaspect.backends.base import (
    AcquireRequest,
    AdminStore,
    AsyncReleasesMany,
    AsyncStore,
    Capability,
    ReleaseResult,
    ReleasesMany,
    RenewItem,
    Store,
)

from .conftest import skip_if_session_bound

LEASE = 10.0


def token() -> str:
    return uuid.uuid4().hex


def req(kind: str, key: str, owner: str, **fields: object) -> AcquireRequest:
    return AcquireRequest(kind, (key,), owner, LEASE, **fields)  # type: ignore[arg-type]


def test_declarations(store: Store) -> None:
    assert isinstance(store, Store)
    # Holds live either by a lease the watchdog renews or by a session the store keeps: one of the two.
    assert bool(store.capabilities & Capability.RENEWABLE) != bool(store.capabilities & Capability.SESSION_BOUND)
    assert store.capabilities & Capability.FENCING
    assert {"lock", "fair", "semaphore", "read", "write"} <= store.kinds


@pytest.mark.parametrize("kind", ["lock", "fair", "semaphore", "read", "write"])
def test_acquire_release_reenter(store: Store, kind: str) -> None:
    """Acquire, retry with the same token (same fence), busy for another (a holder's TTL),
    re-enter only for the owner, release once."""
    ours, theirs = token(), token()
    fields = {"permits": 1} if kind == "semaphore" else {}
    first = store.acquire(req(kind, "k", ours, **fields))
    assert first.acquired
    assert first.fencing_token >= 1
    again = store.acquire(req(kind, "k", ours, **fields))
    assert again.acquired
    assert again.fencing_token == first.fencing_token
    if kind != "read":
        busy = store.acquire(req(kind, "k", theirs, **fields))
        assert not busy.acquired
        assert busy.holder_ttl is not None
        assert 0 < busy.holder_ttl <= LEASE
    assert store.reenter("k", ours, kind)
    assert not store.reenter("k", theirs, kind)
    assert store.release("k", theirs, kind) == ReleaseResult.NOT_OWNER
    assert store.release("k", ours, kind) == ReleaseResult.RELEASED
    assert store.release("k", ours, kind) == ReleaseResult.NOT_OWNER
    assert not store.reenter("k", ours, kind)
    later = store.acquire(req(kind, "k", theirs, **fields))
    assert later.acquired
    assert later.fencing_token > first.fencing_token


def test_renew_statuses(store: Store) -> None:
    """One status per item, in order: ours renewed, another's token and an unknown key not."""
    ours = token()
    assert store.acquire(req("lock", "r", ours)).acquired
    assert store.acquire(req("semaphore", "rs", ours, permits=2)).acquired
    statuses = store.renew(
        [
            RenewItem("r", ours, LEASE),
            RenewItem("r", token(), LEASE),
            RenewItem("nothing-here", ours, LEASE),
            RenewItem("rs", ours, LEASE, "semaphore"),
        ]
    )
    assert list(statuses) == [True, False, False, True]


def test_short_lease_ends(store: Store) -> None:
    """A lease ends by itself: another token gets the key, with a larger fencing token, and
    the old owner's renewal and release answer not-ours."""
    skip_if_session_bound(store, "a hold lasts as long as its session, not a lease")
    old, new = token(), token()
    first = store.acquire(AcquireRequest("lock", ("short",), old, 0.05))
    assert first.acquired
    for _ in range(400):
        later = store.acquire(req("lock", "short", new))
        if later.acquired:
            break
        threading.Event().wait(0.01)  # polling: nothing announces a lease's end
    assert later.acquired
    assert later.fencing_token > first.fencing_token
    assert list(store.renew([RenewItem("short", old, LEASE)])) == [False]
    assert store.release("short", old) == ReleaseResult.NOT_OWNER


def test_release_wakes_the_queued_waiter_and_unqueue_forgets_it(store: Store) -> None:
    """A busy attempt with a waiter id queues it; the release wakes it through the notifier.
    An unqueued waiter is not woken."""
    if not store.capabilities & Capability.RELEASE_NOTIFY:
        pytest.skip(f"{store!r} has no RELEASE_NOTIFY (its waiters poll)")
    skip_if_session_bound(
        store,
        "a release hands the lock to the waiter queued in the server (another token's try may not take it); "
        "tests/integration/test_postgres_advisory.py checks the handover and unqueue",
    )
    notifier = store.notifier()
    assert notifier is not None
    holder, waiter = token(), store.waiter_id(True)
    assert store.acquire(req("lock", "q", holder)).acquired
    assert not store.acquire(req("lock", "q", token(), waiter=waiter)).acquired
    subscription = notifier.subscribe("q", 5.0, waiter)
    assert subscription.active
    assert store.release("q", holder) == ReleaseResult.RELEASED
    assert subscription.wait(10.0)
    # queued again, then gone: the release wakes nobody
    assert store.acquire(req("lock", "q", holder)).acquired
    assert not store.acquire(req("lock", "q", token(), waiter=waiter)).acquired
    store.unqueue("q", waiter)
    assert store.release("q", holder) == ReleaseResult.RELEASED
    assert not subscription.wait(0.3)
    notifier.unsubscribe(subscription)


def test_fair_try_without_waiter_fails_while_others_queue(store: Store) -> None:
    """The waiter keeps its token while it waits (as the engine does): a store with
    FAIR_HANDOFF made it the owner on release, one without kept the lock for it."""
    holder, waiter, mine = token(), store.waiter_id(False), token()
    assert store.acquire(req("fair", "f", holder)).acquired
    assert not store.acquire(req("fair", "f", mine, waiter=waiter)).acquired
    assert store.release("f", holder, "fair") == ReleaseResult.RELEASED
    assert not store.acquire(req("fair", "f", token())).acquired  # promised to (or held by) the waiter
    assert store.acquire(req("fair", "f", mine, waiter=waiter)).acquired


def test_semaphore_permits_mismatch_changes_nothing(store: Store) -> None:
    assert store.acquire(req("semaphore", "s", token(), permits=2)).acquired
    mismatch = store.acquire(req("semaphore", "s", token(), permits=3))
    assert not mismatch.acquired
    assert mismatch.permits == 2
    assert store.acquire(req("semaphore", "s", token(), permits=2)).acquired
    assert not store.acquire(req("semaphore", "s", token(), permits=2)).acquired


def test_read_write(store: Store) -> None:
    """Readers share, a writer excludes; the writer may read below its write lock."""
    writer = token()
    assert store.acquire(req("read", "rw", token())).acquired
    assert store.acquire(req("read", "rw", token())).acquired
    assert not store.acquire(req("write", "rw", writer)).acquired
    assert store.acquire(req("write", "rw2", writer)).acquired
    assert not store.acquire(req("read", "rw2", token())).acquired
    downgrade = store.acquire(req("read", "rw2", token(), below=writer))
    assert downgrade.acquired


def test_multi_key(store: Store) -> None:
    owner = token()
    assert store.acquire(req("lock", "m2", token())).acquired
    busy = store.acquire(AcquireRequest("lock", ("m1", "m2"), owner, LEASE))
    assert not busy.acquired
    assert busy.busy == "m2"
    assert store.acquire(req("lock", "m1", token())).acquired  # m1 was not kept
    both = store.acquire(AcquireRequest("lock", ("m3", "m4"), owner, LEASE))
    assert both.acquired
    assert len(both.fencing_tokens) == 2
    assert both.fencing_token == both.fencing_tokens[0]
    assert store.acquire(AcquireRequest("lock", ("m3", "m4"), owner, LEASE)).fencing_tokens == both.fencing_tokens


def test_permits(store: Store) -> None:
    admin = store
    assert admin.permits("p") == (None, 0)  # type: ignore[attr-defined]
    assert store.acquire(req("semaphore", "p", token(), permits=2)).acquired
    assert admin.permits("p") == (2, 1)  # type: ignore[attr-defined]
    assert admin.permits("p", 5) == (5, 1)  # type: ignore[attr-defined]


def _admin(store: Store) -> AdminStore:
    assert isinstance(store, AdminStore)
    return store


def test_admin_describe_and_held_keys(store: Store) -> None:
    admin = _admin(store)
    assert admin.describe("a:1") == []
    first = store.acquire(req("lock", "a:1", token()))
    store.acquire(req("semaphore", "a:2", token(), permits=3))
    (state,) = admin.describe("a:1")
    assert (state.kind, state.holders, state.fencing_token) == ("lock", 1, first.fencing_token)
    assert 0 < (state.remaining or 0) <= LEASE
    assert sorted(admin.held_keys("a:*")) == ["a:1", "a:2"]
    assert admin.describe("a:2")[0].permits == 3


def test_admin_force_release_keeps_fencing(store: Store) -> None:
    admin = _admin(store)
    owner = token()
    first = store.acquire(req("lock", "fr", owner))
    assert admin.force_release("fr")
    assert not admin.force_release("fr")
    assert not store.reenter("fr", owner)
    assert store.acquire(req("lock", "fr", token())).fencing_token > first.fencing_token


def test_async_twin_shares_the_store(store: Store) -> None:
    """The asyncio twin serves the same locks (a sync holder keeps an async caller out)."""
    holder = token()
    assert store.acquire(req("lock", "twin", holder)).acquired

    async def main() -> None:
        twin = store.asyncio_twin()
        assert isinstance(twin, AsyncStore)
        try:
            assert not (await twin.acquire(req("lock", "twin", token()))).acquired
            assert await twin.reenter("twin", holder)
            assert await twin.release("twin", holder) == ReleaseResult.RELEASED
            assert (await twin.acquire(req("lock", "twin", token()))).acquired
        finally:
            await twin.aclose()

    asyncio.run(main())


def test_no_replicas_unless_declared(store: Store, make_store: Callable[[], Store]) -> None:
    if store.capabilities & Capability.REPLICAS:
        pytest.skip(f"{store!r} can wait for replicas")
    from lockaspect import ConfigurationError

    with pytest.raises(ConfigurationError):
        store.wait_for_replicas(1, 0.5)


# -- FAIR_HANDOFF: a fair release makes the first waiter the owner ------------------------


def skip_unless_handoff(store: Store) -> None:
    if not store.capabilities & Capability.FAIR_HANDOFF:
        pytest.skip(f"{store!r} has no FAIR_HANDOFF (its fair release wakes the first waiter, which then takes it)")


def test_fair_release_hands_the_lock_to_the_first_waiter(store: Store) -> None:
    """The woken waiter holds the lock with its own token, lease and owner record and a fresh
    fencing token, which its wake-up carries; the next release hands it on in queue order."""
    skip_unless_handoff(store)
    notifier = store.notifier()
    assert notifier is not None
    holder, first, second = token(), token(), token()
    first_id, second_id = store.waiter_id(True), store.waiter_id(True)
    held = store.acquire(req("fair", "h", holder))
    subscription = notifier.subscribe("h", 5.0, first_id)
    assert subscription.active
    asks = AcquireRequest("fair", ("h",), first, LEASE, first_id, owner='{"who": "first"}')
    assert not store.acquire(asks).acquired
    assert not store.acquire(req("fair", "h", second, waiter=second_id)).acquired
    assert store.release("h", holder, "fair") == ReleaseResult.RELEASED
    assert subscription.wait(10.0)
    granted = subscription.granted  # type: ignore[attr-defined]
    assert granted > held.fencing_token
    assert store.reenter("h", first, "fair")
    assert not store.acquire(req("fair", "h", token())).acquired
    assert not store.acquire(req("fair", "h", second, waiter=second_id)).acquired
    if isinstance(store, AdminStore):
        (state,) = store.describe("h")
        assert (state.kind, state.fencing_token) == ("fair", granted)
        assert [(h.token, h.owner, h.fencing_token) for h in state.held_by] == [(first, '{"who": "first"}', granted)]
    # its attempt (a wake-up lost, or a retry) finds the lock its own, with the same fence
    again = store.acquire(req("fair", "h", first, waiter=first_id))
    assert (again.acquired, again.fencing_token) == (True, granted)
    notifier.unsubscribe(subscription)
    assert store.release("h", first, "fair") == ReleaseResult.RELEASED
    # nobody received the second's wake-up (it may still be subscribing): the lock stays free for it
    assert not store.reenter("h", second, "fair")
    assert not store.acquire(req("fair", "h", token())).acquired
    taken = store.acquire(req("fair", "h", second, waiter=second_id))
    assert taken.acquired
    assert taken.fencing_token > granted


def test_fair_grant_without_a_wakeup_is_found_by_the_next_attempt(store: Store) -> None:
    """A wake-up the waiter never read (lost on its way, or the waiter was busy): its next
    attempt finds the lock its own."""
    skip_unless_handoff(store)
    holder, mine, waiter = token(), token(), store.waiter_id(True)
    subscription = listen(store, "lost", waiter)
    held = store.acquire(req("fair", "lost", holder))
    assert not store.acquire(req("fair", "lost", mine, waiter=waiter)).acquired
    assert store.release("lost", holder, "fair") == ReleaseResult.RELEASED
    assert not store.acquire(req("fair", "lost", token())).acquired
    found = store.acquire(req("fair", "lost", mine, waiter=waiter))
    assert found.acquired
    assert found.fencing_token > held.fencing_token
    assert store.release("lost", mine, "fair") == ReleaseResult.RELEASED
    assert store.acquire(req("fair", "lost", token())).acquired  # nobody queues any more
    store.notifier().unsubscribe(subscription)  # type: ignore[union-attr]


def test_fair_waiter_that_gives_up_after_the_grant_hands_it_on(store: Store) -> None:
    """A waiter that leaves the queue (unqueue) and then gives its token back (release) passes
    a lock it was granted to the next waiter; one that left before the release is skipped."""
    skip_unless_handoff(store)
    holder, quitter, late, next_ = token(), token(), token(), token()
    quitter_id, late_id, next_id = (store.waiter_id(True) for _ in range(3))
    subscriptions = [listen(store, "quit", waiter) for waiter in (quitter_id, late_id, next_id)]
    assert store.acquire(req("fair", "quit", holder)).acquired
    assert not store.acquire(req("fair", "quit", late, waiter=late_id)).acquired
    assert not store.acquire(req("fair", "quit", quitter, waiter=quitter_id)).acquired
    assert not store.acquire(req("fair", "quit", next_, waiter=next_id)).acquired
    store.unqueue("quit", late_id, "fair")  # gave up before the release: never granted
    assert store.release("quit", late, "fair") == ReleaseResult.NOT_OWNER
    assert store.release("quit", holder, "fair") == ReleaseResult.RELEASED
    assert store.reenter("quit", quitter, "fair")
    store.unqueue("quit", quitter_id, "fair")  # gave up after the release
    assert store.release("quit", quitter, "fair") == ReleaseResult.RELEASED
    assert store.reenter("quit", next_, "fair")
    for subscription in subscriptions:
        store.notifier().unsubscribe(subscription)  # type: ignore[union-attr]


def test_fair_grant_to_a_dead_waiter_ends_with_its_lease(store: Store) -> None:
    """A first waiter that died after its last attempt is granted the lock with the lease it
    asked for: the lock is free again when that lease ends, and the next waiter gets it."""
    skip_unless_handoff(store)
    holder, dead, alive = token(), token(), token()
    dead_id, alive_id = store.waiter_id(True), store.waiter_id(False)
    subscription = listen(store, "dead", dead_id)  # received, never read: it died just then
    assert store.acquire(req("fair", "dead", holder)).acquired
    assert not store.acquire(AcquireRequest("fair", ("dead",), dead, 0.05, dead_id)).acquired
    assert not store.acquire(req("fair", "dead", alive, waiter=alive_id)).acquired
    assert store.release("dead", holder, "fair") == ReleaseResult.RELEASED
    for _ in range(400):
        later = store.acquire(req("fair", "dead", alive, waiter=alive_id))
        if later.acquired:
            break
        threading.Event().wait(0.01)  # polling: nothing announces a lease's end
    assert later.acquired
    assert not store.reenter("dead", dead, "fair")
    store.notifier().unsubscribe(subscription)  # type: ignore[union-attr]


def test_fair_release_grants_nobody_it_cannot_tell(store: Store) -> None:
    """A first waiter nobody receives the wake-up for (its process died with its connection,
    or it is still subscribing) is not made the owner: the lock stays free for its next
    attempt, and the waiter is skipped once its grace is over."""
    skip_unless_handoff(store)
    holder, mine, waiter = token(), token(), store.waiter_id(True)
    assert store.acquire(req("fair", "deaf", holder)).acquired
    assert not store.acquire(req("fair", "deaf", mine, waiter=waiter)).acquired
    assert store.release("deaf", holder, "fair") == ReleaseResult.RELEASED
    assert not store.reenter("deaf", mine, "fair")
    assert not store.acquire(req("fair", "deaf", token())).acquired
    assert store.acquire(req("fair", "deaf", mine, waiter=waiter)).acquired


def listen(store: Store, key: str, waiter: str) -> object:
    """A confirmed subscription to ``waiter``'s wake-ups of ``key``."""
    notifier = store.notifier()
    assert notifier is not None
    subscription = notifier.subscribe(key, 5.0, waiter)
    assert subscription.active
    return subscription


# -- ReleasesMany: a multi-key lock given back in one call --

RELEASE_MANY_KEYS = ("rm:1", "rm:2", "rm:3")


def _release_many_store(store: Store) -> ReleasesMany:
    if not isinstance(store, ReleasesMany):
        pytest.skip(f"{store!r} releases a multi-key lock key by key (no release_many)")
    if not store.capabilities & Capability.RELEASE_NOTIFY:  # pragma: no cover - every ReleasesMany store has it
        pytest.skip(f"{store!r} has no RELEASE_NOTIFY")
    return store


def test_release_many(store: Store) -> None:
    """One call gives back the set: a key stolen meanwhile answers NOT_OWNER and stays the
    thief's, the others are released, and each released key wakes its first waiter (one
    wake-up per key: the second waiter of a key is not woken)."""
    many = _release_many_store(store)
    owner, thief = token(), token()
    first = store.acquire(AcquireRequest("lock", RELEASE_MANY_KEYS, owner, LEASE))
    assert first.acquired
    notifier = store.notifier()
    assert notifier is not None
    waiters = {key: store.waiter_id(True) for key in ("rm:1", "rm:3")}
    second = store.waiter_id(True)
    subscriptions = {}
    for key, waiter in [*waiters.items(), ("rm:1:second", second)]:
        lock = key.removesuffix(":second")
        assert not store.acquire(req("lock", lock, token(), waiter=waiter)).acquired
        subscriptions[key] = notifier.subscribe(lock, 5.0, waiter)
        assert subscriptions[key].active
    _admin(store).force_release("rm:2")
    assert store.acquire(req("lock", "rm:2", thief)).acquired
    statuses = many.release_many(RELEASE_MANY_KEYS, owner)
    assert list(statuses) == [ReleaseResult.RELEASED, ReleaseResult.NOT_OWNER, ReleaseResult.RELEASED]
    assert subscriptions["rm:1"].wait(10.0)
    assert subscriptions["rm:3"].wait(10.0)
    assert not subscriptions["rm:1:second"].wait(0.3)
    for subscription in subscriptions.values():
        notifier.unsubscribe(subscription)
    assert store.reenter("rm:2", thief)
    for key, fence_before in zip(("rm:1", "rm:3"), (first.fencing_tokens[0], first.fencing_tokens[2]), strict=True):
        assert not store.reenter(key, owner)
        assert store.acquire(req("lock", key, token())).fencing_token > fence_before
    assert list(many.release_many(RELEASE_MANY_KEYS, owner)) == [ReleaseResult.NOT_OWNER] * 3


def test_release_many_async(store: Store) -> None:
    """:func:`test_release_many` on the asyncio twin."""
    _release_many_store(store)
    owner, thief = token(), token()

    async def main() -> None:
        twin = store.asyncio_twin()
        assert isinstance(twin, AsyncReleasesMany)
        try:
            first = await twin.acquire(AcquireRequest("lock", RELEASE_MANY_KEYS, owner, LEASE))
            assert first.acquired
            notifier = twin.notifier()
            assert notifier is not None
            subscriptions = []
            for key in ("rm:1", "rm:3"):
                waiter = twin.waiter_id(True)
                assert not (await twin.acquire(req("lock", key, token(), waiter=waiter))).acquired
                subscriptions.append(await notifier.subscribe(key, 5.0, waiter))
                assert subscriptions[-1].active
            _admin(store).force_release("rm:2")
            assert (await twin.acquire(req("lock", "rm:2", thief))).acquired
            statuses = await twin.release_many(RELEASE_MANY_KEYS, owner)
            assert list(statuses) == [ReleaseResult.RELEASED, ReleaseResult.NOT_OWNER, ReleaseResult.RELEASED]
            for subscription in subscriptions:
                assert await subscription.wait(10.0)
                notifier.unsubscribe(subscription)
            assert await twin.reenter("rm:2", thief)
            assert not await twin.reenter("rm:1", owner)
            assert (await twin.acquire(req("lock", "rm:3", token()))).acquired
        finally:
            await twin.aclose()

    asyncio.run(main())
