"""Opening the lease table: ``sqlite://`` (the standard library's sqlite3) and
``postgresql+table://`` (psycopg 3), their options, the schema, and how each driver's errors
are classified."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ....errors import BackendError, ConfigurationError
from ...base import redacted
from .. import _pgerrors
from .._keys import advisory_key
from .._pgurl import split_query, unknown_to_libpq
from ._driver import AsyncDriver, Backend, Pool, SyncDriver, socket_alive
from ._notify import hub_for
from ._sql import ADDED_COLUMNS, POSTGRES, SQLITE, TABLES
from .aio import AsyncBridgeStore, AsyncTableStore
from .store import TableStore

__all__ = ["open_sqlite_store", "open_table_store", "schema_sql"]

#: Oldest SQLite with everything the statements use (UPDATE ... FROM, RETURNING).
MIN_SQLITE = (3, 35, 0)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def schema_sql(dialect: str) -> str:
    """The DDL that creates the lease table's tables (``"sqlite"`` or ``"postgresql"``), for
    users who create schemas themselves and open the store with ``create_schema=False``."""
    if dialect not in ("sqlite", "postgresql"):
        raise ConfigurationError(f"the lease table runs on 'sqlite' or 'postgresql', not {dialect!r}")
    return (SQLITE if dialect == "sqlite" else POSTGRES).schema.strip() + "\n"


def _flag(value: object, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ConfigurationError(f"{name} must be true or false, got {value!r}")


def _seconds(value: object, name: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not seconds >= 0 or seconds == float("inf"):
        raise ConfigurationError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return seconds


def _options(query: str, given: Mapping[str, Any], known: set[str], url: str) -> dict[str, Any]:
    options: dict[str, Any] = dict(parse_qsl(query, keep_blank_values=True))
    options.update(given)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for {redacted(url)!r}; "
            f"the options are {', '.join(sorted(known))}"
        )
    return options


# -- SQLite ------------------------------------------------------------------------------


def _sqlite_transient(exc: BaseException) -> bool | None:
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        return "locked" in text or "busy" in text or "disk i/o" in text
    return False if isinstance(exc, sqlite3.Error) else None


def _sqlite_hint(exc: BaseException) -> str:
    if isinstance(exc, sqlite3.OperationalError) and _locked(exc):
        return (
            " (another connection kept SQLite's write lock for longer than busy_timeout: keep the locks "
            "in a file of their own, or raise busy_timeout)"
        )
    return ""


def _sqlite_broken(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.ProgrammingError)


def _sqlite_path(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc or not parts.path.startswith("/") or parts.path == "/" or parts.fragment:
        raise ConfigurationError(
            f"a SQLite lock store URL is sqlite:///<relative path> or sqlite:////<absolute path>, got {url!r}"
        )
    path = unquote(parts.path[1:])
    if path == ":memory:" or path.startswith("file:"):
        raise ConfigurationError(
            f"{url!r}: an in-memory SQLite database is private to one connection; use memory:// for locks "
            "within one process, or a file for locks across processes"
        )
    return Path(path)


def open_sqlite_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> TableStore:
    """The store of ``sqlite:///<path>``: a lease table in a SQLite file, shared by every
    process of this host that opens the same file (never across hosts: SQLite's locking does
    not hold on network file systems).

    The path follows SQLAlchemy's URLs: ``sqlite:///locks.db`` is relative to the working
    directory, ``sqlite:////var/lib/app/locks.db`` absolute. Options (keywords, or the URL's
    query string): ``create_schema`` (default true: create the tables if missing; false:
    refuse to open without them), ``busy_timeout`` (seconds a statement waits for another
    process's write, default 5), ``owner_info`` (default true: store host, pid and thread
    with each hold).

    Raises:
        ConfigurationError: a malformed URL or option, a missing directory, a file that cannot
            be written, a SQLite older than 3.35, or missing tables with ``create_schema=False``.
            Nothing is written in any of these cases.
    """
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        raise ConfigurationError(
            f"the SQLite lock store needs SQLite >= 3.35 (RETURNING), this Python has {sqlite3.sqlite_version}"
        )
    path = _sqlite_path(url)
    opts = _options(urlsplit(url).query, options, {"create_schema", "busy_timeout", "owner_info"}, url)
    create = _flag(opts.get("create_schema", True), "create_schema")
    busy = _seconds(opts.get("busy_timeout", 5.0), "busy_timeout")
    info = _flag(opts.get("owner_info", True), "owner_info")
    if not isinstance(namespace, str):
        raise ConfigurationError(f"namespace must be a str, got {namespace!r}")
    directory = path.parent.resolve()
    if not directory.is_dir():
        hint = f"; for an absolute path write sqlite:////{path}" if not path.is_absolute() else ""
        raise ConfigurationError(f"{url!r}: the directory {str(directory)!r} does not exist{hint}")
    if not path.exists() and not create:
        raise ConfigurationError(f"{url!r}: no database file at {str(path.resolve())!r} (and create_schema=False)")
    label = f"sqlite:///{path}"
    resolved = str(path.resolve())

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(resolved, timeout=busy, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    _prepare_sqlite(connect, create, url, resolved, busy)
    backend = Backend(SQLITE, label, _sqlite_transient, _sqlite_broken, hint=_sqlite_hint)
    driver = SyncDriver(backend, Pool(connect, lambda conn: conn.close()))
    hub = hub_for("sqlite:" + resolved)

    def connect_inline() -> sqlite3.Connection:  # an asyncio twin's: never waits for the write lock
        conn = sqlite3.connect(resolved, timeout=0, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def twin(store: TableStore) -> AsyncBridgeStore:
        inline = SyncDriver(backend, Pool(connect_inline, lambda conn: conn.close(), keep=1))
        return AsyncBridgeStore(store, TableStore(inline, hub, store.namespace, twin=twin, info=info))

    return TableStore(driver, hub, namespace, twin=twin, info=info)


def _prepare_sqlite(connect: Any, create: bool, url: str, path: str, busy: float) -> None:
    """Check (and with ``create``, make) the schema; WAL mode; a writable file. A file another
    process holds locked (processes starting together, each making the schema) is retried for
    ``busy`` seconds, then reported as a transient :class:`BackendError`."""
    deadline = time.monotonic() + busy
    while True:
        try:
            _prepare_once(connect, create, url, path)
            return
        except sqlite3.OperationalError as exc:
            if not _locked(exc):
                raise _prepare_error(exc, url, path) from exc
            if time.monotonic() >= deadline:
                raise BackendError(
                    f"{url!r}: the file stayed locked by another connection's write for busy_timeout "
                    f"({busy:g}s) while opening the lock store; retry, or keep the locks in a file of their own",
                    transient=True,
                ) from exc
            time.sleep(0.01)  # PRAGMA journal_mode does not wait for a busy file by itself


def _locked(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _prepare_error(exc: sqlite3.Error, url: str, path: str) -> ConfigurationError:
    text = str(exc)
    if "no such table" in text:
        return ConfigurationError(
            f"{url!r}: {text}; open it with create_schema=True, or create the tables with "
            "lockaspect.backends.sql.table.schema_sql('sqlite')"
        )
    if _read_only(exc):
        return ConfigurationError(f"{url!r}: {path!r} is read-only: the lock store writes to it")
    return ConfigurationError(f"{url!r}: {text}")


def _prepare_once(connect: Any, create: bool, url: str, path: str) -> None:
    try:
        conn = connect()
    except sqlite3.Error as exc:
        if _read_only(exc):  # opening a WAL file needs its -shm: not in a read-only directory
            raise ConfigurationError(f"{url!r}: {path!r} is read-only: the lock store writes to it") from exc
        raise ConfigurationError(f"{url!r}: cannot open {path!r}: {exc}") from exc
    try:
        if create:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise ConfigurationError(
                    f"{url!r}: SQLite refused WAL mode (got {mode!r}); is the file on a local disk?"
                )
            conn.executescript(SQLITE.schema)
        for table in (*TABLES, "lockaspect_fences"):
            conn.execute(f"SELECT 1 FROM {table} LIMIT 0")
        conn.execute("BEGIN IMMEDIATE")
        try:
            _migrate_sqlite(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    except sqlite3.OperationalError as exc:
        if _locked(exc):
            raise  # retried by the caller
        raise _prepare_error(exc, url, path) from exc
    except sqlite3.Error as exc:
        raise _prepare_error(exc, url, path) from exc
    finally:
        conn.close()


def _migrate_sqlite(conn: sqlite3.Connection) -> None:
    """Add the columns a table made by an older lockaspect lacks (inside ``BEGIN IMMEDIATE``,
    so that processes opening it together add each column once). SQLite has no ``ADD COLUMN
    IF NOT EXISTS``: the table's columns are read first."""
    have = {str(row[1]) for row in conn.execute("PRAGMA table_info(lockaspect_holds)")}
    for column, declaration in ADDED_COLUMNS:
        if column not in have:
            conn.execute(f"ALTER TABLE lockaspect_holds ADD COLUMN {column} {declaration}")


def _read_only(exc: sqlite3.Error) -> bool:
    text = str(exc)
    return "readonly" in text or "read-only" in text


# -- PostgreSQL ------------------------------------------------------------------------------

_SERIALISE = "SELECT pg_advisory_xact_lock(%(k)s)"
#: Held while creating the schema, so that concurrent first starts do not race (a fixed key
#: outside the range of advisory_key's inputs' likely values would be no safer: any is fine).
_SCHEMA_LOCK = advisory_key("lockaspect:schema:lease-table")


def _table_key(name: str) -> int:
    return advisory_key("lockaspect-table:" + name)


def _pg_transient(exc: BaseException) -> bool | None:
    import psycopg

    if isinstance(exc, psycopg.Error) and _pgerrors.permanent(exc):
        return False  # a wrong password, a missing database or role, pg_hba.conf, sslmode
    if isinstance(exc, (psycopg.OperationalError, psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled)):
        return True
    return False if isinstance(exc, psycopg.Error) else None


def _pg_broken(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc, psycopg.OperationalError)


def open_table_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> TableStore:
    """The store of ``postgresql+table://user:password@host:port/dbname``: the lease table on
    PostgreSQL (psycopg 3; ``pip install 'lockaspect[postgres]'``). Every operation is one
    statement or one short transaction, with no session state, so it works behind PgBouncer in
    transaction pooling.

    Options (keywords, or the URL's query string, next to libpq's own such as
    ``sslmode``): ``create_schema`` (default true), ``connect_timeout`` (seconds, default 10),
    ``owner_info`` (default true), ``prepared_statements`` (default false: server-side
    prepared statements make each statement cheaper for the server, but break behind a
    PgBouncer older than 1.21 or without ``max_prepared_statements``; turn them on when you
    connect directly).

    Raises:
        ConfigurationError: a malformed URL or option, psycopg missing, missing tables with
            ``create_schema=False``.
        BackendError: the server cannot be reached (transient), or refuses the connection
            for good: a wrong password, a missing database or role, ``pg_hba.conf``, an
            ``sslmode`` it cannot meet (not transient).
    """
    try:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict
    except ImportError as exc:
        raise ConfigurationError("postgresql+table:// needs psycopg 3: pip install 'lockaspect[postgres]'") from exc
    parts = urlsplit(url)
    scheme, _, mode = parts.scheme.partition("+")
    if scheme not in ("postgresql", "postgres") or mode != "table" or not url.startswith(parts.scheme + "://"):
        raise ConfigurationError(f"a lease-table URL is postgresql+table://..., got {redacted(url)!r}")
    ours = {"create_schema", "connect_timeout", "owner_info", "prepared_statements"}
    stripped, query = split_query(url, ours)  # libpq's parameters stay as written
    opts = _options("", {**query, **options}, ours, url)
    conninfo = "postgresql" + stripped[len(parts.scheme) :]
    unknown = unknown_to_libpq(conninfo)  # neither ours nor libpq's
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for {redacted(url)!r}; "
            f"the options are {', '.join(sorted(ours))}, and libpq's connection parameters (such as sslmode)"
        )
    try:
        conninfo_to_dict(conninfo)  # libpq's check of the rest, before any connection
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"{redacted(url)!r}: {exc}") from exc
    create = _flag(opts.get("create_schema", True), "create_schema")
    timeout = _seconds(opts.get("connect_timeout", 10), "connect_timeout")
    info = _flag(opts.get("owner_info", True), "owner_info")
    prepare = 0 if _flag(opts.get("prepared_statements", False), "prepared_statements") else None
    if not isinstance(namespace, str):
        raise ConfigurationError(f"namespace must be a str, got {namespace!r}")
    label = redacted(url)
    seconds = max(1, round(timeout))
    backend = Backend(POSTGRES, label, _pg_transient, _pg_broken, (_SERIALISE, _table_key), socket_alive)

    def connect() -> Any:
        return psycopg.Connection.connect(conninfo, autocommit=True, prepare_threshold=prepare, connect_timeout=seconds)

    try:
        conn = connect()
    except psycopg.Error as exc:
        if _pgerrors.permanent(exc):
            raise BackendError(
                f"cannot connect to {label}: {_pgerrors.reason(exc)} (a configuration or credentials problem: "
                "not retried)",
                transient=False,
            ) from exc
        raise BackendError(f"cannot connect to {label}: {exc}", transient=True) from exc
    try:
        _prepare_postgres(conn, create, label)
    finally:
        conn.close()
    hub = hub_for("pg-table:" + label)

    def twin(store: TableStore) -> AsyncTableStore:
        async def aconnect() -> Any:
            return await psycopg.AsyncConnection.connect(
                conninfo, autocommit=True, prepare_threshold=prepare, connect_timeout=seconds
            )

        return AsyncTableStore(AsyncDriver(backend, aconnect), hub, store.namespace, info)

    driver = SyncDriver(backend, Pool(connect, lambda conn: conn.close(), alive=socket_alive))
    return TableStore(driver, hub, namespace, twin=twin, info=info)


def _prepare_postgres(conn: Any, create: bool, label: str) -> None:
    import psycopg

    try:
        if create:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                for statement in POSTGRES.schema.split(";"):
                    if statement.strip():
                        conn.execute(statement)
        for table in TABLES:
            try:
                conn.execute(f"SELECT 1 FROM {table} LIMIT 0")
            except psycopg.errors.UndefinedTable as exc:
                _missing(label, f"the table {table}", exc)
        conn.execute("SELECT 1 FROM pg_sequences WHERE sequencename = 'lockaspect_fence'").fetchone() or _missing(
            label, "the sequence lockaspect_fence"
        )
        _migrate_postgres(conn, label)
    except psycopg.errors.LockNotAvailable as exc:
        raise BackendError(
            f"{label}: adding a column to lockaspect_holds (an upgrade of the lease table) waited "
            f"{_MIGRATE_WAIT} for the table's lock: another transaction keeps it in use; retry",
            transient=True,
        ) from exc
    except psycopg.Error as exc:
        raise ConfigurationError(f"{label}: cannot prepare the lease table: {exc}") from exc


#: How long adding a column waits for the table's lock (every lock operation queues behind
#: an ALTER TABLE that waits: keep it short).
_MIGRATE_WAIT = "5s"
_COLUMNS = (
    "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass('lockaspect_holds') AND attnum > 0 "
    "AND NOT attisdropped"
)


def _migrate_postgres(conn: Any, label: str) -> None:
    """Add the columns a table made by an older lockaspect lacks. The catalog is read first:
    an ALTER TABLE, even one that adds nothing, takes the table's exclusive lock."""
    import psycopg

    missing = _lacking(conn)
    if not missing:
        return
    statements = [f"ALTER TABLE lockaspect_holds ADD COLUMN IF NOT EXISTS {c} {d}" for c, d in missing]
    try:
        with conn.transaction():
            # READ COMMITTED whatever the server's default: the read under the lock must see
            # what the client that held it before committed.
            conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            # Read again under the schema lock: a client that started at the same moment
            # may have added them while this one waited, and an ALTER TABLE that adds
            # nothing still takes the table's exclusive lock (every lock operation would
            # queue behind it).
            missing = _lacking(conn)
            conn.execute(f"SET LOCAL lock_timeout = '{_MIGRATE_WAIT}'")
            statements = [f"ALTER TABLE lockaspect_holds ADD COLUMN IF NOT EXISTS {c} {d}" for c, d in missing]
            for statement in statements:
                conn.execute(statement)
    except psycopg.errors.LockNotAvailable:
        raise
    except psycopg.Error as exc:
        raise ConfigurationError(
            f"{label}: lockaspect_holds was made by an earlier lockaspect and needs a new column, which this role "
            f"cannot add ({exc}); run once as the table's owner: {'; '.join(statements)}"
        ) from exc


def _lacking(conn: Any) -> list[tuple[str, str]]:
    """The columns of :data:`ADDED_COLUMNS` the table lacks (read from the catalog)."""
    have = {row[0] for row in conn.execute(_COLUMNS).fetchall()}
    return [(column, declaration) for column, declaration in ADDED_COLUMNS if column not in have]


def _missing(label: str, what: str, cause: BaseException | None = None) -> Any:
    raise ConfigurationError(
        f"{label}: {what} is missing: open the store with create_schema=True, or create the tables with "
        "lockaspect.backends.sql.table.schema_sql('postgresql')"
    ) from cause
