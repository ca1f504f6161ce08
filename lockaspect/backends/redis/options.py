"""Checks of a lock store URL and of the redis-py options given with it, made before any
connection exists.

redis-py connects lazily: ``redis.Redis.from_url(url, **options)`` only stores the
options, and the connection class is built from them at the first command. So an option
name redis-py does not know (``LockClient.from_url(url, lease_time=5)``) surfaced as a raw
``TypeError`` at the first lock, and a URL it cannot use (``redis://h:notaport/0``) as a
raw ``ValueError``. :func:`check_redis_options` turns both into a
:class:`~lockaspect.ConfigurationError` when the client is built.

Which names are accepted is read from redis-py itself, so it follows the installed
version (redis>=5): ``Redis.from_url`` keeps ``single_connection_client`` for itself and
passes everything else to ``ConnectionPool.from_url``, which takes ``connection_class``
and the pool's own parameters (``ConnectionPool.__init__``: ``max_connections``, ...),
drops ``cache`` / ``cache_config`` (redis>=5.1) into its cache, and hands the rest to the
connection class the URL's scheme selects: ``Connection`` (``redis://``),
``SSLConnection`` (``rediss://``) or ``UnixDomainSocketConnection`` (``unix://``). Each
of those passes its ``**kwargs`` up to ``AbstractConnection.__init__``, which takes no
``**kwargs``: so a connection class accepts the named parameters of the ``__init__``
methods along its MRO up to the first one without ``**kwargs``. Query parameters of the
URL join the same keyword arguments, so their names are checked too.

Some ``redis.Redis(...)`` arguments are *not* accepted by ``from_url``, although they
look like they should be: ``ssl=True`` and the ``ssl_*`` options on a ``redis://`` URL
(use ``rediss://``), ``unix_socket_path`` (use ``unix://``), ``connection_pool``, and
``host`` / ``port`` / ``socket_keepalive`` on a ``unix://`` URL. The error says so.

This module does no I/O.
"""

from __future__ import annotations

import difflib
import inspect
import re
import threading
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.connection

from ...errors import ConfigurationError
from ..base import redacted

__all__ = ["SCHEMES", "allowed_redis_options", "check_redis_options", "open_redis_store"]

#: The URL schemes redis-py (and so a lock store URL) accepts.
SCHEMES: Final = ("redis", "rediss", "unix")

#: Taken by ``Redis.from_url`` (``single_connection_client``) and ``ConnectionPool.from_url``
#: (``connection_class``, which overrides the class the scheme selects) themselves.
_FROM_URL_OWN: Final = ("single_connection_client", "connection_class")

#: ``Redis.__init__`` arguments that ``ConnectionPool.__init__`` pops from the connection
#: keyword arguments (redis>=5.1); counted only where ``Redis.__init__`` declares them.
_POOL_CONSUMED: Final = ("cache", "cache_config")

_QUERY_PASSWORD: Final = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)

_lock = threading.Lock()
_allowed: dict[type, frozenset[str]] = {}
_redis_init: frozenset[str] | None = None


def _named_parameters(function: Any) -> tuple[frozenset[str], bool]:
    """The keyword-passable parameter names of ``function`` (without ``self``), and whether
    it also takes ``**kwargs``."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a C-level __init__ (object's): nothing to learn
        return frozenset(), False
    names = frozenset(
        parameter.name
        for parameter in parameters
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and parameter.name != "self"
    )
    return names, any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)


def _class_parameters(cls: type) -> frozenset[str]:
    """The names ``cls(...)`` accepts: the named parameters of each ``__init__`` along the
    MRO, for as long as each passes ``**kwargs`` on to the next."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        own, forwards = _named_parameters(init)
        names |= own
        if not forwards:
            break
    return frozenset(names)


def _redis_init_parameters() -> frozenset[str]:
    """The parameters of ``redis.Redis.__init__``, computed once."""
    global _redis_init
    if _redis_init is None:
        with _lock:
            if _redis_init is None:
                _redis_init = _named_parameters(redis.Redis.__init__)[0]
    return _redis_init


def _connection_class(scheme: str) -> type:
    if scheme == "unix":
        return redis.connection.UnixDomainSocketConnection
    if scheme == "rediss":
        return redis.connection.SSLConnection
    return redis.connection.Connection


def allowed_redis_options(connection_class: type) -> frozenset[str]:
    """Every option name ``redis.Redis.from_url(url, **options)`` accepts when ``url``
    selects ``connection_class`` (computed once per class, on first use)."""
    allowed = _allowed.get(connection_class)
    if allowed is None:
        pool = _class_parameters(redis.ConnectionPool)
        consumed = frozenset(_POOL_CONSUMED) & _redis_init_parameters()
        allowed = pool | consumed | frozenset(_FROM_URL_OWN) | _class_parameters(connection_class)
        with _lock:
            _allowed[connection_class] = allowed
    return allowed


_redacted = redacted


def _bad_url(url: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"invalid lock store URL {_redacted(url)!r}: {why}")


def _check_url(url: str) -> tuple[str, dict[str, str], list[str]]:
    """Check ``url`` as redis-py will read it; return its scheme, its query parameters and
    the names of the other connection arguments it sets (``host``, ``path``, ...)."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed '[' of an IPv6 host
        raise _bad_url(url, str(exc)) from None
    scheme = parts.scheme
    sets: list[str] = []
    # redis-py compares the scheme case-sensitively; urlsplit lowercases it.
    if scheme not in SCHEMES or not url.startswith(f"{scheme}://"):
        raise ConfigurationError(
            f"unsupported lock store URL {_redacted(url)!r}: the scheme must be one of "
            f"{', '.join(s + '://' for s in SCHEMES)}"
        )
    if scheme == "unix":
        if not parts.path:
            raise _bad_url(url, "missing socket path (unix:///path/to/socket[?db=0])")
        sets.append("path")
    else:
        if not parts.hostname:
            raise _bad_url(url, f"missing host ({scheme}://[[user]:password@]host[:port][/db])")
        try:
            port = parts.port
        except ValueError as exc:
            raise _bad_url(url, f"the port must be an integer from 1 to 65535 ({exc})") from None
        if port == 0:
            raise _bad_url(url, "the port must be an integer from 1 to 65535, not 0")
        segments = [segment for segment in unquote(parts.path).split("/") if segment]
        if len(segments) > 1:
            raise _bad_url(url, f"the path must be at most one segment, the db number (/0), got {parts.path!r}")
        # redis-py silently uses db 0 for a path that is not a number: '/l' would be db 0.
        if segments and not (segments[0].isascii() and segments[0].isdigit()):
            raise _bad_url(url, f"the db (the path) must be a non-negative integer, got {segments[0]!r}")
        sets += ["host", *(["port"] if port else []), *(["db"] if segments else [])]
    sets += [name for name in ("username", "password") if getattr(parts, name)]
    query = {name: values[0] for name, values in parse_qs(parts.query).items() if values}
    parsers: Mapping[str, Any] = getattr(redis.connection, "URL_QUERY_ARGUMENT_PARSERS", {})
    for name, value in query.items():
        parser = parsers.get(name)
        if parser is None:
            continue
        try:
            parser(value)
        except (TypeError, ValueError) as exc:
            raise _bad_url(url, f"bad value {value!r} for query parameter {name!r} ({exc})") from None
    return scheme, query, sets


def _hint(name: str, scheme: str) -> str:
    """Why a ``redis.Redis()`` argument is not a ``from_url`` option here."""
    if name == "ssl":
        return "a URL client gets TLS from the scheme: use a rediss:// URL instead of ssl=True"
    if name.startswith("ssl_"):
        return f"ssl_* options apply to a rediss:// URL only, not {scheme}://"
    if name == "unix_socket_path":
        return "use a unix:///path/to/socket URL instead"
    if name == "connection_pool":
        return "a client built from a URL makes its own connection pool"
    return f"it does not apply to a {scheme}:// URL"


def check_redis_options(url: str, options: Mapping[str, Any]) -> None:
    """Check a lock store URL and the redis-py options passed with it; raise
    :class:`~lockaspect.ConfigurationError` for anything redis-py would reject later.

    Call it before building the client: it does no I/O, so a typo fails at construction
    instead of at the first lock.

    Args:
        url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` or
            ``unix:///path/to/socket[?db=0]``. The port must be an integer from 1 to
            65535, the db (path, or ``?db=``) an integer; query parameters must be
            option names that redis-py accepts, with values it can parse.
        options: The keyword arguments for ``redis.Redis.from_url``. Every name must be
            one that redis-py's ``from_url``, its connection pool or the connection class
            of the URL's scheme (or of ``connection_class``, when given) accepts.

    Raises:
        TypeError: ``url`` is not a ``str``.
        ConfigurationError: A malformed URL (unsupported scheme, missing host or socket
            path, bad port or db, unparsable query value), or an option name redis-py
            does not accept: the message names it, suggests the closest allowed name and
            lists all of them. The password of the URL is never shown.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    scheme, query, sets = _check_url(url)
    connection_class = options.get("connection_class")
    if not isinstance(connection_class, type):
        connection_class = _connection_class(scheme)
    allowed = allowed_redis_options(connection_class)
    # Only a connection_class of the caller's can disagree with what the URL sets.
    for name in sets:
        if name not in allowed:
            raise ConfigurationError(
                f"connection_class {connection_class.__name__} does not take {name!r}, which the lock store URL "
                f"{_redacted(url)!r} sets; use a connection class for {scheme}:// URLs"
            )
    for origin, names in (("option", list(options)), ("query parameter", list(query))):
        unknown = [name for name in names if name not in allowed]
        if not unknown:
            continue
        name = unknown[0]
        if name in _redis_init_parameters():
            why = f"it is a redis.Redis() argument that Redis.from_url does not accept here: {_hint(name, scheme)}"
        else:
            why = "redis-py does not accept it"
        more = f" (also unknown: {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else ""
        close = difflib.get_close_matches(name, sorted(allowed), n=1)
        suggestion = f"; did you mean {close[0]!r}?" if close else "."
        raise ConfigurationError(
            f"unknown redis {origin} {name!r} for lock store URL {_redacted(url)!r}{more}: {why}{suggestion} "
            f"Allowed redis options for a {scheme}:// URL: {', '.join(sorted(allowed))}"
        )


def open_redis_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> Any:
    """The store factory of ``redis://``, ``rediss://`` and ``unix://`` (see
    :func:`lockaspect.backends.open_store`): checks the URL and the redis-py options before
    any connection (:func:`check_redis_options`) and the namespace, then builds a
    :class:`~lockaspect.backends.redis.RedisStore`."""
    check_redis_options(url, options)
    if not isinstance(namespace, str) or "{" in namespace or "}" in namespace:
        raise ConfigurationError(f"namespace must be a str without '{{' or '}}', got {namespace!r}")
    from .store import RedisStore

    return RedisStore.from_url(url, namespace=namespace, **options)
