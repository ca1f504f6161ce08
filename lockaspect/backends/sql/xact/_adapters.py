"""The connections a transaction-scoped lock runs on: psycopg 3, SQLAlchemy and Django.

:func:`adapt` recognises the connection by the module of its class (no driver is imported to
find out; the one the object comes from is imported once it is known) and refuses, with
:class:`~lockaspect.ConfigurationError`, what is not a PostgreSQL connection. Each adapter
then answers, without I/O:

- :meth:`problem`: why the lock cannot be taken now (no open transaction, autocommit, an
  aborted transaction), or ``None``;
- :meth:`ended`: whether the transaction the lock was taken in is known to have ended;

and runs the statements of :mod:`._sql` as part of the caller's transaction
(:meth:`execute` or :meth:`aexecute`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ....errors import ConfigurationError
from ._sql import Row, Step

__all__ = ["Adapter", "adapt"]

_NAMED = re.compile(r"%\((\w+)\)s")

ACCEPTED = (
    "a psycopg 3 Connection or AsyncConnection, a SQLAlchemy Session, Connection, AsyncSession or "
    "AsyncConnection on PostgreSQL, or a Django connection to PostgreSQL"
)


class Adapter:
    """A connection whose transaction takes the lock."""

    #: Runs its statements with ``await`` (``async with`` / ``async def``).
    is_async = False
    #: What it is, for messages.
    label = "connection"

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        #: The object that identifies the connection for re-entry.
        self.owner: object = connection

    def problem(self) -> str | None:
        raise NotImplementedError

    async def aproblem(self) -> str | None:
        return self.problem()

    def began(self) -> None:
        """Called once the lock is taken: remember the transaction (for :meth:`ended`)."""

    def ended(self) -> bool:
        raise NotImplementedError

    def execute(self, step: Step) -> Row | None:
        raise NotImplementedError

    async def aexecute(self, step: Step) -> Row | None:
        raise NotImplementedError


class _Psycopg(Adapter):
    def __init__(self, connection: Any) -> None:
        import psycopg
        from psycopg.pq import TransactionStatus
        from psycopg.rows import tuple_row

        super().__init__(connection)
        self.is_async = isinstance(connection, psycopg.AsyncConnection)
        self.label = f"psycopg {type(connection).__name__}"
        self._status = TransactionStatus
        self._rows = tuple_row

    def problem(self) -> str | None:
        connection = self.connection
        if connection.closed:
            return "the connection is closed"
        status = connection.info.transaction_status
        if status == self._status.INTRANS:
            return None
        if status == self._status.IDLE:
            how = "async with conn.transaction():" if self.is_async else "with conn.transaction():"
            return f"no transaction is open on it (autocommit, or nothing run yet): open one with `{how}`"
        if status == self._status.INERROR:
            return "its transaction is aborted (a statement failed): roll it back first"
        if status == self._status.ACTIVE:
            return "a statement is still running on it"
        return "its state is unknown (the connection is broken)"

    def ended(self) -> bool:
        connection = self.connection
        return bool(connection.closed) or connection.info.transaction_status in (
            self._status.IDLE,
            self._status.UNKNOWN,
        )

    def execute(self, step: Step) -> Row | None:
        sql, params = step
        with self.connection.cursor(row_factory=self._rows) as cursor:
            cursor.execute(sql, params, prepare=False)  # never a server-side prepared statement (PgBouncer)
            return None if params is None else cursor.fetchone()

    async def aexecute(self, step: Step) -> Row | None:
        sql, params = step
        async with self.connection.cursor(row_factory=self._rows) as cursor:
            await cursor.execute(sql, params, prepare=False)
            return None if params is None else await cursor.fetchone()


class _SQLAlchemy(Adapter):
    """A ``Session`` or ``Connection`` (or their asyncio wrappers, or a ``scoped_session``)."""

    def __init__(self, connection: Any) -> None:
        from sqlalchemy import exc, text
        from sqlalchemy.engine import Connection
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
        from sqlalchemy.orm import Session, scoped_session

        if isinstance(connection, scoped_session):
            connection = connection()
        super().__init__(connection)
        self._text = text
        self.is_async = isinstance(connection, (AsyncSession, AsyncConnection))
        sync: Any = connection
        if isinstance(connection, AsyncSession):
            sync = connection.sync_session
        elif isinstance(connection, AsyncConnection):
            sync = connection.sync_connection
        if not isinstance(sync, (Session, Connection)):
            raise TypeError(f"{type(connection).__name__} is not a SQLAlchemy Session or Connection")
        self.label = f"SQLAlchemy {type(connection).__name__}"
        self._sync = sync
        self._connection_type = Connection
        self.owner = sync
        try:
            dialect = (sync.get_bind() if isinstance(sync, Session) else sync).dialect.name
        except exc.UnboundExecutionError:
            dialect = "no database (the session has no bind)"
        self.dialect = dialect
        self._transaction: object = None

    def _state(self) -> str | None:
        sync = self._sync
        if getattr(sync, "closed", False):
            return "the connection is closed"
        if not sync.in_transaction():
            return "no transaction is open on it: begin one first (`with session.begin():` / `conn.begin()`)"
        return None

    def _autocommit(self) -> str | None:
        # The connection the statements will run on (a session checks one out of the pool first).
        sync = self._sync
        raw = sync if isinstance(sync, self._connection_type) else sync.connection()
        if getattr(raw.connection.dbapi_connection, "autocommit", False):
            return "its driver connection is in autocommit mode (isolation_level='AUTOCOMMIT'): no transaction holds it"
        return None

    def problem(self) -> str | None:
        return self._state() or self._autocommit()

    async def aproblem(self) -> str | None:
        state = self._state()
        if state is not None:
            return state
        if not isinstance(self._sync, self._connection_type):
            await self.connection.connection()  # check out the session's connection, the async way
        return self._autocommit()

    def began(self) -> None:
        self._transaction = self._sync.get_transaction()

    def ended(self) -> bool:
        sync = self._sync
        return bool(getattr(sync, "closed", False)) or sync.get_transaction() is not self._transaction

    def _statement(self, step: Step) -> tuple[Any, Mapping[str, Any]]:
        sql, params = step
        return self._text(_NAMED.sub(r":\1", sql)), params or {}

    def execute(self, step: Step) -> Row | None:
        statement, params = self._statement(step)
        result = self._sync.execute(statement, params)
        return None if step[1] is None else tuple(result.one())

    async def aexecute(self, step: Step) -> Row | None:
        statement, params = self._statement(step)
        result = await self.connection.execute(statement, params)
        return None if step[1] is None else tuple(result.one())


class _Django(Adapter):
    label = "Django connection"

    def __init__(self, connection: Any) -> None:
        # django.db.connection is a proxy to this thread's connection: lock on that one.
        connections, alias = getattr(connection, "_connections", None), getattr(connection, "_alias", None)
        if connections is not None and alias is not None:
            connection = connections[alias]
        super().__init__(connection)
        self.dialect = str(connection.vendor)

    def problem(self) -> str | None:
        connection = self.connection
        if not connection.in_atomic_block:
            return "it is not inside a transaction: wrap the work in `with transaction.atomic():`"
        if connection.needs_rollback:
            return "its atomic block is marked for rollback (a statement failed in it)"
        return None

    def ended(self) -> bool:
        return not self.connection.in_atomic_block

    def execute(self, step: Step) -> Row | None:
        sql, params = step
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            return None if params is None else tuple(cursor.fetchone())


def _module_roots(connection: object) -> list[str]:
    return [cls.__module__.partition(".")[0] for cls in type(connection).__mro__]


def is_connection(value: object) -> bool:
    """``value`` is an object of a database driver or toolkit (not a function returning one)."""
    return any(
        root in ("psycopg", "psycopg2", "sqlalchemy", "django", "sqlite3", "asyncpg", "pymysql", "MySQLdb")
        for root in _module_roots(value)
    )


def adapt(connection: object, key: str) -> Adapter:
    """The adapter of ``connection``, or :class:`ConfigurationError` if it is not a PostgreSQL
    connection lockaspect can lock on."""
    roots = _module_roots(connection)
    adapter: Adapter
    if "psycopg" in roots:
        adapter = _Psycopg(connection)
    elif "sqlalchemy" in roots:
        try:
            adapter = _SQLAlchemy(connection)
        except TypeError as exc:
            raise ConfigurationError(f"cannot lock {key!r} on {exc}: connection= takes {ACCEPTED}", key=key) from None
        if adapter.dialect != "postgresql":
            raise ConfigurationError(_not_postgres(key, f"a {adapter.label} on {adapter.dialect}"), key=key)
    elif "django" in roots:
        django = _Django(connection)
        if django.dialect != "postgresql":
            raise ConfigurationError(_not_postgres(key, f"a Django {django.dialect} connection"), key=key)
        adapter = django
    elif "psycopg2" in roots:
        raise ConfigurationError(
            f"cannot lock {key!r} on a psycopg2 connection: use psycopg 3, or pass the SQLAlchemy or Django "
            "connection around it",
            key=key,
        )
    else:
        kind = "a sqlite3 connection" if "sqlite3" in roots else f"a {type(connection).__name__}"
        raise ConfigurationError(_not_postgres(key, kind), key=key)
    return adapter


def _not_postgres(key: str, what: str) -> str:
    return (
        f"cannot lock {key!r} with scope='transaction' on {what}: transaction-scoped locks are "
        f"PostgreSQL advisory locks; connection= takes {ACCEPTED}"
    )
