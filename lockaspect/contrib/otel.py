"""OpenTelemetry metrics and traces for a client's locks: :class:`OpenTelemetryObserver`.

Enable it with one line (``pip install 'lockaspect[otel]'``: the OpenTelemetry API only; the
SDK and its exporters are the application's choice)::

    from lockaspect.contrib.otel import OpenTelemetryObserver

    client = LockClient.from_url("redis://localhost:6379/0", observers=[OpenTelemetryObserver()])

It records the instruments of :mod:`lockaspect.contrib.prometheus` through the meter, named in
OpenTelemetry's style (see ``docs/integrations/metrics.md``):

=================================  ======================  =====================================
``lockaspect.acquires``            observable counter      template, kind, outcome
``lockaspect.wait.duration``       histogram (s)           template, kind
``lockaspect.hold.duration``       histogram (s)           template, kind
``lockaspect.held``                observable up-down      template, kind
``lockaspect.waiting``             observable up-down      template, kind
``lockaspect.renewals``            observable counter      outcome
``lockaspect.renewal.batch_size``  histogram               (none)
``lockaspect.lost``                observable counter      template, reason
``lockaspect.backend.errors``      observable counter      action
=================================  ======================  =====================================

(attribute keys are prefixed ``lockaspect.``: ``lockaspect.template``, ``lockaspect.kind``, ...).
The counters are counted in the observer and reported at each collection (observable
instruments: a synchronous SDK measurement costs about 10 microseconds, a count here a fraction
of one); only the durations are recorded as they happen. It traces each acquisition:

- a ``lockaspect.acquire`` span per acquisition, a child of the span current where the lock
  was asked for, from the first attempt (``start_time`` = now - waited) to the grant or the
  give-up, with ``lockaspect.template``, ``lockaspect.kind``, ``lockaspect.store``,
  ``lockaspect.outcome``, ``lockaspect.waited`` (seconds) and ``lockaspect.fencing_token``;
  a store failure sets its status to error and records the exception;
- a ``lockaspect.lost`` span event (with ``lockaspect.reason``) on the span that was current
  when the lock was acquired, the body's (the loss is found on the watchdog's thread, so the
  span is remembered per lease from its acquisition to its release).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from time import time_ns
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
from opentelemetry.trace import Span, Status, StatusCode, TracerProvider

from .. import __version__
from ..observe import LockEvent
from ._held import HeldLeases

__all__ = ["OpenTelemetryObserver"]

_TEMPLATE, _KIND, _OUTCOME = "lockaspect.template", "lockaspect.kind", "lockaspect.outcome"


class _Counts:
    """Counters kept here and reported by an observable instrument's callback."""

    __slots__ = ("_counts", "_keys", "_lock")

    def __init__(self, *keys: str) -> None:
        self._keys = keys
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, ...], int] = {}

    def add(self, amount: int, *labels: str) -> None:
        with self._lock:
            self._counts[labels] = self._counts.get(labels, 0) + amount

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            counts = sorted(self._counts.items())
        keys = self._keys
        return [Observation(count, dict(zip(keys, labels, strict=True))) for labels, count in counts]


class OpenTelemetryObserver:
    """Records a client's lock events as OpenTelemetry metrics and spans (see the module
    docstring).

    Args:
        tracer_provider: Where the spans go; default the global tracer provider (the one
            ``opentelemetry.trace.set_tracer_provider`` sets, also later).
        meter_provider: Where the metrics go; default the global meter provider.
        tracing: ``False``: metrics only, no span and no span event (a span costs the SDK
            some 15 to 25 microseconds per acquisition; see ``docs/integrations/metrics.md``).

    Recording is best-effort: an instrument or span that fails is logged once by the client
    and never fails a lock.
    """

    #: The events it records (it is told of no others: see :mod:`lockaspect.observe`).
    event_names = frozenset(
        {
            "acquired", "not_acquired", "acquire_failed", "waiting", "wait_ended", "released",
            "release_failed", "lost", "renewing", "renewed", "renewal_failed",
        }
    )  # fmt: skip

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        *,
        tracing: bool = True,
    ) -> None:
        self._tracer = trace.get_tracer("lockaspect", __version__, tracer_provider=tracer_provider)
        self._tracing = tracing
        meter = metrics.get_meter("lockaspect", __version__, meter_provider=meter_provider)
        self._acquires = _Counts(_TEMPLATE, _KIND, _OUTCOME)
        self._waiting = _Counts(_TEMPLATE, _KIND)
        self._renewals = _Counts(_OUTCOME)
        self._lost = _Counts(_TEMPLATE, "lockaspect.reason")
        self._errors = _Counts("lockaspect.action")
        # The held gauge is counted from the live leases at each collection (see ._held); the
        # body's span of each, for its lost event, is remembered alongside.
        self._held: HeldLeases[tuple[tuple[str, str], Span | None], tuple[str, str]] = HeldLeases(_labels_of)
        observable: list[tuple[Callable[..., Any], str, Callable[..., Iterable[Observation]], str, str]] = [
            (meter.create_observable_counter, "lockaspect.acquires", self._acquires.observe, "{acquisition}",
             "Lock acquisitions by outcome: acquired, busy, timeout, error."),
            (meter.create_observable_up_down_counter, "lockaspect.waiting", self._waiting.observe, "{caller}",
             "Callers waiting for a busy lock now."),
            (meter.create_observable_up_down_counter, "lockaspect.held", self._observe_held, "{lock}",
             "Locks this process holds now."),
            (meter.create_observable_counter, "lockaspect.renewals", self._renewals.observe, "{renewal}",
             "Lease renewals by outcome: renewed, failed."),
            (meter.create_observable_counter, "lockaspect.lost", self._lost.observe, "{lease}",
             "Leases lost, by reason: expired, not-owner, max-hold."),
            (meter.create_observable_counter, "lockaspect.backend.errors", self._errors.observe, "{error}",
             "Store failures by action: acquire, release, renew."),
        ]  # fmt: skip
        for create, name, callback, unit, description in observable:
            create(name, [callback], unit, description)
        self._wait = meter.create_histogram(
            "lockaspect.wait.duration", "s", "Seconds from an acquisition's first attempt to its outcome."
        )
        self._hold = meter.create_histogram(
            "lockaspect.hold.duration", "s", "Seconds a lock was held, to its release (or its loss)."
        )
        self._batch = meter.create_histogram(
            "lockaspect.renewal.batch_size", "{lease}", "Leases renewed per watchdog round trip."
        )
        self._attributes: dict[tuple[str, str], dict[str, str]] = {}

    def _labels(self, template: str, kind: str) -> dict[str, str]:
        found = self._attributes.get((template, kind))
        if found is None:
            found = self._attributes.setdefault((template, kind), {_TEMPLATE: template, _KIND: kind})
        return found

    def _observe_held(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(count, self._labels(*labels)) for labels, count in self._held.counts().items()]

    def _span(self, event: LockEvent, outcome: str, at: int) -> None:
        """The ``lockaspect.acquire`` span of an acquisition that ended ``at`` (ns), a child of
        the caller's current span (this runs on the caller's thread)."""
        waited = event.waited or 0.0
        attributes: dict[str, Any] = {
            _TEMPLATE: event.template,
            _KIND: event.kind,
            "lockaspect.store": event.store,
            _OUTCOME: outcome,
            "lockaspect.waited": waited,
        }
        if event.fencing_token is not None:
            attributes["lockaspect.fencing_token"] = event.fencing_token
        span = self._tracer.start_span("lockaspect.acquire", attributes=attributes, start_time=at - int(waited * 1e9))
        if event.error is not None:
            span.set_status(Status(StatusCode.ERROR, str(event.error)))
            span.record_exception(event.error, timestamp=at)
        span.end(end_time=at)

    def __call__(self, event: LockEvent) -> None:
        name = event.name
        if name == "acquired":
            template, kind = event.template, event.kind
            self._acquires.add(1, template, kind, "acquired")
            self._wait.record(event.waited or 0.0, self._labels(template, kind))
            body = None
            if self._tracing:
                self._span(event, "acquired", time_ns())
                # The body's span (current now, on the caller's thread) for a loss found later.
                current = trace.get_current_span()
                body = current if current.is_recording() else None
            if event.lease is not None:
                self._held.add(event.lease, ((template, kind), body))
        elif name == "released" or name == "release_failed" or name == "lost":
            ended = None if event.lease is None else self._held.end(event.lease)
            if ended is not None and event.held is not None:
                self._hold.record(event.held, self._labels(*ended[0]))
            if name == "lost":
                self._lost.add(1, event.template, event.reason or "")
                body = None if ended is None else ended[1]
                if body is not None and body.is_recording():
                    body.add_event("lockaspect.lost", _lost_attributes(event))
            elif name == "release_failed":
                self._errors.add(1, "release")
        elif name == "not_acquired":
            outcome = "busy" if event.reason == "busy" else "timeout"
            self._acquires.add(1, event.template, event.kind, outcome)
            self._wait.record(event.waited or 0.0, self._labels(event.template, event.kind))
            if self._tracing:
                self._span(event, outcome, time_ns())
        elif name == "waiting":
            self._waiting.add(1, event.template, event.kind)
        elif name == "wait_ended":
            self._waiting.add(-1, event.template, event.kind)
        elif name == "acquire_failed":
            self._acquires.add(1, event.template, event.kind, "error")
            self._errors.add(1, "acquire")
            if self._tracing:
                self._span(event, "error", time_ns())
        elif name == "renewing":
            self._batch.record(event.batch)
        elif name == "renewed":
            if event.number:
                self._renewals.add(event.number, "renewed")
        elif name == "renewal_failed":
            self._renewals.add(event.number, "failed")
            if event.error is not None:
                self._errors.add(1, "renew")


def _labels_of(value: tuple[tuple[str, str], Span | None]) -> tuple[str, str]:
    return value[0]


def _lost_attributes(event: LockEvent) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "lockaspect.reason": event.reason or "",
        _TEMPLATE: event.template,
        _KIND: event.kind,
    }
    if event.fencing_token is not None:
        attributes["lockaspect.fencing_token"] = event.fencing_token
    if event.held is not None:
        attributes["lockaspect.held"] = event.held
    return attributes
