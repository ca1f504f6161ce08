"""The redis-py clients lockaspect builds (they never retry a command on their own), and the
one place a driver error becomes a :class:`~lockaspect.BackendError`."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from ...errors import BackendError

__all__ = ["DEFAULT_SOCKET_TIMEOUT", "error_key", "map_redis_error", "no_retry_async_client", "no_retry_client"]

#: Default socket (and connect) timeout in seconds: a renewal that hangs times out and is
#: retried within the default renewal margin (a 30 s lease renewed at 0.9 leaves 3 s).
DEFAULT_SOCKET_TIMEOUT = 2.0


#: Errors that may pass. redis-py maps LOADING, READONLY, TRYAGAIN, CLUSTERDOWN and MASTERDOWN
#: replies to these classes and drops the prefix from the message, so they are told by class.
_TRANSIENT = (
    redis.ConnectionError,  # also BusyLoadingError (LOADING) and Sentinel's MasterNotFoundError
    redis.TimeoutError,
    OSError,
    ClusterError,  # also ClusterDownError (CLUSTERDOWN) and MasterDownError (MASTERDOWN)
    AskError,  # also MovedError: a redirection left over
    TryAgainError,  # a Redis Cluster slot being migrated
    ReadOnlyError,  # a replica: the master changed
    SlotNotCoveredError,  # no node serves the slot right now (a failover)
)


def error_key(key: Any) -> str | None:
    """The key an error names: the key, the first of a multi-key call's, or none."""
    if key is None or isinstance(key, str):
        return key
    return str(key[0])


def map_redis_error(exc: BaseException, key: str | None, action: str) -> BackendError:
    """The one place that turns a driver error into a :class:`BackendError`."""
    what = f" for {key!r}" if key is not None else ""
    # Connection failures and timeouts may pass (a restart, a failover); an error reply will
    # not, but for the server states that end by themselves (BUSY: a script running too long).
    transient = isinstance(exc, _TRANSIENT) or (
        isinstance(exc, ResponseError)
        and str(exc).startswith(("LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "READONLY", "CLUSTERDOWN"))
    )
    hint = ""
    cause = exc.__context__
    if cause is not None and ("handshake" in str(cause) or "SSL" in type(cause).__name__ or "[SSL" in str(cause)):
        hint = f" ({cause}: the TLS handshake failed; for a server without TLS use redis://, not rediss://)"
    return BackendError(f"{action}{what} failed: {type(exc).__name__}: {exc}{hint}", key=key, transient=transient)


def no_retry_client(url: str, **options: Any) -> redis.Redis:
    """A redis-py client that never retries a command on its own.

    redis-py retries on connection errors and timeouts by default. A lock command that
    timed out may still have run, so repeating it is the core's decision, not the
    driver's. Short default timeouts (2 s) keep a dead or hung server from hanging callers.
    """
    options.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
    options.setdefault("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT)
    options.setdefault("retry", Retry(backoff=NoBackoff(), retries=0))
    options["decode_responses"] = False
    return redis.Redis.from_url(url, **options)


def no_retry_async_client(url: str, **options: Any) -> Any:
    """The ``redis.asyncio`` twin of :func:`no_retry_client`."""
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry

    options.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
    options.setdefault("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT)
    options["retry"] = AsyncRetry(backoff=NoBackoff(), retries=0)
    options["decode_responses"] = False
    return redis.asyncio.Redis.from_url(url, **options)
