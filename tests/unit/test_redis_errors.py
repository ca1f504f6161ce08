"""How driver errors become BackendErrors (lockaspect.backends.redis.map_redis_error): which may
pass (transient, retried by a waiting acquire) and which will not."""

from __future__ import annotations

import pytest
import redis
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)

from lockaspect.backends.redis import map_redis_error


@pytest.mark.parametrize(
    "exc",
    [
        redis.ConnectionError("refused"),
        redis.TimeoutError("timed out"),
        BusyLoadingError("Redis is loading the dataset in memory"),
        # redis-py drops the reply's prefix from these: they are told by class
        TryAgainError("Multiple keys request during rehashing of slot"),
        ReadOnlyError("You can't write against a read only replica."),
        ClusterDownError("The cluster is down"),
        MasterDownError("Link with MASTER is down"),
        MovedError("3999 127.0.0.1:7001"),
        AskError("3999 127.0.0.1:7001"),
        SlotNotCoveredError("Slot 3999 not covered"),
        ResponseError("BUSY Redis is busy running a script"),
    ],
)
def test_transient(exc: BaseException) -> None:
    error = map_redis_error(exc, "k", "acquire")
    assert error.transient
    assert error.key == "k"


@pytest.mark.parametrize(
    "exc",
    [
        ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        NoScriptError("No matching script"),
        RedisClusterException("EVALSHA - all keys must map to the same key slot"),
        ResponseError("NOPERM this user has no permissions to run the 'evalsha' command"),
    ],
)
def test_not_transient(exc: BaseException) -> None:
    assert not map_redis_error(exc, "k", "acquire").transient
