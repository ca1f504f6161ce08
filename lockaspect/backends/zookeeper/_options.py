"""``zookeeper://`` URLs and the ZooKeeper store's options, checked before any connection
exists (no I/O here).

``zookeeper://[user:password@]host1[:port][,host2[:port]...][/chroot][?option=value&...]``:
the ensemble (port 2181 by default), an optional chroot every path lives under, and the
store's options in the query string or as keywords (keywords win):

* ``session_timeout``: seconds the server keeps the session (and so the locks) of a client it
  no longer hears from; the server clamps it to its ``[minSessionTimeout,
  maxSessionTimeout]`` (by default 2 and 20 ticks: 4 s to 40 s). Default 10.
* ``connect_timeout``: seconds to wait for the first connection. Default 10.
* ``request_timeout``: seconds an operation may wait for its reply (across a reconnection)
  before it fails as a transient :class:`~lockaspect.BackendError`. Default: the session
  timeout.
* ``owner_info``: write JSON owner metadata (host, pid, thread or task, acquired_at) into each
  contender node. Default true.
* ``containers``: make each key's node a container node, which the server removes after its
  last child (ZooKeeper >= 3.5.1). With ``false`` (for older servers) the key's node is a
  plain node that each release tries to delete (refused, harmlessly, while others queue).
  Default true.

``user:password`` adds ZooKeeper ``digest`` authentication to the session.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qsl, unquote

from ...errors import ConfigurationError
from ..base import redacted

__all__ = ["SCHEME", "Settings", "parse_settings"]

SCHEME: Final = "zookeeper"

DEFAULTS: Final[dict[str, Any]] = {
    "session_timeout": 10.0,
    "connect_timeout": 10.0,
    "request_timeout": None,
    "owner_info": True,
    "containers": True,
}


@dataclass(frozen=True)
class Settings:
    """A checked URL and options.

    Attributes:
        hosts: ``host:port,host:port`` as kazoo takes it (without the chroot).
        chroot: The chroot path (``""``: none).
        auth: ``("digest", "user:password")`` or ``None``.
        shown: The URL with its password redacted (errors, reprs).
        namespace: The prefix of every key; its node is ``/<namespace without ':'>``.
        session_timeout, connect_timeout, request_timeout: Seconds (see the module docstring).
        owner_info: Write owner metadata into contender nodes.
        containers: Key nodes are containers (else plain nodes deleted after the last release).
    """

    hosts: str
    chroot: str
    auth: tuple[str, str] | None
    shown: str
    namespace: str
    session_timeout: float
    connect_timeout: float
    request_timeout: float
    owner_info: bool
    containers: bool = True


def _seconds(name: str, value: object, shown: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigurationError(f"{shown}: {name} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ConfigurationError(f"{shown}: {name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _flag(name: str, value: object, shown: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigurationError(f"{shown}: {name} must be true or false, got {value!r}")


def _host(part: str, shown: str) -> str:
    host, port = part, "2181"
    if part.startswith("["):  # [ipv6]:port
        end = part.find("]")
        if end < 0:
            raise ConfigurationError(f"{shown}: bad host {part!r}")
        host, rest = part[: end + 1], part[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigurationError(f"{shown}: bad host {part!r}")
            port = rest[1:]
    elif ":" in part:
        host, port = part.rsplit(":", 1)
    if not host or any(c in host for c in " /?#@"):
        raise ConfigurationError(f"{shown}: bad host {part!r} (expected host:port)")
    if not (port.isascii() and port.isdigit()) or not (0 < int(port) < 65536):
        raise ConfigurationError(f"{shown}: bad port in {part!r} (1-65535)")
    return f"{host}:{int(port)}"


def _split_userinfo(rest: str) -> tuple[str, str, str]:
    """``user:password``, ``@`` and the rest, or ``("", "", rest)``: the userinfo ends at the
    last ``@`` (a password may hold ``/``, ``?`` or ``#``; host names and ports cannot hold
    ``@``)."""
    userinfo, at, after = rest.rpartition("@")
    if not at:
        return "", "", rest
    return userinfo, at, after


def _redacted(url: str) -> str:
    """``url`` with its password replaced by ``***`` (found as :func:`parse_settings` finds it)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, after = _split_userinfo(rest)
    if not sep or not at or ":" not in userinfo:
        return redacted(url)
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{after}"


def parse_settings(url: object, namespace: object, options: dict[str, Any]) -> Settings:
    """Check ``url`` and ``options`` (no I/O).

    Raises:
        TypeError: ``url`` is not a ``str``.
        ConfigurationError: anything else that is wrong, naming it (the password redacted).
    """
    if not isinstance(url, str):
        raise TypeError(f"a zookeeper:// URL must be a str, got {type(url).__name__}")
    shown = _redacted(url)
    if not isinstance(namespace, str):
        raise ConfigurationError(f"namespace must be a str, got {namespace!r}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != SCHEME:
        raise ConfigurationError(f"{shown}: not a zookeeper:// URL")
    userinfo, at, rest = _split_userinfo(rest)
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise ConfigurationError(f"{shown}: a zookeeper:// URL has no #fragment")
    rest, _, query = rest.partition("?")
    hostlist, slash, path = rest.partition("/")
    auth = None
    if at:
        user, colon, password = userinfo.partition(":")
        if not user or not colon:
            raise ConfigurationError(f"{shown}: credentials must be user:password (ZooKeeper digest auth)")
        auth = ("digest", f"{unquote(user)}:{unquote(password)}")
    if not hostlist:
        raise ConfigurationError(f"{shown}: no host (zookeeper://host:2181[,host2:2181]/chroot)")
    hosts = ",".join(_host(part, shown) for part in hostlist.split(","))
    chroot = ""
    if slash and path.strip("/"):
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if any(p in ("", ".", "..") or "/" in p or "\x00" in p for p in parts):
            raise ConfigurationError(f"{shown}: bad chroot path /{path}")
        chroot = "/" + "/".join(parts)
    merged: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in DEFAULTS:
            raise ConfigurationError(f"{shown}: unknown option {name!r} (known: {', '.join(sorted(DEFAULTS))})")
        merged[name] = value
    for name, value in options.items():
        if name not in DEFAULTS:
            raise ConfigurationError(f"{shown}: unknown option {name!r} (known: {', '.join(sorted(DEFAULTS))})")
        merged[name] = value
    values = {**DEFAULTS, **merged}
    session = _seconds("session_timeout", values["session_timeout"], shown)
    connect = _seconds("connect_timeout", values["connect_timeout"], shown)
    request = (
        session if values["request_timeout"] is None else _seconds("request_timeout", values["request_timeout"], shown)
    )
    return Settings(
        hosts=hosts,
        chroot=chroot,
        auth=auth,
        shown=shown,
        namespace=namespace,
        session_timeout=session,
        connect_timeout=connect,
        request_timeout=request,
        owner_info=_flag("owner_info", values["owner_info"], shown),
        containers=_flag("containers", values["containers"], shown),
    )
