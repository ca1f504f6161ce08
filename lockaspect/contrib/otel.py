"""OpenTelemetry metrics and traces for a client's locks: :class:`OpenTelemetryObserver`.

Enable it with one line (``pip install 'lockaspect[otel]'``: the OpenTelemetry API only; the
SDK and its exporters are the application's choice)::

    from lockaspect.contrib.otel import OpenTelemetryObserver

    client = LockClient.from_url("redis://localhost:6379/0", observers=[OpenTelemetryObserver()])

It records the instruments of :mod:`lockaspect.contrib.prometheus` through the meter, named in
OpenTelemetry's style (see ``docs/integrations/metrics.md``):

=================================  ======================  =====================================
``lockaspect.acquires``            counter                 template, kind, outcome
``lockaspect.wait.duration``       histogram (s)           template, kind
``lockaspect.hold.duration``       histogram (s)           template, kind
``lockaspect.held``                observable up-down      template, kind
``lockaspect.waiting``             up-down counter         template, kind
``lockaspect.renewals``            counter                 outcome
``lockaspect.renewal.batch_size``  histogram               (none)
``lockaspect.lost``                counter                 template, reason
``lockaspect.backend.errors``      counter                 action
=================================  ======================  =====================================

(attribute keys are prefixed ``lockaspect.``: ``lockaspect.template``, ``lockaspect.kind``, ...)
and traces each acquisition:

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

from collections.abc import Iterable
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


class OpenTelemetryObserver:
    """Records a client's lock events as OpenTelemetry metrics and spans (see the module
    docstring).

    Args:
        tracer_provider: Where the spans go; default the global tracer provider (the one
            ``opentelemetry.trace.set_tracer_provider`` sets, also later).
        meter_provider: Where the metrics go; default the global meter provider.

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
        self, tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None
    ) -> None:
        self._tracer = trace.get_tracer("lockaspect", __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter("lockaspect", __version__, meter_provider=meter_provider)
        self._acquires = meter.create_counter(
            "lockaspect.acquires", "{acquisition}", "Lock acquisitions by outcome: acquired, busy, timeout, error."
        )
        self._wait = meter.create_histogram(
            "lockaspect.wait.duration", "s", "Seconds from an acquisition's first attempt to its outcome."
        )
        self._hold = meter.create_histogram(
            "lockaspect.hold.duration", "s", "Seconds a lock was held, to its release (or its loss)."
        )
        self._waiting = meter.create_up_down_counter(
            "lockaspect.waiting", "{caller}", "Callers waiting for a busy lock now."
        )
        self._renewals = meter.create_counter(
            "lockaspect.renewals", "{renewal}", "Lease renewals by outcome: renewed, failed."
        )
        self._batch = meter.create_histogram(
            "lockaspect.renewal.batch_size", "{lease}", "Leases renewed per watchdog round trip."
        )
        self._lost = meter.create_counter("lockaspect.lost", "{lease}", "Leases lost, by reason.")
        self._errors = meter.create_counter(
            "lockaspect.backend.errors", "{error}", "Store failures by action: acquire, release, renew."
        )
        # The held gauge is counted from the live leases at each collection (see ._held); the
        # body's span of each, for its lost event, is remembered alongside.
        self._held: HeldLeases[tuple[tuple[str, str], Span | None], tuple[str, str]] = HeldLeases(_labels_of)
        meter.create_observable_up_down_counter(
            "lockaspect.held", [self._observe_held], "{lock}", "Locks this process holds now."
        )
        self._attributes: dict[tuple[str, ...], dict[str, str]] = {}

    def _labels(self, template: str, kind: str, outcome: str | None = None) -> dict[str, str]:
        key = (template, kind) if outcome is None else (template, kind, outcome)
        found = self._attributes.get(key)
        if found is None:
            found = {_TEMPLATE: template, _KIND: kind}
            if outcome is not None:
                found[_OUTCOME] = outcome
            found = self._attributes.setdefault(key, found)
        return found

    def _observe_held(self, options: CallbackOptions) -> Iterable[Observation]:
        counts = self._held.counts()
        return [Observation(count, self._labels(*labels)) for labels, count in counts.items()]

    def _span(self, event: LockEvent, outcome: str) -> None:
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
        span = self._tracer.start_span(
            "lockaspect.acquire", attributes=attributes, start_time=time_ns() - int(waited * 1e9)
        )
        if event.error is not None:
            span.set_status(Status(StatusCode.ERROR, str(event.error)))
            span.record_exception(event.error)
        span.end()

    def __call__(self, event: LockEvent) -> None:
        name = event.name
        if name == "acquired":
            labels = self._labels(event.template, event.kind)
            self._acquires.add(1, self._labels(event.template, event.kind, "acquired"))
            self._wait.record(event.waited or 0.0, labels)
            self._span(event, "acquired")
            if event.lease is not None:
                current = trace.get_current_span()
                self._held.add(event.lease, ((event.template, event.kind), current if current.is_recording() else None))
        elif name == "released" or name == "release_failed" or name == "lost":
            ended = None if event.lease is None else self._held.end(event.lease)
            if ended is not None and event.held is not None:
                self._hold.record(event.held, self._labels(*ended[0]))
            if name == "lost":
                self._lost.add(1, {_TEMPLATE: event.template, "lockaspect.reason": event.reason or ""})
                body = None if ended is None else ended[1]
                if body is not None and body.is_recording():
                    body.add_event("lockaspect.lost", _lost_attributes(event))
            elif name == "release_failed":
                self._errors.add(1, {"lockaspect.action": "release"})
        elif name == "not_acquired":
            outcome = "busy" if event.reason == "busy" else "timeout"
            self._acquires.add(1, self._labels(event.template, event.kind, outcome))
            self._wait.record(event.waited or 0.0, self._labels(event.template, event.kind))
            self._span(event, outcome)
        elif name == "waiting":
            self._waiting.add(1, self._labels(event.template, event.kind))
        elif name == "wait_ended":
            self._waiting.add(-1, self._labels(event.template, event.kind))
        elif name == "acquire_failed":
            self._acquires.add(1, self._labels(event.template, event.kind, "error"))
            self._errors.add(1, {"lockaspect.action": "acquire"})
            self._span(event, "error")
        elif name == "renewing":
            self._batch.record(event.batch)
        elif name == "renewed":
            if event.number:
                self._renewals.add(event.number, {_OUTCOME: "renewed"})
        elif name == "renewal_failed":
            self._renewals.add(event.number, {_OUTCOME: "failed"})
            if event.error is not None:
                self._errors.add(1, {"lockaspect.action": "renew"})


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
