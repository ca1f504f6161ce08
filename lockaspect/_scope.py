"""``scope=`` and ``connection=``: a lock held by the store's session (the default) or by the
caller's own database transaction (``scope="transaction"``: PostgreSQL's
``pg_advisory_xact_lock`` on ``connection``, see :mod:`lockaspect.xact`).

The validators of the two options and the rules between them and the other options, checked
by :func:`lockaspect.options.check` (the decorator) and by ``client.lock()`` before any I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from .errors import ConfigurationError

__all__ = ["SCOPES", "check_connection", "check_rules", "check_scope"]

SCOPES: Final = ("session", "transaction")

#: What each option cannot mean for a lock that ends with the caller's transaction.
_REFUSED: Final[tuple[tuple[str, str], ...]] = (
    ("lease", "lease= (there is no lease: the lock ends when the transaction commits or rolls back)"),
    ("delay_weight", "delay_weight= (no watchdog renews a transaction-scoped lock)"),
    ("max_hold", "max_hold= (the lock ends with the transaction, not after a time)"),
    ("on_lost", "on_lost= (nothing watches the lock in the background; the block raises LockLost on exit)"),
    ("fair", "fair=True (PostgreSQL queues advisory-lock waiters itself)"),
    ("permits", "permits= (an advisory lock is not a semaphore)"),
    ("keys", "keys= (one key per transaction-scoped lock; nest them, in a fixed key order)"),
    ("executor", "executor= (the body runs in the caller's thread, on the caller's connection)"),
)
_UNSET_VALUES: Final[Mapping[str, Any]] = {"fair": False}


def check_scope(value: object) -> str:
    """``"session"`` or ``"transaction"``."""
    if value not in SCOPES:
        if not isinstance(value, str):
            raise TypeError(f"scope must be a str, got {type(value).__name__}")
        raise ConfigurationError(f"scope must be 'session' or 'transaction', got {value!r}")
    return str(value)


def check_connection(value: object) -> object:
    """Any value: a connection object, or (decorator) a parameter name or a function of the
    bound arguments. What it is gets checked when the lock is taken."""
    return value


def check_rules(options: Mapping[str, Any]) -> None:
    """Refuse option combinations that make no sense with ``options["scope"]``
    (:class:`ConfigurationError`)."""
    scope = options.get("scope", "session")
    connection = options.get("connection")
    if scope != "transaction":
        if connection is not None:
            raise ConfigurationError(
                "connection= is only for scope='transaction' (the connection whose transaction holds the lock)"
            )
        return
    if connection is None:
        raise ConfigurationError(
            "scope='transaction' needs connection=: the psycopg connection, SQLAlchemy Session or Connection, "
            "or Django connection whose open transaction takes the lock"
        )
    refused = []
    for name, why in _REFUSED:
        value = options.get(name)
        if name == "executor" and value == "inline":
            continue
        if value is not None and value != _UNSET_VALUES.get(name):
            refused.append(why)
    if refused:
        raise ConfigurationError("scope='transaction' cannot take " + "; ".join(refused))
