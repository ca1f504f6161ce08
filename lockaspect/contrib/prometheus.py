"""Prometheus metrics for a client's locks: :class:`PrometheusObserver`.

Enable it with one line (``pip install 'lockaspect[prometheus]'``)::

    from lockaspect.contrib.prometheus import PrometheusObserver

    client = LockClient.from_url("redis://localhost:6379/0", observers=[PrometheusObserver()])

and expose the registry the usual way (``prometheus_client.start_http_server(8000)``, or your
framework's ``/metrics`` route). The metrics (see ``docs/integrations/metrics.md``):

==========================================  =========  ==================================
``lockaspect_acquire_total``                counter    template, kind, outcome
``lockaspect_wait_seconds``                 histogram  template, kind
``lockaspect_hold_seconds``                 histogram  template, kind
``lockaspect_held``                         gauge      template, kind
``lockaspect_waiting``                      gauge      template, kind
``lockaspect_renewals_total``               counter    outcome
``lockaspect_renewal_batch_size``           histogram
``lockaspect_lost_total``                   counter    template, reason
``lockaspect_backend_errors_total``         counter    action
==========================================  =========  ==================================

``template`` is the decorated call's key template (``"order:<user.id>"``), never the rendered
key, so the number of series stays bounded; it is ``""`` for ``client.lock("order:42")`` and the
other calls given a rendered key. ``outcome`` of an acquisition: ``acquired``, ``busy`` (not
acquired by a single try, ``wait=0``), ``timeout`` (not acquired after waiting) or ``error``
(the store failed). Observers of one registry share its metrics: making a second observer
for the same registry (another client) is fine.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from ..observe import LockEvent
from ._held import HeldLeases

__all__ = ["BATCH_BUCKETS", "HOLD_BUCKETS", "WAIT_BUCKETS", "PrometheusObserver"]

#: The buckets of ``lockaspect_wait_seconds``: an uncontended acquisition is a round trip (a
#: millisecond or less); a contended one lasts up to its ``wait``.
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: The buckets of ``lockaspect_hold_seconds``: from a quick critical section to a long job.
HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
#: The buckets of ``lockaspect_renewal_batch_size`` (leases per renewal round trip).
BATCH_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)

_LOCK_LABELS = ("template", "kind")
_metrics_lock = threading.Lock()
_metrics: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = weakref.WeakKeyDictionary()


class _HeldCollector:
    """``lockaspect_held``, counted at each scrape from the leases live then (see
    :mod:`._held`): a lease whose holder vanished leaves it without an event."""

    def __init__(self, held: HeldLeases[_Lock, tuple[str, str]]) -> None:
        self.held = held

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily("lockaspect_held", _HELD_DOC, labels=_LOCK_LABELS)]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("lockaspect_held", _HELD_DOC, labels=_LOCK_LABELS)
        for labels, count in self.held.counts().items():
            family.add_metric(labels, count)
        yield family


class _Lock:
    """The labelled children of one (template, kind): one lookup per event finds them all."""

    __slots__ = ("acquired", "busy", "error", "hold", "labels", "timeout", "wait", "waiting")

    def __init__(self, m: _Metrics, template: str, kind: str) -> None:
        self.labels = (template, kind)
        self.acquired = m.acquire.labels(template, kind, "acquired")
        self.busy = m.acquire.labels(template, kind, "busy")
        self.timeout = m.acquire.labels(template, kind, "timeout")
        self.error = m.acquire.labels(template, kind, "error")
        self.wait = m.wait.labels(template, kind)
        self.hold = m.hold.labels(template, kind)
        self.waiting = m.waiting.labels(template, kind)


def _labels_of(lock: _Lock) -> tuple[str, str]:
    return lock.labels


_HELD_DOC = "Locks this process holds now (acquired, not yet released or lost)."


class _Metrics:
    """One registry's metrics (made once per registry, shared by its observers), with the
    labelled children cached: ``labels()`` costs a lock and a lookup per call."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.acquire = Counter(
            "lockaspect_acquire_total",
            "Lock acquisitions by outcome: acquired, busy (a single try found it held), timeout "
            "(not acquired after waiting), error (the store failed).",
            (*_LOCK_LABELS, "outcome"),
            registry=registry,
        )
        self.wait = Histogram(
            "lockaspect_wait_seconds",
            "Seconds from an acquisition's first attempt to its outcome (acquired, busy or timeout).",
            _LOCK_LABELS,
            registry=registry,
            buckets=WAIT_BUCKETS,
        )
        self.hold = Histogram(
            "lockaspect_hold_seconds",
            "Seconds a lock was held, from its acquisition to its release (or its loss).",
            _LOCK_LABELS,
            registry=registry,
            buckets=HOLD_BUCKETS,
        )
        self.waiting = Gauge(
            "lockaspect_waiting", "Callers waiting for a busy lock now.", _LOCK_LABELS, registry=registry
        )
        self.renewals = Counter(
            "lockaspect_renewals_total", "Lease renewals by outcome: renewed, failed.", ("outcome",), registry=registry
        )
        self.batch = Histogram(
            "lockaspect_renewal_batch_size",
            "Leases renewed per watchdog round trip.",
            registry=registry,
            buckets=BATCH_BUCKETS,
        )
        self.lost = Counter(
            "lockaspect_lost_total",
            "Leases lost, by reason: expired, not-owner, max-hold.",
            ("template", "reason"),
            registry=registry,
        )
        self.errors = Counter(
            "lockaspect_backend_errors_total",
            "Store failures by action: acquire, release, renew.",
            ("action",),
            registry=registry,
        )
        self.held: HeldLeases[_Lock, tuple[str, str]] = HeldLeases(_labels_of)
        registry.register(_HeldCollector(self.held))
        self.locks: dict[tuple[str, str], _Lock] = {}
        self.children: dict[tuple[Any, ...], Any] = {}

    def lock(self, template: str, kind: str) -> _Lock:
        found = self.locks.get((template, kind))
        if found is None:
            found = self.locks.setdefault((template, kind), _Lock(self, template, kind))
        return found

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        found = self.children.get(key)
        if found is None:
            found = self.children.setdefault(key, metric.labels(*labels))
        return found


def _metrics_of(registry: CollectorRegistry) -> _Metrics:
    with _metrics_lock:
        found = _metrics.get(registry)
        if found is None:
            found = _metrics[registry] = _Metrics(registry)
        return found


class PrometheusObserver:
    """Records a client's lock events as Prometheus metrics (see the module docstring).

    Args:
        registry: The ``prometheus_client`` registry to register the metrics in; default the
            global ``REGISTRY`` (what ``start_http_server`` and ``generate_latest()`` serve).

    Recording is best-effort: a metric that cannot be recorded is logged once by the client
    and never fails a lock.
    """

    __slots__ = ("_m",)

    #: The events it records (it is told of no others: see :mod:`lockaspect.observe`).
    event_names = frozenset(
        {
            "acquired", "not_acquired", "acquire_failed", "waiting", "wait_ended", "released",
            "release_failed", "lost", "renewing", "renewed", "renewal_failed",
        }
    )  # fmt: skip

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._m = _metrics_of(REGISTRY if registry is None else registry)

    def __call__(self, event: LockEvent) -> None:
        m = self._m
        name = event.name
        if name == "acquired":
            lock = m.lock(event.template, event.kind)
            lock.acquired.inc()
            lock.wait.observe(event.waited or 0.0)
            if event.lease is not None:
                m.held.add(event.lease, lock)
        elif name == "released" or name == "release_failed" or name == "lost":
            ended = None if event.lease is None else m.held.end(event.lease)
            if ended is not None and event.held is not None:
                ended.hold.observe(event.held)
            if name == "lost":
                m.child(m.lost, event.template, event.reason or "").inc()
            elif name == "release_failed":
                m.child(m.errors, "release").inc()
        elif name == "not_acquired":
            lock = m.lock(event.template, event.kind)
            (lock.busy if event.reason == "busy" else lock.timeout).inc()
            lock.wait.observe(event.waited or 0.0)
        elif name == "waiting":
            m.lock(event.template, event.kind).waiting.inc()
        elif name == "wait_ended":
            m.lock(event.template, event.kind).waiting.dec()
        elif name == "acquire_failed":
            m.lock(event.template, event.kind).error.inc()
            m.child(m.errors, "acquire").inc()
        elif name == "renewing":
            m.batch.observe(event.batch)
        elif name == "renewed":
            if event.number:
                m.child(m.renewals, "renewed").inc(event.number)
        elif name == "renewal_failed":
            m.child(m.renewals, "failed").inc(event.number)
            if event.error is not None:
                m.child(m.errors, "renew").inc()
