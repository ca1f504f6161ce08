"""The observer hook: LockClient(observers=[...]) sees the engine's events, once per thing the
engine did, from sync and async code alike; an observer that raises never fails a lock."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import pytest

from lockaspect import LockClient, LockLost, LockNotAcquired, distributed_lock
from lockaspect.observe import LockEvent


class Recorder:
    def __init__(self) -> None:
        self.events: list[LockEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: LockEvent) -> None:
        with self._lock:
            self.events.append(event)

    def names(self, key: str | None = None) -> list[str]:
        with self._lock:
            return [e.name for e in self.events if key is None or e.key == key]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def test_a_lock_cycle_emits_acquired_reentered_and_released(
    make_client: Callable[..., LockClient], recorder: Recorder
) -> None:
    client = make_client(observers=[recorder])
    with client.lock("obs:1") as lease, client.lock("obs:1"):
        pass
    assert recorder.names("obs:1") == ["acquired", "reentered", "released"]
    acquired = recorder.events[0]
    assert (acquired.kind, acquired.fencing_token) == ("lock", lease.fencing_token)


def test_a_busy_lock_emits_waiting_and_not_acquired(make_client: Callable[..., LockClient], recorder: Recorder) -> None:
    client = make_client(observers=[recorder])
    with client.lock("obs:2"):
        holder = threading.Event()

        def other() -> None:
            with pytest.raises(LockNotAcquired):
                client.lock("obs:2", wait=0.05).__enter__()
            holder.set()

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(30)
        assert holder.is_set()
    names = recorder.names("obs:2")
    assert names.count("waiting") == 1
    assert names.count("not_acquired") == 1
    assert client.stats().not_acquired == 1


def test_async_code_emits_the_same_events(make_client: Callable[..., LockClient], recorder: Recorder) -> None:
    client = make_client(observers=[recorder])

    @distributed_lock(key="obs:3", client=client)
    async def body() -> int:
        return 1

    async def main() -> None:
        assert await body() == 1
        async with client.fair_lock("obs:4"):
            pass
        await client.aclose()

    asyncio.run(main())
    assert recorder.names("obs:3") == ["acquired", "released"]
    assert recorder.names("obs:4") == ["acquired", "released"]
    assert [e.kind for e in recorder.events if e.key == "obs:4"] == ["fair", "fair"]


def test_renewals_and_a_loss_are_observed(
    make_client: Callable[..., LockClient], recorder: Recorder, raw: object
) -> None:
    renewed, lost = threading.Event(), threading.Event()

    def on_renewed(event: LockEvent) -> None:
        if event.name == "renewed" and event.number:
            renewed.set()

    client = make_client(observers=[recorder, on_renewed], watchdog_lease=1.0, tick=0.05)
    block = client.lock("obs:5", on_lost=lambda lease: lost.set())
    block.__enter__()
    assert renewed.wait(30)
    raw.delete(client.backend.lock_key("obs:5"))  # type: ignore[attr-defined]
    assert lost.wait(30)
    with pytest.raises(LockLost):
        block.__exit__(None, None, None)
    assert "lost" in recorder.names("obs:5")
    [event] = [e for e in recorder.events if e.name == "lost"]
    assert event.reason == "not-owner"
    stats = client.stats()
    assert stats.lost == 1
    assert stats.renewals >= 1
    assert stats.renewal_round_trips >= 1


def test_an_observer_that_raises_is_logged_once_and_never_fails_a_lock(
    make_client: Callable[..., LockClient], recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: LockEvent) -> None:
        raise RuntimeError("observer bug")

    client = make_client(observers=[broken, recorder])
    with caplog.at_level(logging.ERROR, logger="lockaspect.observe"):
        for _ in range(3):
            with client.lock("obs:6"):
                pass
    assert recorder.names("obs:6") == ["acquired", "released"] * 3  # later observers still called
    errors = [r for r in caplog.records if r.name == "lockaspect.observe"]
    assert len(errors) == 1
    assert "observer bug" in (errors[0].exc_text or "")
    assert client.stats().acquired == 3


@pytest.mark.parametrize("observers", ["not a list", [1], 5])
def test_bad_observers_are_refused_at_construction(make_client: Callable[..., LockClient], observers: object) -> None:
    with pytest.raises(TypeError, match="observer"):
        make_client(observers=observers)
