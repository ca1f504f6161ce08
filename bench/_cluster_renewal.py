"""Section 2 of ``bench_cluster.py``: how many round trips the Redis Cluster store's renewals
make, counted per node at redis-py's connections, through ``store.renew`` and through the
client's watchdog. Not a test; imported by ``bench_cluster.py`` from the same folder."""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis
from _util import heading, median, out, spread, table
from bench_core import BenchError
from redis.crc import key_slot

if TYPE_CHECKING:
    from bench_cluster import Env

#: The lease of the locks held in section 2 through the store (long: only renew() renews them).
HOLD_LEASE = 120.0
#: Section 2's watchdog client: lease and delay weight (a renewal 1.6 s after each acquisition).
WD_LEASE, WD_DELAY_WEIGHT = 2.0, 0.8


# -- section 2: renewal round trips --------------------------------------------------------------


class WriteCounter:
    """Counts, per node (``host:port``), redis-py's ``send_packed_command`` calls (one write each:
    a round trip's request), the commands ``pack_commands`` packed (a pipeline's), and the writes
    that were a ``COMMAND GETKEYS``, made by a thread while it is inside :meth:`recording`."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._saved: dict[str, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[WriteCounter]:
        cls = redis.connection.Connection
        local = self._local
        send, pack, handshake = cls.send_packed_command, cls.pack_commands, cls.on_connect_check_health
        names = ("send_packed_command", "pack_commands", "on_connect_check_health")
        self._saved = {name: cls.__dict__[name] for name in names if name in cls.__dict__}

        def counted_send(conn: Any, command: Any, check_health: bool = True) -> None:
            tally = getattr(local, "tally", None)
            if tally is not None and not getattr(local, "handshake", False):
                counts = tally.setdefault(f"{conn.host}:{conn.port}", [0, 0, 0])
                counts[0] += 1
                first = command if isinstance(command, bytes | str) else next(iter(command), b"")
                counts[2] += b"GETKEYS" in (first.encode() if isinstance(first, str) else bytes(first))[:40]
                if not isinstance(command, bytes | str):  # lockaspect's own batches: script calls in the write
                    payload = b"".join(part if isinstance(part, bytes) else bytes(part) for part in command)
                    counts[1] += payload.count(b"\r\nEVALSHA\r\n") + payload.count(b"\r\nEVAL\r\n")
            send(conn, command, check_health)

        def connect(conn: Any, *args: Any, **kwargs: Any) -> Any:
            # The handshake of a new connection (HELLO, CLIENT SETINFO) is not a renewal's write.
            local.handshake = True
            try:
                return handshake(conn, *args, **kwargs)
            finally:
                local.handshake = False

        def counted_pack(conn: Any, commands: Any) -> Any:
            tally = getattr(local, "tally", None)
            commands = list(commands)
            if tally is not None:
                tally.setdefault(f"{conn.host}:{conn.port}", [0, 0, 0])[1] += len(commands)
            return pack(conn, commands)

        cls.send_packed_command, cls.pack_commands = counted_send, counted_pack  # type: ignore[method-assign]
        cls.on_connect_check_health = connect  # type: ignore[method-assign]
        try:
            yield self
        finally:
            for name in names:
                if name in self._saved:
                    setattr(cls, name, self._saved[name])
                else:
                    delattr(cls, name)

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict[str, list[int]]]:
        """``{node: [writes, commands, COMMAND GETKEYS writes]}`` of this thread inside the block."""
        self._local.tally = tally = {}
        try:
            yield tally
        finally:
            self._local.tally = None


@dataclasses.dataclass
class RenewCall:
    start: float
    wall: float
    cpu: float
    items: int
    tally: dict[str, list[int]]


def timed_renew(store: Any, counter: WriteCounter, items: Any) -> tuple[RenewCall, list[Any]]:
    """One ``store.renew(items)`` (the class's: an instance may have it wrapped), counted."""
    with counter.recording() as tally:
        start, cpu0 = time.perf_counter(), time.thread_time()
        statuses = type(store).renew(store, items)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu0
    return RenewCall(start, wall, cpu, len(items), tally), statuses


def node_rows(env: Env, calls: list[RenewCall], expected: dict[str, int] | None = None) -> list[list[object]]:
    """Per primary: the median and largest writes, the median GETKEYS writes and pipelined
    commands per call (or per tick)."""
    rows: list[list[object]] = []
    for node in env.primaries:
        writes, commands, getkeys = ([c.tally.get(node, [0, 0, 0])[i] for c in calls] for i in range(3))
        extra = [] if expected is None else [expected.get(node, 0)]
        rows.append([node, median(writes), max(writes, default=0), median(getkeys), median(commands), *extra])
    return rows


NODE_HEADERS = ["primary", "round trips/call", "max", "of which COMMAND GETKEYS", "script calls/call"]
NODE_NOTE = (
    "  round trips: writes (send_packed_command) to the node, not counting a new connection's handshake;\n"
    "  script calls: EVALSHA/EVAL in those writes (one per slot touched, at most 256 leases each).\n"
    "  COMMAND GETKEYS: what redis-py's cluster pipeline would ask once per EVALSHA before its one write\n"
    "  per node (it has no routing flag for EVALSHA); the store does not use that pipeline."
)


def worst(env: Env, calls: list[RenewCall]) -> int:
    return max((c.tally.get(node, [0, 0, 0])[0] for c in calls for node in env.primaries), default=0)


def bench_renewal(env: Env, args: argparse.Namespace, results: dict[str, Any]) -> None:
    from lockaspect import LockClient
    from lockaspect.backends.base import AcquireRequest, RenewItem
    from lockaspect.backends.redis._renewal import renew_chunks

    out(heading(f"2. Renewal round trips, {args.locks:,} locks held over every primary"))
    counter = WriteCounter()
    report: dict[str, Any] = {}
    with counter.installed(), contextlib.ExitStack() as stack:
        client = LockClient.from_url(env.url)
        stack.callback(client.close)
        store = client.backend
        keys = [f"bench-cl:held:{i}" for i in range(args.locks)]
        tokens = [secrets.token_hex(16) for _ in keys]
        t0 = time.perf_counter()
        for key, token in zip(keys, tokens, strict=True):
            if not store.acquire(AcquireRequest("lock", (key,), token, HOLD_LEASE)).acquired:
                raise BenchError(f"store.acquire: {key} busy")
        acquire_s = time.perf_counter() - t0
        items = [RenewItem(key, token, HOLD_LEASE) for key, token in zip(keys, tokens, strict=True)]
        chunks = renew_chunks(store, items)
        expected: dict[str, int] = {}
        for chunk in chunks:
            node = env.primary_of(chunk.keys[0].split("{", 1)[1].rsplit("}", 1)[0])
            expected[node] = expected.get(node, 0) + 1
        slots = len({key_slot(k.encode()) for k in keys})
        first, statuses = timed_renew(store, counter, items)
        calls, bad = [], sum(1 for s in statuses if s is not True)
        for _ in range(args.renews):
            call, statuses = timed_renew(store, counter, items)
            calls.append(call)
            bad += sum(1 for s in statuses if s is not True)
        for key, token in zip(keys, tokens, strict=True):
            store.release(key, token)
        out(
            f"store.renew([{args.locks:,} RenewItem]) on the store of LockClient.from_url(url): {args.locks:,} locks "
            f"taken with store.acquire in {acquire_s:.2f} s (lease {HOLD_LEASE:.0f} s), {slots:,} slots touched, "
            f"{len(chunks):,} script calls (renew chunks, one slot each, at most 256 leases)"
        )
        out(f"first call (scripts maybe not cached yet): {first.tally}; then {args.renews} calls, counted:")
        out(table([*NODE_HEADERS, "expected"], node_rows(env, calls, expected)))
        out(NODE_NOTE)
        wall_us = [c.wall / c.items * 1e6 for c in calls]
        cpu_us = [c.cpu / c.items * 1e6 for c in calls]
        out(
            f"  per renewal: wall {median(wall_us):.2f} us (spread {spread(wall_us) * 100:.0f}%), CPU of the calling "
            f"thread {median(cpu_us):.2f} us; per call {median([c.wall for c in calls]) * 1e3:.1f} ms; "
            f"statuses not True: {bad}"
        )
        report["store"] = {
            "locks": args.locks, "slots": slots, "script_calls": len(chunks), "expected_per_node": expected,
            "first_call": first.tally, "calls": [dataclasses.asdict(c) for c in calls], "not_renewed": bad,
            "wall_us_per_renewal": median(wall_us), "cpu_us_per_renewal": median(cpu_us),
            "max_writes_per_primary": worst(env, calls),
        }  # fmt: skip
        report["watchdog"] = watchdog_ticks(env, args, counter)
    results["renewal"] = report


def watchdog_ticks(env: Env, args: argparse.Namespace, counter: WriteCounter) -> dict[str, Any]:
    """Hold ``--locks`` ``client.lock`` blocks (each in a Context of its own, as independent
    callers) on a short watchdog lease, and count what each renewal call of the watchdog writes;
    calls less than half a tick apart are one tick (the watchdog sends more than BATCH due
    leases in several calls, back to back)."""
    from lockaspect import LockClient
    from lockaspect.errors import LockLost

    client = LockClient.from_url(env.url, watchdog_lease=WD_LEASE, delay_weight=WD_DELAY_WEIGHT)
    store = client.backend
    calls: list[RenewCall] = []

    def renew(items: Any) -> Any:
        call, statuses = timed_renew(store, counter, items)
        calls.append(call)
        return statuses

    store.renew = renew  # the watchdog calls the client's backend's renew at each round trip
    level = logging.getLogger("lockaspect").level
    logging.getLogger("lockaspect").setLevel(logging.CRITICAL)  # one line per lost lease otherwise
    blocks = [(contextvars.Context(), client.lock(f"bench-cl:wd:{i}")) for i in range(args.locks)]
    t0 = time.perf_counter()
    for ctx, block in blocks:
        ctx.run(block.__enter__)
    acquired = time.perf_counter()
    stats0 = client.stats()
    time.sleep(args.hold)
    stats1 = client.stats()
    held = [c for c in calls if c.start >= acquired]
    raised = 0
    for ctx, block in blocks:
        try:
            ctx.run(block.__exit__, None, None, None)
        except LockLost:  # the lease ended before the block did: counted in stats().lost
            raised += 1
    logging.getLogger("lockaspect").setLevel(level)
    stats = client.stats()
    client.close()
    ticks: list[RenewCall] = []
    for c in held:
        last = ticks[-1] if ticks else None
        if last is not None and c.start - (last.start + last.wall) < client.tick / 2:
            for node, counts in c.tally.items():
                mine = last.tally.setdefault(node, [0, 0, 0])
                mine[:] = [a + b for a, b in zip(mine, counts, strict=True)]
            last.items, last.wall, last.cpu = last.items + c.items, c.start + c.wall - last.start, last.cpu + c.cpu
        else:
            ticks.append(RenewCall(c.start, c.wall, c.cpu, c.items, {k: list(v) for k, v in c.tally.items()}))
    renewals = stats1.renewals - stats0.renewals
    out(
        f"\nwatchdog: LockClient.from_url(url, watchdog_lease={WD_LEASE}, delay_weight={WD_DELAY_WEIGHT}), "
        f"{args.locks:,} x client.lock(key) entered in {acquired - t0:.2f} s, then held {args.hold:g} s: "
        f"{len(held)} renewal calls in {len(ticks)} ticks, {renewals:,} renewals "
        f"({stats1.renewal_round_trips - stats0.renewal_round_trips} round trips by client.stats())"
    )
    if ticks:
        sizes = [t.items for t in ticks]
        out(f"  leases per tick: median {median(sizes):.0f}, max {max(sizes):,}; calls per tick: max "
            f"{max(sum(1 for c in held if t.start <= c.start <= t.start + t.wall) for t in ticks)}; round trips "
            f"per primary per renew call: max {worst(env, held)} (a tick: calls < tick/2 apart)")  # fmt: skip
        out(table([h.replace("/call", "/tick") for h in NODE_HEADERS], node_rows(env, ticks)))
        cpu_us = median([t.cpu / t.items * 1e6 for t in ticks])
        out(f"  per renewal: CPU of the watchdog's renew call {cpu_us:.2f} us (median over ticks)")
    problems = stats.lost + stats.renewal_failures + (renewals == 0)
    out(
        f"  check: lost={stats.lost} (LockLost raised at the exit of {raised} blocks), renewal failures="
        f"{stats.renewal_failures}, held after={stats.held}"
    )
    return {
        "calls": len(held), "ticks": len(ticks), "renewals": renewals, "lost": stats.lost,
        "renewal_failures": stats.renewal_failures, "max_writes_per_primary_per_tick": worst(env, ticks),
        "max_writes_per_primary_per_call": worst(env, held), "problems": problems,
        "leases_per_tick": [t.items for t in ticks],
    }  # fmt: skip
