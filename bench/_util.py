"""Shared helpers for the benchmarks in this folder: one redis-py client recipe for every
library, machine and server facts, statistics and plain-text tables.

Not a test module and not part of the package: it is imported by ``bench_core.py`` from
the same folder.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lockaspect.backends.redis import DEFAULT_SOCKET_TIMEOUT

#: The options lockaspect's ``LockClient.from_url`` gives its redis-py client (see
#: ``lockaspect.backends.redis.no_retry_client``). Every client in the benchmark is built
#: with exactly these, so no library runs on a faster or slower connection setup.
SOCKET_TIMEOUT = DEFAULT_SOCKET_TIMEOUT
SOCKET_CONNECT_TIMEOUT = DEFAULT_SOCKET_TIMEOUT


def make_redis(url: str, *, max_connections: int | None = None) -> redis.Redis:
    """A redis-py client built the way lockaspect builds its own: one connection pool,
    ``socket_timeout`` and ``socket_connect_timeout`` as lockaspect's defaults, redis-py's command retries off
    (``Retry(NoBackoff(), 0)``) and ``decode_responses=False``.

    ``max_connections`` is left to redis-py (its default pool) unless given.
    """
    extra: dict[str, Any] = {} if max_connections is None else {"max_connections": max_connections}
    return redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=SOCKET_CONNECT_TIMEOUT,
        retry=Retry(backoff=NoBackoff(), retries=0),
        decode_responses=False,
        **extra,
    )


def connection_settings(client: Any) -> dict[str, Any]:
    """The connection options that matter for speed, to show that every client matches."""
    kwargs = client.connection_pool.connection_kwargs
    retry = kwargs.get("retry")
    return {
        "socket_timeout": kwargs.get("socket_timeout"),
        "socket_connect_timeout": kwargs.get("socket_connect_timeout"),
        "decode_responses": kwargs.get("decode_responses", False),
        "retries": getattr(retry, "_retries", None),
        "connection_class": client.connection_pool.connection_class.__name__,
        "max_connections": client.connection_pool.max_connections,
    }


def server_facts(client: Any) -> dict[str, str]:
    """Server kind and version from ``INFO server`` (Valkey reports both names)."""
    info = client.info("server")
    kind = str(info.get("server_name") or ("valkey" if "valkey_version" in info else "redis"))
    version = str(info.get("valkey_version") or info.get("redis_version") or "?")
    return {"kind": kind, "version": version, "mode": str(info.get("redis_mode", "?"))}


def server_cpu(client: Any) -> float | None:
    """The server process's CPU seconds so far (``INFO cpu``), or ``None`` if unavailable."""
    try:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    except Exception:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def loadavg() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "?"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_facts() -> dict[str, Any]:
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except Exception:
        physical = None
    return {
        "cpu_model": cpu_model(),
        "cpu_logical": os.cpu_count(),
        "cpu_physical": physical,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "redis_py": version_of("redis"),
        "lockaspect": version_of("lockaspect"),
        "python_redis_lock": version_of("python-redis-lock"),
        "pottery": version_of("pottery"),
        "psutil": version_of("psutil"),
        "loadavg_start": loadavg(),
    }


# -- statistics ---------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> float:
    """(max - min) / median, as a fraction: how noisy the repeats were."""
    if len(values) < 2:
        return 0.0
    mid = median(values)
    return (max(values) - min(values)) / mid if mid else float("nan")


class CpuWindow:
    """Process CPU (all threads) and wall time between :meth:`start` and :meth:`stop`,
    with a per-thread breakdown by thread name where the platform exposes it."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.by_thread: dict[str, float] = {}
        self._cpu0 = 0.0
        self._wall0 = 0.0
        self._threads0: dict[int, float] = {}

    @staticmethod
    def _thread_times() -> dict[int, float]:
        try:
            import psutil

            return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
        except Exception:
            return {}

    def start(self) -> CpuWindow:
        self._threads0 = self._thread_times()
        self._wall0 = time.perf_counter()
        self._cpu0 = time.process_time()
        return self

    def stop(self) -> CpuWindow:
        self.cpu = time.process_time() - self._cpu0
        self.wall = time.perf_counter() - self._wall0
        after = self._thread_times()
        names = {t.native_id: t.name for t in threading.enumerate()}
        by_name: dict[str, float] = {}
        for tid, seconds in after.items():
            delta = seconds - self._threads0.get(tid, 0.0)
            if delta <= 0:
                continue
            name = names.get(tid, "other")
            # Collapse the peer's thousand renewal threads into one entry.
            if name not in ("MainThread", "lockaspect-timer", "lockaspect-watchdog", "lockaspect-notifier"):
                name = "other threads"
            by_name[name] = by_name.get(name, 0.0) + delta
        self.by_thread = {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}
        return self


# -- output -------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, left: int = 1) -> str:
    """A plain-text table; the first ``left`` columns are left-aligned, the rest right."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def profile_top(run: Callable[[], object], top: int, *, indent: str = "    ") -> tuple[float, str]:
    """cProfile ``run()`` in this thread: (its total own time in seconds, the ``top``
    functions by own time as text, site-packages and the checkout's paths trimmed).
    cProfile slows Python code, not the server: read the shares, not the absolute times."""
    import cProfile
    import io
    import pstats
    import re

    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    lines = [line for line in stream.getvalue().splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/"
    trimmed = (re.sub(r"/\S*/(site-packages|lib/python[0-9.]+)/", "", line).replace(root, "") for line in lines[start:])
    return float(stats.total_tt), "\n".join(indent + line for line in trimmed)  # type: ignore[attr-defined]


def heading(title: str) -> str:
    return f"\n{title}\n{'=' * len(title)}"


def out(text: str = "") -> None:
    print(text, flush=True)


def err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def lock_cycles(client: Any, key: str, lease: float | None) -> Callable[[int], None]:
    """``n`` uncontended ``with client.lock(key, lease=lease)`` cycles: lockaspect's row runner."""

    def run(n: int) -> None:
        for _ in range(n):
            with client.lock(key, lease=lease):
                pass

    return run
