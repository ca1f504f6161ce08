"""The URLs of the Redis topologies with more than one address, checked before any I/O:

* ``redis+cluster://[[user]:password@]host1[:port],host2[:port]...[/0][?option=value...]``
  (Redis Cluster; port 6379 by default; the hosts are startup nodes, any subset will do);
* ``redis+sentinel://[[user]:password@]host1[:port],host2[:port].../<service>[/db][?...]``
  (a master found through Sentinel; port 26379 by default);

and ``rediss+cluster://`` / ``rediss+sentinel://`` for TLS. The user and password are the
data nodes' (the master's and replicas', or the cluster nodes'); sentinels with a password
of their own take ``sentinel_kwargs={"password": ...}``. An IPv6 host is written in brackets
(``[::1]:7000``). Query parameters are the connection options redis-py reads from its own
URLs (``socket_timeout``, ``health_check_interval``, ...).

:func:`parse_topology_url` reads one; :func:`check_topology_options` checks the keyword
options given with it. Neither does any I/O.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qs, unquote

import redis.connection

from ...errors import ConfigurationError
from ..base import redacted
from .options import allowed_redis_options

__all__ = [
    "CLUSTER_SCHEMES",
    "SENTINEL_SCHEMES",
    "TopologyURL",
    "check_topology_options",
    "parse_topology_url",
]

CLUSTER_SCHEMES: Final = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES: Final = ("redis+sentinel", "rediss+sentinel")

_DEFAULT_PORT: Final = {"cluster": 6379, "sentinel": 26379}

#: RedisCluster arguments a lock store accepts besides the connection options.
_CLUSTER_OPTIONS: Final = frozenset(
    {
        "require_full_coverage",
        "reinitialize_steps",
        "dynamic_startup_nodes",
        "address_remap",
        "max_connections",
    }
)
#: Sentinel arguments a lock store accepts besides the master's connection options.
_SENTINEL_OPTIONS: Final = frozenset({"sentinel_kwargs", "min_other_sentinels", "force_master_ip", "max_connections"})

#: Options that a topology URL or the store decides, with why.
_REFUSED: Final = {
    "read_from_replicas": "locks are read and written on primaries only (a replica may lag behind)",
    "load_balancing_strategy": "locks are read and written on primaries only (a replica may lag behind)",
    "host": "the hosts are in the URL",
    "port": "the ports are in the URL",
    "startup_nodes": "the startup nodes are the URL's hosts",
    "url": "the URL is the first argument",
    "decode_responses": "the store reads raw replies",
    "connection_pool": "a client built from a URL makes its own connection pools",
    "ssl": "a URL client gets TLS from the scheme: use rediss+cluster:// or rediss+sentinel://",
    "unix_socket_path": "the topologies are reached over TCP",
}


@dataclass(frozen=True)
class TopologyURL:
    """A parsed topology URL (see the module's docstring)."""

    kind: str  # "cluster" or "sentinel"
    tls: bool
    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    service: str | None = None
    db: int = 0
    query: dict[str, Any] = field(default_factory=dict)

    def connection_options(self) -> dict[str, Any]:
        """The data nodes' connection options the URL sets (credentials, query, db)."""
        options: dict[str, Any] = dict(self.query)
        if self.username is not None:
            options["username"] = self.username
        if self.password is not None:
            options["password"] = self.password
        if self.kind == "sentinel":
            options["db"] = self.db
        return options


def _bad(url: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"invalid lock store URL {redacted(url)!r}: {why}")


def _host(url: str, text: str, kind: str) -> tuple[str, int]:
    """``host[:port]`` or ``[v6]:port`` as a (host, port) pair."""
    port_text = ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _bad(url, f"unclosed '[' in the host {text!r}")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise _bad(url, f"expected ':port' after {text[: end + 1]!r}")
            port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
        if ":" in port_text:
            raise _bad(url, f"write an IPv6 host in brackets, as in [::1]:7000 (got {text!r})")
    if not host:
        raise _bad(url, f"empty host in {text!r} (the hosts are host[:port] separated by commas)")
    if not port_text:
        return host, _DEFAULT_PORT[kind]
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise _bad(url, f"the port must be an integer from 1 to 65535, got {port_text!r} in {text!r}")
    return host, int(port_text)


def parse_topology_url(url: str) -> TopologyURL:
    """Read a ``redis+cluster://`` or ``redis+sentinel://`` URL (or a ``rediss+`` one).

    Raises:
        TypeError: ``url`` is not a ``str``.
        ConfigurationError: an unknown scheme, no host, a bad port, an empty host, a sentinel
            URL without a service name, a db that is not an integer (or not 0 on a cluster),
            a query parameter redis-py does not read from URLs or cannot parse. The password
            is never shown.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        raise ConfigurationError(
            f"unsupported lock store URL {redacted(url)!r}: the scheme must be one of "
            f"{', '.join(s + '://' for s in CLUSTER_SCHEMES + SENTINEL_SCHEMES)}"
        )
    kind = "cluster" if scheme in CLUSTER_SCHEMES else "sentinel"
    username = password = None
    if "@" in rest:  # the last '@' ends the user info: a password may hold '/', '?' or '#'
        userinfo, _, rest = rest.rpartition("@")
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    rest = rest.partition("#")[0]
    rest, _, query_text = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if not netloc:
        shape = "host1:26379,host2:26379/<service>" if kind == "sentinel" else "host1:7000,host2:7001"
        raise _bad(url, f"missing host ({scheme}://[[user]:password@]{shape})")
    hosts = tuple(_host(url, part, kind) for part in netloc.split(","))
    segments = [unquote(segment) for segment in path.split("/")] if slash else []
    if segments and segments[-1] == "":
        segments.pop()  # a trailing slash
    service = None
    if kind == "sentinel":
        if not segments or not segments[0]:
            raise _bad(url, "missing the service name: redis+sentinel://host1:26379,host2:26379/<service>[/db]")
        service = segments.pop(0)
    if len(segments) > 1 or (segments and not (segments[0].isascii() and segments[0].isdigit())):
        what = "/<service>[/db]" if kind == "sentinel" else "[/0]"
        raise _bad(url, f"the path must be {what}, with the db a non-negative integer, got {path!r}")
    query = _query(url, query_text)
    db = int(segments[0]) if segments else int(query.pop("db", 0))
    if kind == "cluster" and db != 0:
        raise _bad(url, f"Redis Cluster has only database 0, got {db}")
    return TopologyURL(kind, scheme.startswith("rediss"), hosts, username, password, service, db, query)


def _query(url: str, text: str) -> dict[str, Any]:
    parsers: Mapping[str, Any] = getattr(redis.connection, "URL_QUERY_ARGUMENT_PARSERS", {})
    parsed: dict[str, Any] = {}
    for name, values in parse_qs(text, keep_blank_values=True).items():
        parser = parsers.get(name)
        if parser is None:
            close = difflib.get_close_matches(name, sorted(parsers), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise _bad(
                url,
                f"unknown query parameter {name!r}{hint} (a URL takes {', '.join(sorted(parsers))}; "
                "pass other options as keyword arguments)",
            )
        try:
            parsed[name] = parser(values[-1])
        except (TypeError, ValueError) as exc:
            raise _bad(url, f"bad value {values[-1]!r} for query parameter {name!r} ({exc})") from None
    return parsed


def _parameters(function: Any) -> frozenset[str]:
    return frozenset(
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and name != "self"
    )


def allowed_topology_options(kind: str, tls: bool) -> frozenset[str]:
    """The keyword options a ``kind`` ("cluster" or "sentinel") store URL accepts."""
    connection = redis.connection.SSLConnection if tls else redis.connection.Connection
    own = _CLUSTER_OPTIONS if kind == "cluster" else _SENTINEL_OPTIONS
    names = (allowed_redis_options(connection) | own) - frozenset(_REFUSED)
    if kind == "cluster":
        names -= {"db", "single_connection_client", "connection_class"}
    return names


def check_topology_options(url: str, parsed: TopologyURL, options: Mapping[str, Any]) -> None:
    """Raise :class:`~lockaspect.ConfigurationError` for an option the topology's store does
    not take (the message says why, or suggests the closest name and lists them all)."""
    allowed = allowed_topology_options(parsed.kind, parsed.tls)
    for name, value in options.items():
        if name in allowed:
            if name == "sentinel_kwargs" and value is not None and not isinstance(value, Mapping):
                raise ConfigurationError(f"sentinel_kwargs must be a dict of connection options, got {value!r}")
            continue
        why = _REFUSED.get(name)
        if why is None and name.startswith("ssl_") and not parsed.tls:
            why = "ssl_* options apply to a rediss+ URL only"
        if why is None and name == "db":
            why = "Redis Cluster has only database 0"
        if why is not None:
            raise ConfigurationError(f"option {name!r} is not taken with lock store URL {redacted(url)!r}: {why}")
        close = difflib.get_close_matches(name, sorted(allowed), n=1)
        suggestion = f"; did you mean {close[0]!r}?" if close else "."
        raise ConfigurationError(
            f"unknown option {name!r} for lock store URL {redacted(url)!r}{suggestion} "
            f"Allowed: {', '.join(sorted(allowed))}"
        )
