"""What the metrics and tracing observers cost: the uncontended lock cycle with no observer,
with :class:`~lockaspect.contrib.prometheus.PrometheusObserver`, with
:class:`~lockaspect.contrib.otel.OpenTelemetryObserver` (metrics only, then metrics and spans;
the OpenTelemetry SDK's providers: a batch span processor and a metric reader, exporting
nowhere), and with both (Prometheus and OpenTelemetry with spans), side by side in one run
(issue 14; target: both observers on cost at most 10 % of the cycle).

Three tables: the cycle on the embedded Valkey (what an application sees: the observers' cost
against a round trip each way), the cycle on ``memory://`` (no I/O), each as wall time and as
the process's CPU time per cycle (all its threads), and the observers alone: the two events of
one cycle (``acquired``, ``released``) replayed into each, the number that stays put on a busy
machine. Each variant is a ``@distributed_lock`` function (a key template, as the observers
label it) and runs interleaved with the others, ``--repeats`` times.

Run ``.venv/bin/python bench/bench_observers.py`` (``--quick`` to check the script; it needs the
``bench`` extra: ``pip install -e '.[bench]'``). It starts (and stops) its own server unless
``--url`` is given. Not a test: pytest only collects ``tests/``.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import _util
from _util import heading, median, out, spread, table
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

from lockaspect import LockClient, distributed_lock
from lockaspect.contrib.otel import OpenTelemetryObserver
from lockaspect.contrib.prometheus import PrometheusObserver

TARGET_OVERHEAD = 0.10  # both observers: the Valkey cycle at most 10 % slower


class Discard(SpanExporter):
    """Exports nowhere: the SDK's span work is measured, not an exporter's I/O."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def otel_observer(tracing: bool = True) -> tuple[OpenTelemetryObserver, Callable[[], None]]:
    tracer_provider = TracerProvider()
    # A queue deep enough for a run's spans: a full one drops spans, which would flatter it.
    tracer_provider.add_span_processor(BatchSpanProcessor(Discard(), max_queue_size=1 << 20))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])

    def shutdown() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown()

    return OpenTelemetryObserver(tracer_provider, meter_provider, tracing=tracing), shutdown


VARIANTS = ("no observer", "Prometheus", "OTel metrics", "OTel metrics+spans", "both")


def make_cycle(url: str, variant: str, namespace: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A function running ``n`` lock cycles of ``variant``'s client, and how to close it."""
    observers: list[Any] = []
    shutdowns: list[Callable[[], None]] = []
    if variant in ("Prometheus", "both"):
        observers.append(PrometheusObserver(CollectorRegistry()))
    if variant.startswith("OTel") or variant == "both":
        observer, shutdown = otel_observer(tracing=variant != "OTel metrics")
        observers.append(observer)
        shutdowns.append(shutdown)
    client = LockClient.from_url(url, observers=observers, namespace=namespace)

    @distributed_lock(key="bench:<n>", client=client, lease=10)
    def locked(n: int) -> None:
        pass

    def run(cycles: int) -> None:
        for _ in range(cycles):
            locked(1)

    def close() -> None:
        client.close()
        for shutdown in shutdowns:
            shutdown()

    return run, close


Runs = dict[str, tuple[list[float], list[float]]]


def measure(url: str, cycles: int, warmup: int, repeats: int, label: str) -> Runs:
    """Wall and CPU microseconds per cycle of each variant, ``repeats`` interleaved runs."""
    runs = {variant: make_cycle(url, variant, f"bench-observers-{label}-{i}:") for i, variant in enumerate(VARIANTS)}
    results: Runs = {variant: ([], []) for variant in VARIANTS}
    try:
        for run, _ in runs.values():
            run(warmup)
        for _ in range(repeats):
            for variant, (run, _) in runs.items():
                gc.collect()
                start, cpu = time.perf_counter(), time.process_time()
                run(cycles)
                wall, used = results[variant]
                wall.append((time.perf_counter() - start) / cycles * 1e6)
                used.append((time.process_time() - cpu) / cycles * 1e6)
    finally:
        for _, close in runs.values():
            close()
    return results


def report(title: str, results: Runs) -> tuple[float, float]:
    """Print the table; return the bare cycle's wall and CPU microseconds."""
    base = median(results["no observer"][0])
    base_cpu = median(results["no observer"][1])
    rows = []
    for variant in VARIANTS:
        wall, used = results[variant]
        us, cpu = median(wall), median(used)
        rows.append(
            [
                variant,
                us,
                f"{spread(wall):.0%}",
                f"{us - base:+.1f}",
                f"{us / base:.3f}x",
                cpu,
                f"{cpu - base_cpu:+.1f}",
            ]
        )
    out(heading(title))
    out(table(["variant", "wall us", "spread", "wall vs none", "ratio", "CPU us", "CPU vs none"], rows))
    return base, base_cpu


def replayed(repeats: int, calls: int) -> dict[str, float]:
    """Microseconds each observer spends on one cycle's two events, replayed (the events of a
    real cycle, with their lease), the best of ``repeats`` runs."""
    events: list[Any] = []

    def keep(event: Any) -> None:
        events.append(event)

    keep.event_names = frozenset({"acquired", "released"})  # type: ignore[attr-defined]
    client = LockClient.from_url("memory://", observers=[keep])

    @distributed_lock(key="bench:<n>", client=client, lease=10)
    def locked(n: int) -> None:
        pass

    locked(1)
    client.close()
    acquired, released = events
    costs: dict[str, float] = {}
    shutdowns: list[Callable[[], None]] = []
    observers: dict[str, Any] = {"Prometheus": PrometheusObserver(CollectorRegistry())}
    for name, tracing in (("OTel metrics", False), ("OTel metrics+spans", True)):
        observers[name], shutdown = otel_observer(tracing)
        shutdowns.append(shutdown)
    for name, observer in observers.items():
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                observer(acquired)
                observer(released)
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        costs[name] = best
    costs["both"] = costs["Prometheus"] + costs["OTel metrics+spans"]
    for shutdown in shutdowns:
        shutdown()
    return costs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running Redis/Valkey server instead of starting one")
    p.add_argument("--cycles", type=int, help="timed cycles per run (default 10000; quick 1000)")
    p.add_argument("--repeats", type=int, help="interleaved runs per variant (default 7; quick 3)")
    p.add_argument("--quick", action="store_true", help="short runs, to check the script")
    args = p.parse_args(argv)
    cycles = args.cycles or (1000 if args.quick else 10000)
    repeats = args.repeats or (3 if args.quick else 7)
    warmup = max(cycles // 10, 100)
    server = None
    try:
        if args.url:
            url = args.url
        else:
            from lockaspect.testing import LockServer

            server = LockServer().start()
            url = server.url
        facts = _util.machine_facts()
        out(heading("lockaspect observers benchmark"))
        out(f"CPU: {facts['cpu_model']}, {facts['cpu_logical']} logical; load average {facts['loadavg_start']}")
        out(
            f"Python {facts['python']}; prometheus-client {_util.version_of('prometheus-client')}, "
            f"opentelemetry-sdk {_util.version_of('opentelemetry-sdk')}; {cycles} cycles x {repeats} runs"
        )
        if args.quick:
            out("QUICK RUN: numbers are for checking the script, not for the record")
        valkey = measure(url, cycles, warmup, repeats, "v")
        base, _ = report(f"@distributed_lock cycle on Valkey ({url})", valkey)
        report("@distributed_lock cycle on memory:// (no I/O)", measure("memory://", cycles * 3, warmup, repeats, "m"))
        costs = replayed(repeats, cycles)
        out(heading("the observers alone: one cycle's two events, replayed (best run)"))
        rows = [[name, us, f"{us / base:.1%}"] for name, us in costs.items()]
        out(table(["observer", "us per cycle", "of the bare Valkey cycle"], rows))
        wall = median(valkey["both"][0]) / base - 1.0
        out(heading("target: both observers cost <= +10 % of the Valkey cycle"))
        for what, overhead in (("measured wall time", wall), ("replayed events", costs["both"] / base)):
            verdict = "MET" if overhead <= TARGET_OVERHEAD else "MISSED"
            out(f"{what}: {overhead:+.1%} (target <= +{TARGET_OVERHEAD:.0%}): {verdict}")
        out(f"load average at the end: {_util.loadavg()}")
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
