"""Lock stores, and the registry that opens one from a URL.

:mod:`lockaspect.backends.base` defines what a store must do; :mod:`lockaspect.backends.redis`
is the Redis/Valkey implementation, :mod:`lockaspect.backends.memory` the in-process one (the
reference semantics).

:func:`open_store` picks a store factory by the URL's scheme. Factories come from the
entry-point group ``lockaspect.stores`` (a package that ships a store declares one under its
scheme, e.g. ``redis = "lockaspect.backends.redis.options:open_redis_store"``), loaded lazily
on first use (the built-in stores are also known by name, so a source tree that was never
installed still opens them),
and from :func:`register_store` for code that registers one at run time. A factory is called
as ``factory(url, namespace=namespace, **options)`` and returns a
:class:`~lockaspect.backends.base.Store`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ..errors import ConfigurationError
from .base import Store, redacted

__all__ = [
    "StoreFactory",
    "open_redlock",
    "open_store",
    "register_store",
    "registered_schemes",
]

#: What opens a store: ``factory(url, namespace=..., **options) -> Store``.
StoreFactory = Callable[..., Store]

#: The entry-point group store factories are registered under, by URL scheme.
ENTRY_POINT_GROUP = "lockaspect.stores"

_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")

_lock = threading.Lock()
_factories: dict[str, StoreFactory | EntryPoint] = {}  # scheme -> factory, or its unloaded EntryPoint
_discovered = False


_REDLOCK = "lockaspect.backends.redis.redlock:open_redlock_store"
_TOPOLOGY = "lockaspect.backends.redis._topology_clients:open_topology_store"

#: The stores shipped with lockaspect, by scheme (as their entry points name them).
_BUILT_IN = {
    "redis": "lockaspect.backends.redis.options:open_redis_store",
    "rediss": "lockaspect.backends.redis.options:open_redis_store",
    "unix": "lockaspect.backends.redis.options:open_redis_store",
    "redis+cluster": _TOPOLOGY,
    "rediss+cluster": _TOPOLOGY,
    "redis+sentinel": _TOPOLOGY,
    "rediss+sentinel": _TOPOLOGY,
    "memory": "lockaspect.backends.memory:open_memory_store",
    "sqlite": "lockaspect.backends.sql.table:open_sqlite_store",
    "postgresql+table": "lockaspect.backends.sql.table:open_table_store",
    "postgres+table": "lockaspect.backends.sql.table:open_table_store",
    "postgresql": "lockaspect.backends.sql.advisory:open_postgres_store",
    "postgres": "lockaspect.backends.sql.advisory:open_postgres_store",
    "zookeeper": "lockaspect.backends.zookeeper:open_zookeeper_store",
}


def _discover() -> None:
    """Read the ``lockaspect.stores`` entry points once (loading each only when used);
    factories registered at run time win over entry points of the same scheme, which win over
    the built-in names."""
    global _discovered
    with _lock:
        if _discovered:
            return
        for point in entry_points(group=ENTRY_POINT_GROUP):
            _factories.setdefault(point.name, point)
        for scheme, value in _BUILT_IN.items():
            _factories.setdefault(scheme, EntryPoint(scheme, value, ENTRY_POINT_GROUP))
        _discovered = True


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Open ``scheme://`` URLs with ``factory`` from now on (replacing any factory of that
    scheme, also one from an entry point)."""
    if not isinstance(scheme, str) or not scheme or "://" in scheme or scheme != scheme.lower():
        raise ConfigurationError(f"a store scheme is a lower-case name like 'redis', got {scheme!r}")
    if not callable(factory):
        raise TypeError(f"a store factory must be callable, got {type(factory).__name__}")
    _discover()
    with _lock:
        _factories[scheme] = factory


def registered_schemes() -> list[str]:
    """The schemes :func:`open_store` knows, sorted."""
    _discover()
    with _lock:
        return sorted(_factories)


def _factory(scheme: str) -> StoreFactory | None:
    _discover()
    with _lock:
        found = _factories.get(scheme)
    if not isinstance(found, EntryPoint):
        return found
    loaded = found.load()  # an EntryPoint: import its factory now, once
    if not callable(loaded):
        raise ConfigurationError(f"the store entry point {found.value!r} of {scheme}:// is not callable")
    with _lock:
        if _factories.get(scheme) is found:
            _factories[scheme] = loaded
        factory = _factories[scheme]
    assert not isinstance(factory, EntryPoint)
    return factory


def open_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> Store:
    """The store ``url`` names, opened by the factory registered for its scheme.

    Args:
        url: ``redis://``, ``rediss://`` and ``unix://`` URLs (a Redis or Valkey server, see
            :meth:`~lockaspect.LockClient.from_url`), ``memory://`` or ``memory://<name>``
            (this process's memory), or any scheme a package registered.
        namespace: Prefix of every key the store writes.
        options: Passed to the factory (for Redis: redis-py's options).

    Raises:
        TypeError: ``url`` is not a ``str``.
        ConfigurationError: an unknown scheme (the message lists the registered ones), or
            whatever the factory refuses (a malformed URL, an unknown option).
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    # Not urlsplit: a topology URL's netloc (h1:7000,h2:7001) is not one host and port.
    scheme, sep, _ = url.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        scheme = ""
    # Schemes compare case-sensitively (as redis-py does); urlsplit lowercases them.
    factory = _factory(scheme) if scheme and url.startswith(f"{scheme}://") else None
    if factory is None:
        schemes = ", ".join(name + "://" for name in registered_schemes())
        raise ConfigurationError(f"unsupported lock store URL {redacted(url)!r}: the scheme must be one of {schemes}")
    return factory(url, namespace=namespace, **options)


def open_redlock(urls: object, *, namespace: str = "lockaspect:", **options: Any) -> Store:
    """A RedLock store over several Redis servers (see :meth:`~lockaspect.LockClient.from_urls`);
    loaded by name, as the built-in stores are."""
    factory = EntryPoint("redlock", _REDLOCK, ENTRY_POINT_GROUP).load()
    store: Store = factory(urls, namespace=namespace, **options)
    return store
