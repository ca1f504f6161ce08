"""OpenTelemetryObserver on real stores (the session's Valkey and memory://), sync and asyncio,
through the OpenTelemetry SDK's in-memory span exporter and metric reader: the acquisition
spans with their attributes, the lost event on the body's span, the instruments; and an
observer that raises never fails a lock."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lockaspect import LockClient, LockLost, LockNotAcquired, distributed_lock
from lockaspect.contrib.otel import OpenTelemetryObserver
from lockaspect.observe import LockEvent
from lockaspect.testing import LockServer


class Telemetry:
    """SDK providers with in-memory exporters."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.tracer = self.tracer_provider.get_tracer("test")

    def observer(self, tracing: bool = True) -> OpenTelemetryObserver:
        return OpenTelemetryObserver(self.tracer_provider, self.meter_provider, tracing=tracing)

    def finished(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans.get_finished_spans() if span.name == name]

    def points(self, name: str) -> dict[frozenset[tuple[str, Any]], Any]:
        """The data points of instrument ``name`` by their attributes."""
        data = self.reader.get_metrics_data()
        found: dict[frozenset[tuple[str, Any]], Any] = {}
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            found[frozenset((point.attributes or {}).items())] = point
        return found

    def close(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    made = Telemetry()
    yield made
    made.close()


@pytest.fixture(params=["valkey", "memory"])
def store(request: pytest.FixtureRequest, lock_server: LockServer) -> tuple[str, str]:
    """The store's URL and its name in the spans."""
    return (lock_server.url, "redis") if request.param == "valkey" else ("memory://", "memory")


class Seen:
    def __init__(self) -> None:
        self.lost = threading.Event()
        self.waiting = threading.Event()

    def __call__(self, event: LockEvent) -> None:
        if event.name == "lost":
            self.lost.set()
        elif event.name == "waiting":
            self.waiting.set()


def labels(template: str, **more: str) -> frozenset[tuple[str, Any]]:
    return frozenset({"lockaspect.template": template, "lockaspect.kind": "lock", **more}.items())


def test_sync_acquisitions_are_spans_and_a_loss_is_an_event_on_the_body_span(
    store: tuple[str, str], make_client: Callable[..., LockClient], telemetry: Telemetry
) -> None:
    url, store_name = store
    seen = Seen()
    client = make_client(url=url, observers=[telemetry.observer(), seen])

    @distributed_lock(key="order:<n>", client=client, wait=0)
    def once(n: int) -> int:
        return n

    @distributed_lock(key="job:<n>", client=client, max_hold=0.3)
    def capped(n: int) -> None:
        assert seen.lost.wait(10)

    with telemetry.tracer.start_as_current_span("request") as request:
        assert once(1) == 1
        with client.lock("order:1"), ThreadPoolExecutor(1) as pool:
            assert isinstance(pool.submit(once, 1).exception(timeout=30), LockNotAcquired)
    with telemetry.tracer.start_as_current_span("body"), pytest.raises(LockLost):
        capped(7)

    spans = telemetry.finished("lockaspect.acquire")
    by_outcome = {(span.attributes or {})["lockaspect.outcome"]: span for span in spans}
    first = spans[0]
    assert first.parent is not None
    assert first.parent.span_id == request.get_span_context().span_id
    attributes = dict(first.attributes or {})
    assert isinstance(attributes.pop("lockaspect.fencing_token"), int)
    assert attributes == {
        "lockaspect.template": "order:<n>",
        "lockaspect.kind": "lock",
        "lockaspect.store": store_name,
        "lockaspect.outcome": "acquired",
        "lockaspect.waited": 0.0,
    }
    assert sorted(by_outcome) == ["acquired", "busy"]
    assert [(s.attributes or {})["lockaspect.template"] for s in spans] == ["order:<n>", "", "order:<n>", "job:<n>"]
    (body,) = telemetry.finished("body")
    (lost,) = [event for event in body.events if event.name == "lockaspect.lost"]
    assert (lost.attributes or {})["lockaspect.reason"] == "max-hold"
    assert (lost.attributes or {})["lockaspect.template"] == "job:<n>"

    acquires = telemetry.points("lockaspect.acquires")
    assert acquires[labels("order:<n>", **{"lockaspect.outcome": "acquired"})].value == 1
    assert acquires[labels("order:<n>", **{"lockaspect.outcome": "busy"})].value == 1
    assert acquires[labels("", **{"lockaspect.outcome": "acquired"})].value == 1
    lost_points = telemetry.points("lockaspect.lost")
    reason = frozenset({"lockaspect.template": "job:<n>", "lockaspect.reason": "max-hold"}.items())
    assert lost_points[reason].value == 1
    assert telemetry.points("lockaspect.hold.duration")[labels("order:<n>")].count == 1
    assert telemetry.points("lockaspect.wait.duration")[labels("order:<n>")].count == 2
    held = telemetry.points("lockaspect.held")
    assert {attributes: point.value for attributes, point in held.items()} == {
        labels("order:<n>"): 0,
        labels(""): 0,
        labels("job:<n>"): 0,
    }


def test_asyncio_acquisitions_are_spans_and_the_waiting_counter_returns_to_zero(
    store: tuple[str, str], make_client: Callable[..., LockClient], telemetry: Telemetry
) -> None:
    url, store_name = store
    seen = Seen()
    client = make_client(url=url, observers=[telemetry.observer(), seen])

    @distributed_lock(key="cart:<n>", client=client, wait=30)
    async def patient(n: int) -> int:
        return n

    @distributed_lock(key="job:<n>", client=client, max_hold=0.3)
    async def capped(n: int) -> None:
        await asyncio.sleep(30)  # cancelled when the lease is lost

    async def main() -> None:
        held = asyncio.Event()

        async def contend() -> int:
            await held.wait()  # made before the lock is held: a task of its own context
            return await patient(1)

        waiter = asyncio.create_task(contend())
        with telemetry.tracer.start_as_current_span("request"):
            async with client.lock("cart:1"):
                held.set()
                assert await asyncio.to_thread(seen.waiting.wait, 10)
            assert await waiter == 1
        with telemetry.tracer.start_as_current_span("body"), pytest.raises(LockLost):
            await capped(3)
        await client.aclose()

    asyncio.run(main())
    spans = telemetry.finished("lockaspect.acquire")
    assert [(s.attributes or {})["lockaspect.template"] for s in spans] == ["", "cart:<n>", "job:<n>"]
    waited = spans[1]
    assert (waited.attributes or {})["lockaspect.store"] == store_name
    assert (waited.attributes or {})["lockaspect.waited"] > 0
    assert waited.start_time is not None
    assert waited.end_time is not None
    assert waited.end_time - waited.start_time >= (waited.attributes or {})["lockaspect.waited"] * 1e9 * 0.99
    (body,) = telemetry.finished("body")
    assert [e.name for e in body.events] == ["lockaspect.lost"]
    waiting = telemetry.points("lockaspect.waiting")
    assert waiting[labels("cart:<n>")].value == 0
    held = telemetry.points("lockaspect.held")
    assert all(point.value == 0 for point in held.values())


class BrokenTracerProvider(trace.TracerProvider):
    """A tracer provider whose spans cannot be started."""

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return BrokenTracer()


class BrokenTracer(trace.NoOpTracer):
    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        raise RuntimeError("the tracer is broken")


def test_an_observer_that_raises_never_fails_a_lock_and_is_logged_once(
    make_client: Callable[..., LockClient], telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    observer = OpenTelemetryObserver(BrokenTracerProvider(), telemetry.meter_provider)
    client = make_client(url="memory://", observers=[observer])
    with caplog.at_level(logging.ERROR, logger="lockaspect.observe"):
        for _ in range(3):
            with client.lock("broken:1") as lease:
                assert lease.held
    assert client.stats().acquired == 3
    assert client.stats().released == 3
    assert len([r for r in caplog.records if "raised on acquired" in r.getMessage()]) == 1


def test_the_global_providers_are_used_when_none_are_given(make_client: Callable[..., LockClient]) -> None:
    client = make_client(url="memory://", observers=[OpenTelemetryObserver()])
    with client.lock("global:1"):
        pass
    assert client.stats().released == 1


def test_without_tracing_it_records_the_metrics_and_no_span(
    make_client: Callable[..., LockClient], telemetry: Telemetry
) -> None:
    client = make_client(url="memory://", observers=[telemetry.observer(tracing=False)])

    @distributed_lock(key="report:<day>", client=client)
    def report(day: str) -> str:
        return day

    with telemetry.tracer.start_as_current_span("request"):
        assert report("monday") == "monday"
    assert [span.name for span in telemetry.spans.get_finished_spans()] == ["request"]
    acquires = telemetry.points("lockaspect.acquires")
    assert acquires[labels("report:<day>", **{"lockaspect.outcome": "acquired"})].value == 1
    assert telemetry.points("lockaspect.hold.duration")[labels("report:<day>")].count == 1
