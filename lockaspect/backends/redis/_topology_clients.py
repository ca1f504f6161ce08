"""The redis-py clients of the Cluster and Sentinel stores, built from a parsed topology URL
(:mod:`._topology`) or from the user's own client: none retries a command by itself (a lock
command that timed out may have run; retrying is the core's decision), and socket timeouts
default to :data:`~._client.DEFAULT_SOCKET_TIMEOUT`. Also the store factories registered
for the ``redis+cluster``, ``redis+sentinel`` and ``rediss+`` schemes."""

from __future__ import annotations

import inspect
from typing import Any

import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from ...errors import BackendError, ConfigurationError
from ..base import redacted
from ._client import DEFAULT_SOCKET_TIMEOUT
from ._topology import TopologyURL, check_topology_options, parse_topology_url

__all__ = [
    "async_cluster_like",
    "async_sentinel_like",
    "open_cluster_store",
    "open_sentinel_store",
    "open_topology_store",
]


def _no_retry(options: dict[str, Any], asyncio: bool) -> dict[str, Any]:
    options = dict(options)
    options.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
    options.setdefault("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT)
    if asyncio:
        from redis.asyncio.retry import Retry as AsyncRetry

        options["retry"] = AsyncRetry(backoff=NoBackoff(), retries=0)
    else:
        options["retry"] = Retry(backoff=NoBackoff(), retries=0)
    options["decode_responses"] = False
    return options


# -- Redis Cluster --


def _cluster(parsed: TopologyURL, options: dict[str, Any], asyncio: bool) -> Any:
    module: Any = redis.asyncio.cluster if asyncio else redis.cluster
    kwargs = _no_retry({**parsed.connection_options(), **options}, asyncio)
    if parsed.tls:
        kwargs["ssl"] = True
    nodes = [module.ClusterNode(host, port) for host, port in parsed.hosts]
    return module.RedisCluster(startup_nodes=nodes, **kwargs)


def _accepted(function: Any, options: dict[str, Any]) -> dict[str, Any]:
    names = inspect.signature(function).parameters
    return {name: value for name, value in options.items() if name in names}


def async_cluster_like(cluster: Any) -> Any:
    """A ``redis.asyncio`` RedisCluster on the startup nodes and connection options of the
    sync ``cluster`` (the options the asyncio client takes)."""
    manager = cluster.nodes_manager
    options = {
        name: value
        for name, value in manager.connection_kwargs.items()
        if name not in ("host", "port", "retry", "redis_connect_func", "connection_class", "connection_pool")
    }
    options = _accepted(redis.asyncio.RedisCluster.__init__, _no_retry(options, asyncio=True))
    nodes = [redis.asyncio.cluster.ClusterNode(node.host, node.port) for node in manager.startup_nodes.values()]
    return redis.asyncio.RedisCluster(startup_nodes=nodes, **options)


def open_cluster_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> Any:
    """The store factory of ``redis+cluster://`` and ``rediss+cluster://`` (see
    :func:`lockaspect.backends.open_store`): checks the URL and options before any I/O."""
    parsed = _checked(url, "cluster", namespace, options)
    from .cluster import ClusterStore

    try:
        cluster = _cluster(parsed, options, asyncio=False)
    except (redis.RedisError, RedisClusterException, OSError) as exc:
        # redis-py's cluster client reads the slot map as it is built.
        raise BackendError(
            f"cannot reach the Redis Cluster of {redacted(url)!r}: {type(exc).__name__}: {exc}", transient=True
        ) from exc
    return ClusterStore(
        cluster,
        namespace=namespace,
        twin=lambda: _cluster(parsed, options, asyncio=True),
        describe=url,
    )


# -- Sentinel --


def _sentinel_master(parsed: TopologyURL, options: dict[str, Any], asyncio: bool) -> Any:
    module: Any = redis.asyncio.sentinel if asyncio else redis.sentinel
    options = dict(options)
    sentinel_kwargs = dict(options.pop("sentinel_kwargs", None) or {})
    sentinel_kwargs.setdefault("socket_timeout", options.get("socket_timeout", DEFAULT_SOCKET_TIMEOUT))
    sentinel_kwargs.setdefault("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT)
    if parsed.tls:
        sentinel_kwargs.setdefault("ssl", True)
    own = {name: options.pop(name) for name in ("min_other_sentinels", "force_master_ip") if name in options}
    kwargs = _no_retry({**parsed.connection_options(), **options}, asyncio)
    if parsed.tls:
        kwargs["ssl"] = True
    sentinel = module.Sentinel(list(parsed.hosts), sentinel_kwargs=sentinel_kwargs, **own)
    client_class = redis.asyncio.Redis if asyncio else redis.Redis
    return sentinel.master_for(parsed.service, redis_class=client_class, **kwargs)


def async_sentinel_like(sentinel: Any, service: str, options: dict[str, Any]) -> Any:
    """The asyncio twin of ``sentinel.master_for(service, **options)``: a ``redis.asyncio``
    master client through the same sentinels with the same settings."""
    hosts = [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs.get("port", 26379))
        for s in sentinel.sentinels
    ]
    sentinel_kwargs = {k: v for k, v in (sentinel.sentinel_kwargs or {}).items() if k != "retry"}
    twin = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        hosts,
        min_other_sentinels=sentinel.min_other_sentinels,
        sentinel_kwargs=sentinel_kwargs,
        **{k: v for k, v in sentinel.connection_kwargs.items() if k != "retry"},
    )
    return twin.master_for(service, redis_class=redis.asyncio.Redis, **_no_retry(options, asyncio=True))


def open_sentinel_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> Any:
    """The store factory of ``redis+sentinel://`` and ``rediss+sentinel://`` (see
    :func:`lockaspect.backends.open_store`): checks the URL and options before any I/O."""
    parsed = _checked(url, "sentinel", namespace, options)
    from .sentinel import SentinelStore

    assert parsed.service is not None
    return SentinelStore(
        _sentinel_master(parsed, options, asyncio=False),
        service=parsed.service,
        namespace=namespace,
        twin=lambda: _sentinel_master(parsed, options, asyncio=True),
        describe=url,
        own_sentinels=True,
    )


def open_topology_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> Any:
    """The store of a ``redis+cluster``/``redis+sentinel`` URL (or ``rediss+``)."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    if parse_topology_url(url).kind == "cluster":
        return open_cluster_store(url, namespace=namespace, **options)
    return open_sentinel_store(url, namespace=namespace, **options)


def _checked(url: str, kind: str, namespace: object, options: dict[str, Any]) -> TopologyURL:
    """``url`` parsed, after checking that it is a ``kind`` URL and the namespace and options
    are ones its store takes (no I/O)."""
    parsed = parse_topology_url(url)
    if parsed.kind != kind:
        raise ConfigurationError(f"not a Redis {kind} URL: {redacted(url)!r}")
    check_topology_options(url, parsed, options)
    if not isinstance(namespace, str) or "{" in namespace or "}" in namespace:
        raise ConfigurationError(f"namespace must be a str without '{{' or '}}', got {namespace!r}")
    return parsed
