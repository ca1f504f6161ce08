"""The doctor's decisions, as pure functions of the facts gathered (no I/O): each returns a
:class:`Check` with its verdict, and :func:`exit_status` turns them into ``lockaspect
doctor``'s exit status.

A fact doctor could not gather is ``None`` with the reason in an ``*_unknown`` field; a check
built from an unknown fact is never ``ok``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "ERROR",
    "INFO",
    "OK",
    "WARN",
    "Check",
    "clock_check",
    "eviction_check",
    "exit_status",
    "latency_check",
    "persistence_check",
    "replicas_check",
    "version_check",
]

OK = "ok"
WARN = "warn"
ERROR = "error"
INFO = "info"

#: The oldest Redis the scripts run on (LPOS, the effects replication of scripts).
MIN_REDIS = (6, 2)
#: Sharded pub/sub (SPUBLISH), the Cluster store's wake-ups.
SHARDED_PUBSUB = (7, 0)
#: A clock further off than this is reported.
CLOCK_TOLERANCE = 1.0


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, the verdict, and why."""

    name: str
    verdict: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"check": self.name, "verdict": self.verdict, "detail": self.detail}


def exit_status(checks: Iterable[Check]) -> int:
    """2 when any check is an error, 1 when any is a warning, else 0 (info lines count for
    nothing)."""
    verdicts = {check.verdict for check in checks}
    if ERROR in verdicts:
        return 2
    if WARN in verdicts:
        return 1
    return 0


def parse_version(text: str) -> tuple[int, ...]:
    """``"7.2.4"`` -> ``(7, 2, 4)`` (what is not a number ends it)."""
    parts: list[int] = []
    for part in text.split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if not digits:
            break
        parts.append(int(part[:digits]))
        if digits < len(part):
            break
    return tuple(parts)


def version_check(server: str, version: str | None, compatible: str | None, unknown: str = "") -> Check:
    """``server`` (``redis`` or ``valkey``) at ``version``; ``compatible``: the Redis version a
    Valkey reports (``redis_version``)."""
    if version is None:
        return Check("version", WARN, f"not read ({unknown or 'no answer'})")
    if server == "valkey":
        also = f" (Redis {compatible} compatible)" if compatible else ""
        return Check("version", OK, f"Valkey {version}{also}")
    if parse_version(version) < MIN_REDIS:
        needed = ".".join(map(str, MIN_REDIS))
        return Check("version", ERROR, f"Redis {version}: lockaspect needs Redis {needed} or newer (LPOS in scripts)")
    return Check("version", OK, f"Redis {version}")


def sharded_pubsub_check(version: str | None, server: str, cluster: bool, answered: bool | None, why: str) -> Check:
    """SPUBLISH: needed by the Cluster store's wake-ups; information elsewhere."""
    if not cluster:
        if version is None:
            return Check("sharded pub/sub", INFO, "not checked (version unknown); used by Cluster stores only")
        has = server == "valkey" or parse_version(version) >= SHARDED_PUBSUB
        text = "available" if has else "not available (Redis < 7.0)"
        return Check("sharded pub/sub", INFO, f"SPUBLISH {text}; used by Cluster stores only")
    if answered:
        return Check("sharded pub/sub", OK, "SPUBLISH answered: release wake-ups go to the slot's own primary")
    return Check(
        "sharded pub/sub", WARN, f"SPUBLISH failed ({why}): waiters cannot be woken, they poll (Redis 7.0+ needed)"
    )


def eviction_check(policy: str | None, maxmemory: int | None, unknown: str = "") -> Check:
    """``maxmemory-policy``: only ``noeviction`` can never evict a held lock."""
    if policy is None:
        return Check("maxmemory-policy", WARN, f"not read ({unknown}); it must be noeviction")
    limit = "no maxmemory set yet" if not maxmemory else f"maxmemory {maxmemory} bytes"
    if policy == "noeviction":
        return Check("maxmemory-policy", OK, f"noeviction ({limit}): a full server refuses writes, never evicts")
    if policy.startswith("allkeys-"):
        why = "can evict a held lock (another client then takes it) and its fencing counter"
    elif policy.startswith("volatile-"):
        why = "can evict held locks (lock keys have a TTL)"
    else:
        why = "evicts keys"
    return Check("maxmemory-policy", WARN, f"{policy} ({limit}) {why}: set maxmemory-policy noeviction")


def persistence_check(aof: bool | None, fsync: str | None, save: str | None, unknown: str = "") -> Check:
    """AOF, RDB save points, or neither (a restart frees every lock)."""
    if aof:
        if fsync == "always":
            return Check("persistence", OK, "AOF, appendfsync always")
        policy = f"appendfsync {fsync}" if fsync else "appendfsync not read"
        return Check("persistence", OK, f"AOF ({policy}): a crash can lose the last second of locks")
    if aof is None:
        return Check("persistence", WARN, f"not read ({unknown}): without AOF or RDB a restart frees every lock")
    if save is None:
        return Check("persistence", WARN, f"AOF off, RDB save points not read ({unknown})")
    if save.strip():
        return Check(
            "persistence",
            WARN,
            f"RDB only (save {save.strip()}): a restart brings back locks and fencing counters as of the last "
            "snapshot: tokens issued since can be issued again; enable AOF (appendonly yes)",
        )
    return Check(
        "persistence",
        WARN,
        "none (no AOF, no RDB save points): a restart frees every lock and re-seeds fencing counters from the clock",
    )


def replicas_check(role: str | None, connected: int | None, wanted: int | None, unknown: str = "") -> Check:
    """The server's role and replicas; ``wanted``: ``wait_replicas`` the clients use."""
    if role is None:
        verdict = WARN if wanted else INFO
        return Check("replicas", verdict, f"not read ({unknown})")
    if role in ("slave", "replica"):
        return Check(
            "replicas", ERROR, "this server is a replica: locks cannot be written here (connect to the master)"
        )
    if connected is None:
        return Check("replicas", WARN if wanted else INFO, f"role {role}; replicas not read ({unknown})")
    if wanted:
        if connected >= wanted:
            return Check("replicas", OK, f"{connected} connected, wait_replicas={wanted} can be met")
        return Check("replicas", ERROR, f"{connected} connected: wait_replicas={wanted} will fail (NotReplicated)")
    if connected == 0:
        return Check("replicas", INFO, "none: one server, no failover (wait_replicas cannot be used)")
    return Check(
        "replicas",
        INFO,
        f"{connected} connected: a failover can lose locks taken just before it (wait_replicas narrows it)",
    )


def latency_check(samples: Sequence[float], what: str = "PING") -> Check:
    """The median round trip in milliseconds (information: every acquisition and renewal
    costs one)."""
    if not samples:
        return Check("latency", INFO, f"not measured ({what} refused)")
    median = statistics.median(samples) * 1000
    return Check("latency", INFO, f"median {median:.2f} ms over {len(samples)} {what}s")


def clock_check(offset: float | None, unknown: str = "", judged_by_server: bool = True) -> Check:
    """The server's clock minus this host's (the midpoint of the round trip)."""
    if offset is None:
        return Check("clock", INFO, f"not checked ({unknown})")
    leases = "leases are timed by the server's clock, not this one; " if judged_by_server else ""
    text = f"server clock {round(offset, 3) + 0.0:+.3f} s from this host's"
    if abs(offset) > CLOCK_TOLERANCE:
        return Check("clock", WARN, f"{text}: {leases}owner records' times (acquired_at) are off by as much")
    return Check("clock", OK, text)
