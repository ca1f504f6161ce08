"""Which PostgreSQL errors a retry cannot cure (shared by ``postgresql://`` and
``postgresql+table://``; no driver import here).

A wrong password, a missing database or role, a ``pg_hba.conf`` that refuses the connection
or an ``sslmode`` the server cannot meet stay wrong however long a caller waits: they are
reported at once (``BackendError.transient`` false) instead of being retried until the wait
runs out, which for ``wait=None`` is never. Network failures (refused, timed out, the server
closed the connection, shutting down, starting up, too many connections) stay transient.

psycopg's connection errors often carry no SQLSTATE (libpq reports a failed connection as
text), so the SQLSTATE is looked at first, then the message.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["permanent", "reason"]

#: SQLSTATE classes a retry cannot cure: 28 invalid authorization specification (wrong
#: password, a role that may not log in), 3D invalid catalog name (no such database).
_CLASSES: Final = ("28", "3D")
#: Single SQLSTATEs: no CONNECT privilege on the database.
_STATES: Final = frozenset({"42501"})

_MESSAGES: Final = re.compile(
    "|".join(
        (
            r"authentication failed",  # password, md5, scram, ident, peer, ldap, pam, cert, ...
            r"no password supplied",  # fe_sendauth: the server asks for one, the URL has none
            r"no pg_hba\.conf entry",
            r"pg_hba\.conf rejects connection",
            r"(database|role) \"[^\"]*\" does not exist",
            r"is not permitted to log in",
            r"permission denied for database",
            r"server does not support ssl",
            r"certificate verify failed",
        )
    ),
    re.IGNORECASE,
)


def permanent(exc: BaseException) -> bool:
    """Whether ``exc`` (a psycopg error, typically of a connection) will fail the same way on
    every retry: a configuration or credentials problem, not the network or the server's state."""
    state = getattr(exc, "sqlstate", None)
    if isinstance(state, str) and state:
        return state[:2] in _CLASSES or state in _STATES
    return _MESSAGES.search(str(exc)) is not None


def reason(exc: BaseException) -> str:
    """The server's (or libpq's) own words about ``exc``, without libpq's ``connection to
    server at ... failed: FATAL:`` preamble, on one line."""
    text = str(exc).strip()
    for marker in ("FATAL:", "failed:"):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
            break
    return " ".join(text.split()) or type(exc).__name__
