"""The PostgreSQL advisory store's pool decisions (no I/O): how a session's users are
counted while a queued wait and statements share it."""

from __future__ import annotations

import threading

from lockaspect.backends.sql.advisory._options import parse_settings
from lockaspect.backends.sql.advisory._session import PoolBase, SessionBase


def _pool() -> PoolBase:
    return PoolBase(parse_settings("postgresql://localhost/db", "", {}), threading.Lock())


def test_a_wait_ending_leaves_the_count_of_statements_running_on_its_session() -> None:
    pool = _pool()
    session = SessionBase(None, 1)
    pool.sessions.append(session)
    session.waiting = object()  # a queued wait runs on it (for_wait does not count users)
    session.pin(7, 1)  # the wait was granted: the session holds the lock
    session.users += 1  # a statement on the held lock (a release, a probe) runs on it
    session.waiting = None
    assert not pool._done(session, statement=False)  # the wait's thread or task ends
    assert session.users == 1, "the statement still runs: the session is busy"
    assert not pool._done(session)  # the statement ends
    assert session.users == 0


def test_a_statement_ending_lowers_the_count() -> None:
    pool = _pool()
    session = SessionBase(None, 1)
    pool.sessions.append(session)
    session.users = 1
    assert not pool._done(session)
    assert session.users == 0
