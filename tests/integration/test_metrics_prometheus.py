"""PrometheusObserver on real stores (the session's Valkey and memory://), sync and asyncio: the
registry's text, scraped and parsed after a real workload, counts what happened, with the key
template as label, never the rendered key."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lockaspect import BackendError, LockClient, LockLost, LockNotAcquired, distributed_lock
from lockaspect.contrib.prometheus import PrometheusObserver
from lockaspect.observe import LockEvent
from lockaspect.testing import LockServer


class Scrape:
    """One scrape of a registry: its text and its samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.text = generate_latest(registry).decode()
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(self.text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        found = self.samples.get((name, frozenset(labels.items())))
        assert found is not None, f"no sample {name}{labels} in:\n{self.text}"
        return found


class Seen:
    """An observer that lets a test wait for an event (no sleeps)."""

    def __init__(self) -> None:
        self.events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def __call__(self, event: LockEvent) -> None:
        if event.name == "renewed" and not event.number:
            return
        self.of(event.name).set()

    def of(self, name: str) -> threading.Event:
        with self._lock:
            return self.events.setdefault(name, threading.Event())

    def wait(self, name: str) -> None:
        assert self.of(name).wait(10), f"no {name!r} event"


@pytest.fixture(params=["valkey", "memory"])
def store_url(request: pytest.FixtureRequest, lock_server: LockServer) -> str:
    return lock_server.url if request.param == "valkey" else "memory://"


def in_thread(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn`` in another thread (another context: it does not share this one's holds)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).exception(timeout=30)


LOCK = {"kind": "lock"}


def test_a_sync_workload_is_counted_by_template_and_outcome(
    store_url: str, make_client: Callable[..., LockClient]
) -> None:
    registry = CollectorRegistry()
    seen = Seen()
    client = make_client(
        url=store_url, observers=[PrometheusObserver(registry), seen], watchdog_lease=1.0, tick=0.02, delay_weight=0.5
    )

    @distributed_lock(key="order:<n>", client=client, wait=0)
    def once(n: int) -> int:
        return n

    @distributed_lock(key="order:<n>", client=client, wait=0.05)
    def patient(n: int) -> int:
        return n

    @distributed_lock(key="job:<n>", client=client, max_hold=0.3)
    def capped(n: int) -> None:
        seen.wait("lost")

    assert [once(n) for n in range(3)] == [0, 1, 2]
    with client.lock("order:1"):
        held = Scrape(registry)
        assert isinstance(in_thread(lambda: once(1)), LockNotAcquired)
        assert isinstance(in_thread(lambda: patient(1)), LockNotAcquired)
        seen.wait("renewed")  # the watchdog renewed this lease (half its 1 s lease)
    with pytest.raises(LockLost):
        capped(7)

    after = Scrape(registry)
    order = {"template": "order:<n>", **LOCK}
    assert held("lockaspect_held", template="", kind="lock") == 1
    assert after("lockaspect_held", template="", kind="lock") == 0
    assert after("lockaspect_held", **order) == 0
    assert after("lockaspect_held", template="job:<n>", kind="lock") == 0
    assert after("lockaspect_waiting", **order) == 0
    assert after("lockaspect_acquire_total", outcome="acquired", **order) == 3
    assert after("lockaspect_acquire_total", outcome="busy", **order) == 1
    assert after("lockaspect_acquire_total", outcome="timeout", **order) == 1
    assert after("lockaspect_acquire_total", outcome="acquired", template="", kind="lock") == 1
    assert after("lockaspect_wait_seconds_count", **order) == 5
    assert after("lockaspect_wait_seconds_sum", **order) >= 0.05  # the patient call's wait
    assert after("lockaspect_hold_seconds_count", **order) == 3
    assert after("lockaspect_hold_seconds_count", template="", kind="lock") == 1
    # The lost lease: counted with its reason, its hold ended once (its release comes after).
    assert after("lockaspect_lost_total", template="job:<n>", reason="max-hold") == 1
    assert after("lockaspect_hold_seconds_count", template="job:<n>", kind="lock") == 1
    assert after("lockaspect_renewals_total", outcome="renewed") >= 1
    assert after("lockaspect_renewal_batch_size_count") >= 1
    # Labels are templates: no rendered key is anywhere in the text.
    for key in ("order:0", "order:1", "job:7"):
        assert key not in after.text


def test_the_waiting_gauge_counts_a_waiter_until_it_acquires(
    store_url: str, make_client: Callable[..., LockClient]
) -> None:
    registry = CollectorRegistry()
    seen = Seen()
    client = make_client(url=store_url, observers=[PrometheusObserver(registry), seen])
    with ThreadPoolExecutor(1) as pool:
        with client.lock("queue:1"):

            def wait_for_it() -> None:
                with client.lock("queue:1", wait=30):
                    pass

            waiter = pool.submit(wait_for_it)
            seen.wait("waiting")
            assert Scrape(registry)("lockaspect_waiting", template="", kind="lock") == 1
        waiter.result(timeout=30)
    after = Scrape(registry)
    assert after("lockaspect_waiting", template="", kind="lock") == 0
    assert after("lockaspect_acquire_total", template="", kind="lock", outcome="acquired") == 2


def test_an_asyncio_workload_is_counted_and_a_cancelled_waiter_leaves_the_gauge(
    store_url: str, make_client: Callable[..., LockClient]
) -> None:
    registry = CollectorRegistry()
    seen = Seen()
    client = make_client(url=store_url, observers=[PrometheusObserver(registry), seen])

    @distributed_lock(key="cart:<n>", client=client, wait=0)
    async def once(n: int) -> int:
        return n

    @distributed_lock(key="cart:<n>", client=client, wait=0.05)
    async def patient(n: int) -> int:
        return n

    @distributed_lock(key="cart:<n>", client=client, wait=30)
    async def forever(n: int) -> int:
        return n

    async def main() -> dict[str, float]:
        assert [await once(n) for n in range(3)] == [0, 1, 2]
        held = asyncio.Event()

        async def contend(call: Callable[[int], Any]) -> BaseException | None:
            await held.wait()  # made before the lock is held: a task of its own context
            try:
                await call(1)
            except (LockNotAcquired, asyncio.CancelledError) as exc:
                return exc
            return None

        busy = asyncio.create_task(contend(once))
        late = asyncio.create_task(contend(patient))
        waiter = asyncio.create_task(contend(forever))
        async with client.lock("cart:1"):
            held.set()
            assert isinstance(await busy, LockNotAcquired)
            assert isinstance(await late, LockNotAcquired)
            await asyncio.to_thread(seen.wait, "waiting")
            during = Scrape(registry)("lockaspect_waiting", template="cart:<n>", kind="lock")
            waiter.cancel()
            assert isinstance(await waiter, asyncio.CancelledError)
        await client.aclose()
        return {"during": during}

    during = asyncio.run(main())["during"]
    after = Scrape(registry)
    cart = {"template": "cart:<n>", **LOCK}
    assert during == 1  # the caller that waits for ever (the patient one gave up before)
    assert after("lockaspect_waiting", **cart) == 0
    assert after("lockaspect_held", **cart) == 0
    assert after("lockaspect_held", template="", kind="lock") == 0
    assert after("lockaspect_acquire_total", outcome="acquired", **cart) == 3
    assert after("lockaspect_acquire_total", outcome="busy", **cart) == 1
    assert after("lockaspect_acquire_total", outcome="timeout", **cart) == 1
    assert after("lockaspect_hold_seconds_count", **cart) == 3
    assert "cart:1" not in after.text


def test_store_errors_are_counted_by_action(make_client: Callable[..., LockClient]) -> None:
    registry = CollectorRegistry()
    with LockServer() as server:
        client = make_client(url=server.url, observers=[PrometheusObserver(registry)])

        @distributed_lock(key="pay:<n>", client=client, wait=0)
        def pay(n: int) -> int:
            return n

        assert pay(1) == 1
        block = client.lock("pay:2")
        block.__enter__()
        server.stop()
        block.__exit__(None, None, None)  # the release fails: the key expires with its lease
        with pytest.raises(BackendError):
            pay(3)
    after = Scrape(registry)
    pay_labels = {"template": "pay:<n>", **LOCK}
    assert after("lockaspect_acquire_total", outcome="acquired", **pay_labels) == 1
    assert after("lockaspect_acquire_total", outcome="error", **pay_labels) == 1
    assert after("lockaspect_backend_errors_total", action="acquire") == 1
    assert after("lockaspect_backend_errors_total", action="release") == 1
    assert after("lockaspect_held", template="", kind="lock") == 0
    assert after("lockaspect_hold_seconds_count", template="", kind="lock") == 1


def test_observers_of_one_registry_share_its_metrics(make_client: Callable[..., LockClient]) -> None:
    registry = CollectorRegistry()
    first = make_client(url="memory://", observers=[PrometheusObserver(registry)])
    second = make_client(url="memory://", observers=[PrometheusObserver(registry)])
    for client in (first, second):
        with client.lock("shared:1"):
            pass
    assert Scrape(registry)("lockaspect_acquire_total", template="", kind="lock", outcome="acquired") == 2


def test_enabled_with_one_line_through_configure(lock_server: LockServer, namespace: str) -> None:
    """``configure(url=..., observers=[PrometheusObserver(registry)])``: the default client the
    decorators use reports to the registry."""
    from lockaspect import configure

    registry = CollectorRegistry()
    client = configure(url=lock_server.url, observers=[PrometheusObserver(registry)])
    assert client is not None

    @distributed_lock(key=namespace + "report:<account>")
    def report(account: int) -> int:
        return account

    assert report(1) == 1
    scrape = Scrape(registry)
    template = namespace + "report:<account>"
    assert scrape("lockaspect_acquire_total", template=template, kind="lock", outcome="acquired") == 1
    assert "report:1" not in scrape.text.replace(template, "")  # the rendered key is never a label
