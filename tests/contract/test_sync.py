"""The lock contract for threads, on every store and every kind it declares (see conftest).

No timing thresholds: events order the steps; a ``wait`` or an event timeout only bounds how
long a broken store makes a test hang before it fails.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any

import pytest

from lockaspect import ConfigurationError, KeyTemplateError, LockClient, LockLost, LockNotAcquired, current_lease
from lockaspect import distributed_lock as distributed_lock_
from lockaspect.backends.base import Store

from .conftest import ALL_KINDS, EXCLUSIVE, block, fence, force_release, skip_if_session_bound, skip_unless_served

BOUND = 20.0  # seconds: how long a broken store may hang a test


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException], list[Any]]:
    errors: list[BaseException] = []
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(target())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors, results


def try_now(client: LockClient, kind: str, key: str) -> bool:
    """Whether ``kind`` on ``key`` can be taken at once (given back at once)."""
    try:
        with block(client, kind, key, wait=0):
            return True
    except LockNotAcquired:
        return False


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_mutual_exclusion(client: LockClient, kind: str) -> None:
    """Threads contending for one key are never inside together, and every one gets in."""
    skip_unless_served(client, kind)
    inside, most, entered = [0], [0], [0]
    guard = threading.Lock()

    def worker() -> None:
        for _ in range(15):
            with block(client, kind, "mx", wait=BOUND):
                with guard:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                    entered[0] += 1
                threading.Event().wait(0.001)  # part of the workload: widens the race window
                with guard:
                    inside[0] -= 1

    runs = [in_thread(worker) for _ in range(4)]
    for thread, errors, _ in runs:
        thread.join(BOUND * 2)
        assert not errors, errors
    assert most[0] == 1
    assert entered[0] == 60


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_reentry_along_the_call_chain(client: LockClient, kind: str) -> None:
    """A nested block on the same key re-enters (same lease); another thread does not get in."""
    skip_unless_served(client, kind)
    with block(client, kind, "re") as outer:
        with block(client, kind, "re") as inner:
            assert fence(inner, "re") == fence(outer, "re")
            if kind != "multi":
                assert inner.token == outer.token
                assert current_lease() is inner
        if kind != "read":  # readers share: another thread's reader gets in
            thread, errors, results = in_thread(lambda: try_now(client, kind, "re"))
            thread.join(BOUND)
            assert not errors
            assert results == [False]
        assert not outer.lost
    assert try_now(client, kind, "re")


def test_decorated_call_reenters(client: LockClient) -> None:
    """``@distributed_lock`` on a key the caller holds re-enters instead of waiting on itself."""

    @distributed_lock_(key="dec:<n>", client=client)
    def work(n: int) -> int:
        lease = current_lease()
        assert lease is not None
        return lease.fencing_token

    with client.lock("dec:1") as lease:
        assert work(1) == lease.fencing_token


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_fencing_tokens_strictly_increase(client: LockClient, kind: str) -> None:
    """Each acquisition gets a larger fencing token than every earlier one on the key."""
    skip_unless_served(client, kind)
    tokens = []
    for _ in range(4):
        with block(client, kind, "fence") as lease:
            tokens.append(fence(lease, "fence"))
    assert tokens == sorted(set(tokens))


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_fixed_lease_expires(make_client: Callable[..., LockClient], kind: str) -> None:
    """A fixed lease ends by itself: the next caller gets the lock with a larger fencing
    token, the old holder's lease reports ``lost`` and its block raises ``LockLost``."""
    holder, other = make_client(), make_client()
    skip_unless_served(holder, kind)
    skip_if_session_bound(holder.backend, "a fixed lease does not end the hold while its session lives")
    taken, done = threading.Event(), threading.Event()
    seen: list[Any] = []

    def hold() -> None:
        with block(holder, kind, "exp", lease=0.3) as lease:
            seen.append(lease)
            taken.set()
            done.wait(BOUND)

    thread, errors, _ = in_thread(hold)
    assert taken.wait(BOUND)
    with block(other, kind, "exp", wait=BOUND) as lease:
        assert fence(lease, "exp") > fence(seen[0], "exp")
        assert seen[0].lost
        done.set()
        thread.join(BOUND)
    assert len(errors) == 1
    assert isinstance(errors[0], LockLost)


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_watchdog_keeps_the_lock_past_its_lease(make_client: Callable[..., LockClient], kind: str) -> None:
    """Renewed by the watchdog, a 0.5 s lease keeps out a caller that waits 1.5 s."""
    holder, other = make_client(), make_client()
    skip_unless_served(holder, kind)
    with block(holder, kind, "wd") as lease:
        with pytest.raises(LockNotAcquired), block(other, kind, "wd", wait=1.5):
            pass
        assert not lease.lost
    assert holder.stats().renewals >= 1


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_lost_lease_signal(client: LockClient, kind: str) -> None:
    """A hold deleted behind its holder's back: the watchdog's renewal finds it gone,
    ``lease.lost`` turns true, ``on_lost`` is called, and the block raises ``LockLost``."""
    skip_unless_served(client, kind)
    called = threading.Event()

    def hold() -> None:
        with block(client, kind, "lost", on_lost=lambda lease: called.set()) as lease:
            force_release(client.backend, "lost")
            assert called.wait(BOUND)
            assert lease.lost

    with pytest.raises(LockLost):
        hold()


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_waiter_woken_by_release(make_client: Callable[..., LockClient], kind: str) -> None:
    """A waiter gets the lock once the holder releases it (the holder's watchdog lease never
    ends by itself here), and only then."""
    holder, waiter = make_client(), make_client()
    skip_unless_served(holder, kind)
    order: list[str] = []
    started = threading.Event()

    def wait_for_it() -> None:
        started.set()
        with block(waiter, kind, "wake", wait=BOUND):
            order.append("acquired")

    with block(holder, kind, "wake"):
        thread, errors, _ = in_thread(wait_for_it)
        assert started.wait(BOUND)
        order.append("released")
    thread.join(BOUND * 2)
    assert not errors, errors
    assert order == ["released", "acquired"]


@pytest.mark.parametrize("kind", EXCLUSIVE)
def test_wait_runs_out(make_client: Callable[..., LockClient], kind: str) -> None:
    """A busy lock raises ``LockNotAcquired`` for ``wait=0`` and once a ``wait`` runs out;
    the failed callers leave nothing behind (the lock is free once the holder leaves)."""
    holder, other = make_client(), make_client()
    skip_unless_served(holder, kind)
    with block(holder, kind, "busy"):
        for wait in (0, 0.2):
            with pytest.raises(LockNotAcquired) as info, block(other, kind, "busy", wait=wait):
                pass
            assert info.value.key.startswith("busy")
    assert try_now(other, kind, "busy")


@pytest.mark.parametrize("kind", ["lock", "fair", "semaphore", "read", "write"])
def test_bad_input_reaches_no_store(
    make_client: Callable[..., LockClient], store_name: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Malformed options and keys raise their exact error before any store call."""
    client = make_client()
    calls: list[str] = []
    backend: Store = client.backend
    for name in ("acquire", "release", "reenter", "renew", "unqueue"):
        original = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, _n=name, _o=original, **k: (calls.append(_n), _o(*a, **k))[1])
    cases: list[tuple[type[BaseException], Callable[[], Any]]] = [
        (KeyTemplateError, lambda: block(client, kind, "")),
        (KeyTemplateError, lambda: block(client, kind, 5)),  # type: ignore[arg-type]
        (ConfigurationError, lambda: block(client, kind, "k", lease=-1)),
        (ConfigurationError, lambda: block(client, kind, "k", wait=-1)),
        (ConfigurationError, lambda: block(client, kind, "k", wait_strategy="sometimes")),
        (ConfigurationError, lambda: block(client, kind, "k", max_hold=0)),
    ]
    if kind == "semaphore":
        cases += [
            (ConfigurationError, lambda: client.semaphore("k", permits=0)),
            (TypeError, lambda: client.semaphore("k", permits=True)),
        ]
    if kind == "lock":
        cases += [
            (ConfigurationError, lambda: client.multi_lock([])),
            (TypeError, lambda: client.multi_lock("ab")),
            (TypeError, lambda: client.multi_lock(["a", 1])),  # type: ignore[list-item]
        ]
    for error, make in cases:
        with pytest.raises(error) as info, make():
            pass
        assert type(info.value) is error
    assert calls == []


def test_semaphore_permits(make_client: Callable[..., LockClient]) -> None:
    """Two permits: two holders at once, a third is refused; another number of permits is a
    ``ConfigurationError`` that changes nothing; ``set_permits`` and ``permits`` agree."""
    client = make_client()
    skip_unless_served(client, "semaphore")
    both = threading.Barrier(3, timeout=BOUND)
    release = threading.Event()

    def hold() -> None:
        with client.semaphore("sem", permits=2, wait=BOUND):
            both.wait()
            release.wait(BOUND)

    runs = [in_thread(hold) for _ in range(2)]
    both.wait()
    assert client.permits("sem") == (2, 2)
    with pytest.raises(LockNotAcquired), client.semaphore("sem", permits=2):
        pass
    with pytest.raises(ConfigurationError), client.semaphore("sem", permits=3):
        pass
    release.set()
    for thread, errors, _ in runs:
        thread.join(BOUND)
        assert not errors
    client.set_permits("sem", 3)
    assert client.permits("sem") == (3, 0)
    with client.semaphore("sem", permits=3):
        assert client.permits("sem") == (3, 1)


def test_readers_share_and_writers_exclude(make_client: Callable[..., LockClient]) -> None:
    """Readers hold at once; a writer keeps readers out and readers keep the writer out; a
    writer may downgrade (read inside its write block)."""
    client, other = make_client(), make_client()
    skip_unless_served(client, "read")
    both = threading.Barrier(3, timeout=BOUND)
    release = threading.Event()

    def read() -> None:
        with other.rw_lock("rw").read(wait=BOUND):
            both.wait()
            release.wait(BOUND)

    runs = [in_thread(read) for _ in range(2)]
    both.wait()
    assert not try_now(client, "write", "rw")
    release.set()
    for thread, errors, _ in runs:
        thread.join(BOUND)
        assert not errors
    with client.rw_lock("rw").write() as writing:
        assert not try_now(other, "read", "rw")
        with client.rw_lock("rw").read() as reading:
            assert reading.fencing_token > writing.fencing_token


def try_now_or_wait(client: LockClient, key: str) -> None:
    with client.rw_lock(key).write(wait=BOUND):
        pass


def test_waiting_writer_keeps_new_readers_out(make_client: Callable[..., LockClient]) -> None:
    """While a writer waits for the readers to leave, a new reader is refused."""
    client, writer, newcomer = make_client(), make_client(), make_client()
    skip_unless_served(client, "read")
    with client.rw_lock("pref").read():
        thread, errors, _ = in_thread(lambda: try_now_or_wait(writer, "pref"))
        refused = threading.Event()
        for _ in range(200):  # until the writer's first attempt registered it as waiting
            if not try_now(newcomer, "read", "pref"):
                refused.set()
                break
            refused.wait(0.02)
        assert refused.is_set()
    thread.join(BOUND)
    assert not errors


def test_multi_lock_takes_all_or_none(make_client: Callable[..., LockClient]) -> None:
    """A multi-key lock with one key busy takes none; once free it takes all, with one
    fencing token per key."""
    client, other = make_client(), make_client()
    skip_unless_served(client, "multi")
    with other.lock("m:b"):
        with pytest.raises(LockNotAcquired), client.multi_lock(["m:a", "m:b"]):
            pass
        assert try_now(other, "lock", "m:a")
    with client.multi_lock(["m:b", "m:a"]) as both:
        assert set(both.fencing_tokens) == {"m:a", "m:b"}
        assert not try_now(other, "lock", "m:a")
        with client.lock("m:a") as inner:  # re-enters one of the keys
            assert inner.fencing_token == both.fencing_tokens["m:a"]


def test_multi_lock_release_with_a_stolen_key(
    make_client: Callable[..., LockClient], store_name: str, request: pytest.FixtureRequest
) -> None:
    """A key of the set force-released and taken by another owner while the block runs: the
    block raises ``LockLost`` naming it; on leaving, the other key is released and the stolen
    one stays its new holder's."""
    client, thief, other = make_client(), make_client(), make_client()
    skip_unless_served(client, "multi")
    stolen = thief.lock("st:b", wait=BOUND)

    def steal_one() -> None:
        with client.multi_lock(["st:a", "st:b"]):
            force_release(client.backend, "st:b")
            stolen.__enter__()

    def blocks() -> None:
        try:
            with pytest.raises(LockLost) as caught:
                steal_one()
            assert caught.value.key in ("st:a", "st:b")  # a SESSION_BOUND store reports the set lost
            assert try_now(other, "lock", "st:a")
            assert not try_now(other, "lock", "st:b")
        finally:
            with contextlib.suppress(LockLost):
                stolen.__exit__(None, None, None)

    # The blocks are left out of order (the thief's, entered inside the set's, last): in a
    # context of their own, so that no held-lease stack is left behind for current_lease() in
    # the tests that follow.
    contextvars.copy_context().run(blocks)
    assert try_now(other, "lock", "st:b")


def test_multi_lock_release_wakes_a_waiter_on_each_key(make_client: Callable[..., LockClient]) -> None:
    """Leaving a multi-key block hands each key to the caller waiting for it."""
    waiting = threading.Semaphore(0)

    def observe(event: Any) -> None:
        if event.name == "waiting":
            waiting.release()

    holder, waiter = make_client(), make_client(observers=[observe])
    skip_unless_served(holder, "multi")
    got: list[str] = []

    def wait_for(key: str) -> Callable[[], None]:
        def take() -> None:
            with waiter.lock(key, wait=BOUND):
                got.append(key)

        return take

    with holder.multi_lock(["wm:a", "wm:b"]):
        started = [in_thread(wait_for(key)) for key in ("wm:a", "wm:b")]
        assert waiting.acquire(timeout=BOUND)
        assert waiting.acquire(timeout=BOUND)
        assert got == []
    for thread, errors, _ in started:
        thread.join(BOUND * 2)
        assert not errors, errors
    assert sorted(got) == ["wm:a", "wm:b"]
