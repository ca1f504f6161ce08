"""``postgresql://`` and ``postgres://`` URLs and the advisory store's options, checked before
any connection exists (no I/O here).

The URL is any libpq connection URI (``postgresql://user:password@host:port/db?sslmode=...``,
``postgresql:///db?host=/var/run/postgresql`` for a unix socket, several hosts); libpq itself
parses it, so what libpq accepts works and what it refuses is a
:class:`~lockaspect.ConfigurationError` here, with the password redacted. The store's own
options may be given in the query string too (``?pool_size=8&create_schema=false``): they are
taken out of it before libpq sees it, and keywords win over them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ....errors import ConfigurationError
from ...base import redacted
from .._pgurl import split_query, unknown_to_libpq

__all__ = ["SCHEMES", "Settings", "parse_settings"]

#: The URL schemes of the store.
SCHEMES: Final = ("postgresql", "postgres")

#: The options the factory takes, with their defaults.
DEFAULTS: Final[dict[str, Any]] = {
    "pool_size": 4,
    "max_waiters": 64,
    "connect_timeout": 10.0,
    "create_schema": True,
    "idle_session_timeout": 60.0,
    "application_name": "lockaspect",
}


@dataclass(frozen=True)
class Settings:
    """A checked URL and options.

    Attributes:
        url: The libpq URL: as given, less the store's options in its query string (it may
            hold a password: show :attr:`shown` instead).
        shown: The URL as given, with its password redacted (errors, reprs).
        namespace: Prefix of every key (the advisory key hashes ``namespace + key``).
        pool_size: Holder connections kept open (opened lazily, locks spread over them).
        max_waiters: Connections that may block in the server's queue at once (one per
            waiting caller); a caller beyond them waits by re-trying (polling).
        connect_timeout: Seconds to connect (libpq's ``connect_timeout``, at least 2).
        create_schema: Create the fence sequence and the metadata tables if missing.
        idle_session_timeout: Seconds (``0``: off) after which the server ends a holder
            session that sent nothing: the server-side bound on a frozen holder.
        application_name: What the sessions show in ``pg_stat_activity``.
    """

    url: str
    shown: str
    namespace: str
    pool_size: int
    max_waiters: int
    connect_timeout: float
    create_schema: bool
    idle_session_timeout: float
    application_name: str

    def connect_kwargs(self) -> dict[str, Any]:
        """What ``psycopg.connect(url, **kwargs)`` gets besides the URL."""
        return {
            "autocommit": True,
            "connect_timeout": max(2, math.ceil(self.connect_timeout)),
            "application_name": self.application_name,
        }


def _int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int, got {value!r}")
    if value < least:
        raise ConfigurationError(f"{name} must be at least {least}, got {value!r}")
    return value


def _seconds(name: str, value: object, zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise ConfigurationError(
            f"{name} must be a finite number of seconds {'>= 0' if zero else '> 0'}, got {value!r}"
        )
    return seconds


_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


def _from_query(name: str, text: str) -> object:
    """An option's value from the query string, as the keyword would give it; a string that
    does not parse is passed on as it is, for the keyword's check to refuse it."""
    default = DEFAULTS[name]
    if isinstance(default, bool):
        flag = text.strip().lower()
        return True if flag in _TRUE else False if flag in _FALSE else text
    for kind in (int, float):
        if isinstance(default, kind):
            try:
                return kind(text)
            except ValueError:
                return text
    return text


def _refuse_unknown(unknown: list[str], shown: str) -> None:
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for {shown!r}; the PostgreSQL advisory store takes "
            f"{', '.join(sorted(DEFAULTS))} (as keywords or in the URL's query string), and libpq's connection "
            "parameters (such as sslmode) in the URL"
        )


def parse_settings(url: object, namespace: object, options: dict[str, Any]) -> Settings:
    """Check ``url`` and ``options`` (see :data:`DEFAULTS`); :class:`ConfigurationError`
    naming the problem, with the password redacted."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    shown = redacted(url)
    if not isinstance(namespace, str):
        raise ConfigurationError(f"namespace must be a str, got {namespace!r}")
    scheme = url.partition("://")[0]
    if scheme not in SCHEMES or "://" not in url:
        raise ConfigurationError(f"a PostgreSQL store URL starts with postgresql:// or postgres://, got {shown!r}")
    _refuse_unknown(sorted(set(options) - set(DEFAULTS)), shown)
    conninfo, query = split_query(url, DEFAULTS)
    _refuse_unknown(unknown_to_libpq(conninfo), shown)
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        message = str(exc).replace(url, shown).replace(conninfo, shown)
        raise ConfigurationError(f"malformed PostgreSQL URL {shown!r}: {message}") from None
    for port in str(params.get("port", "")).split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigurationError(f"malformed PostgreSQL URL {shown!r}: port {port!r} is not a port number")
    if "dbname" in params and not params["dbname"]:
        raise ConfigurationError(f"malformed PostgreSQL URL {shown!r}: empty database name")
    values = {**DEFAULTS, **{name: _from_query(name, text) for name, text in query.items()}, **options}
    create_schema = values["create_schema"]
    if not isinstance(create_schema, bool):
        raise ConfigurationError(f"create_schema must be True or False, got {create_schema!r}")
    application_name = values["application_name"]
    if not isinstance(application_name, str) or not application_name:
        raise ConfigurationError(f"application_name must be a non-empty str, got {application_name!r}")
    return Settings(
        url=conninfo,
        shown=shown,
        namespace=namespace,
        pool_size=_int("pool_size", values["pool_size"], 1),
        max_waiters=_int("max_waiters", values["max_waiters"], 0),
        connect_timeout=_seconds("connect_timeout", values["connect_timeout"], False),
        create_schema=create_schema,
        idle_session_timeout=_seconds("idle_session_timeout", values["idle_session_timeout"], True),
        application_name=application_name,
    )
