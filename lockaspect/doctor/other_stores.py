"""doctor for the stores that are not Redis: what applies and is cheap to check.

Every store: reachable and the round trip of its admin ``describe`` (timed), through the store
itself. Then per store: SQLite (its version, the file, WAL, the tables), PostgreSQL (version,
a standby, the clock, the privileges on lockaspect's tables and sequences), ZooKeeper (the
version and mode from ``srvr``, the negotiated session timeout).
Gathering here, decisions in the small ``*_checks`` functions (pure).
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

from .verdicts import ERROR, INFO, OK, WARN, Check, clock_check, latency_check, parse_version

__all__ = ["admin_checks", "postgres_checks", "sqlite_checks", "zookeeper_checks"]

ROUND_TRIPS = 5


def admin_checks(store: Any) -> list[Check]:
    """Reachable, and the latency of the store's ``describe`` of a key nobody holds."""
    from ..errors import LockError

    samples: list[float] = []
    for _ in range(ROUND_TRIPS):
        started = time.perf_counter()
        try:
            store.describe("doctor-probe")
        except (LockError, OSError) as exc:
            return [Check("reachable", ERROR, str(exc))]
        samples.append(time.perf_counter() - started)
    return [Check("reachable", OK, "answered describe()"), latency_check(samples, "describe")]


# -- SQLite ----------------------------------------------------------------------------------


@dataclass
class SqliteFacts:
    path: str
    version: str = sqlite3.sqlite_version
    journal: str | None = None
    tables: list[str] = field(default_factory=list)
    writable: bool = False
    error: str = ""


def sqlite_facts(path: str) -> SqliteFacts:
    facts = SqliteFacts(path)
    directory = os.path.dirname(path) or "."
    facts.writable = os.access(path, os.W_OK) and os.access(directory, os.W_OK)
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2)
        try:
            facts.journal = str(conn.execute("PRAGMA journal_mode").fetchone()[0])
            rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'lockaspect%'")
            facts.tables = sorted(name for (name,) in rows if not name.startswith("lockaspect_demo_"))
        finally:
            conn.close()
    except sqlite3.Error as exc:
        facts.error = str(exc)
    return facts


def sqlite_checks(facts: SqliteFacts) -> list[Check]:
    checks = [
        Check("version", OK, f"SQLite {facts.version} (3.35+ needed)"),
        Check("file", OK if facts.writable else ERROR, facts.path + ("" if facts.writable else ": not writable")),
    ]
    if facts.error:
        checks.append(Check("tables", ERROR, f"cannot read the file: {facts.error}"))
        return checks
    checks.append(Check("tables", OK if facts.tables else ERROR, ", ".join(facts.tables) or "none"))
    if facts.journal == "wal":
        checks.append(Check("journal", OK, "WAL: readers do not wait for writers"))
    else:
        checks.append(Check("journal", WARN, f"{facts.journal}: expected WAL"))
    checks.append(Check("scope", INFO, "SQLite locks hold across the processes of this host only (no network FS)"))
    return checks


# -- PostgreSQL ------------------------------------------------------------------------------


@dataclass
class PostgresFacts:
    version: str | None = None
    standby: bool | None = None
    user: str = ""
    offset: float | None = None
    objects: dict[str, bool] = field(default_factory=dict)
    error: str = ""


def _libpq_url(url: str) -> str:
    """The libpq URL of a ``postgresql://`` or ``postgresql+table://`` store URL (without the
    store's own options)."""
    from ..backends.sql._pgurl import split_query, unknown_to_libpq

    conninfo = "postgresql" + url[url.index("://") :]
    stripped, _ = split_query(conninfo, set(unknown_to_libpq(conninfo)))
    return stripped


_PRIVILEGES = (
    "SELECT c.relname, CASE c.relkind WHEN 'S' THEN has_sequence_privilege(c.oid, 'USAGE, UPDATE')"
    " ELSE has_table_privilege(c.oid, 'SELECT, INSERT, UPDATE, DELETE') END"
    " FROM pg_class c WHERE c.relname LIKE 'lockaspect%%' AND c.relname NOT LIKE 'lockaspect_demo%%'"
    " AND c.relkind IN ('r', 'p', 'S') AND pg_table_is_visible(c.oid) ORDER BY 1"
)


def postgres_facts(url: str) -> PostgresFacts:
    import psycopg

    facts = PostgresFacts()
    try:
        with psycopg.connect(_libpq_url(url), autocommit=True, connect_timeout=5) as conn:
            started = time.time()
            row = conn.execute(
                "SELECT current_setting('server_version'), pg_is_in_recovery(), current_user,"
                " extract(epoch FROM clock_timestamp())"
            ).fetchone()
            ended = time.time()
            assert row is not None
            facts.version, facts.standby, facts.user = str(row[0]), bool(row[1]), str(row[2])
            facts.offset = float(row[3]) - (started + ended) / 2
            facts.objects = {str(name): bool(allowed) for name, allowed in conn.execute(_PRIVILEGES)}
    except psycopg.Error as exc:
        facts.error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return facts


def postgres_checks(facts: PostgresFacts) -> list[Check]:
    if facts.error:
        return [Check("server", ERROR, facts.error)]
    assert facts.version is not None
    major = parse_version(facts.version)[:1]
    checks = [Check("version", OK if major >= (12,) else WARN, f"PostgreSQL {facts.version}")]
    if facts.standby:
        checks.append(Check("role", ERROR, "a standby (in recovery): locks cannot be written here"))
    else:
        checks.append(Check("role", OK, "primary (not in recovery)"))
    if not facts.objects:
        checks.append(Check("privileges", WARN, f"no lockaspect table or sequence visible to {facts.user}"))
    for name, allowed in facts.objects.items():
        verdict, text = (OK, "may use it") if allowed else (ERROR, "lacks SELECT/INSERT/UPDATE/DELETE (or USAGE)")
        checks.append(Check(f"privileges {name}", verdict, f"{facts.user} {text}"))
    checks.append(clock_check(facts.offset, judged_by_server=True))
    return checks


# -- ZooKeeper -------------------------------------------------------------------------------


@dataclass
class ZooKeeperFacts:
    version: str | None = None
    mode: str | None = None
    srvr_error: str = ""
    session_timeout: float | None = None
    error: str = ""


def zookeeper_facts(url: str, namespace: str) -> ZooKeeperFacts:
    from kazoo.client import KazooClient
    from kazoo.exceptions import KazooException

    from ..backends.zookeeper._options import parse_settings

    settings = parse_settings(url, namespace, {})
    facts = ZooKeeperFacts()
    client = KazooClient(hosts=settings.hosts, timeout=settings.session_timeout)
    try:
        client.start(timeout=settings.connect_timeout)
    except Exception as exc:  # noqa: BLE001 - kazoo raises its handler's timeout type
        facts.error = f"cannot connect to {settings.hosts}: {exc or type(exc).__name__}"
        client.close()
        return facts
    try:
        facts.session_timeout = client._session_timeout / 1000  # negotiated by the server
        try:
            for line in client.command(b"srvr").splitlines():
                if line.startswith("Zookeeper version:"):
                    facts.version = line.split(":", 1)[1].strip().split("-")[0].split(",")[0]
                elif line.startswith("Mode:"):
                    facts.mode = line.split(":", 1)[1].strip()
            if facts.version is None:
                facts.srvr_error = "srvr gave no version (not in 4lw.commands.whitelist?)"
        except (KazooException, OSError) as exc:
            facts.srvr_error = f"srvr failed: {exc}"
    finally:
        client.stop()
        client.close()
    return facts


def zookeeper_checks(facts: ZooKeeperFacts) -> list[Check]:
    if facts.error:
        return [Check("server", ERROR, facts.error)]
    checks = []
    if facts.version is None:
        checks.append(Check("version", INFO, f"not read: {facts.srvr_error}"))
    else:
        ok = parse_version(facts.version) >= (3, 5, 1)
        detail = f"ZooKeeper {facts.version}, mode {facts.mode or '?'}"
        checks.append(Check("version", OK if ok else WARN, detail + ("" if ok else ": containers need 3.5.1+")))
    if facts.session_timeout is not None:
        checks.append(
            Check("session", INFO, f"timeout {facts.session_timeout:g} s: a dead holder's locks free within it")
        )
    checks.append(Check("clock", INFO, "not checked: ZooKeeper tells no time (sessions are timed by the server)"))
    return checks
