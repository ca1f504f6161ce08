"""lockaspect's errors survive pickling (a process pool, a Celery result with the pickle
serializer): the class, the message and every attribute; a lost lease's ``lease`` (this
process's object) becomes ``None``."""

from __future__ import annotations

import pickle

import pytest

from lockaspect import (
    BackendError,
    ConfigurationError,
    KeyTemplateError,
    LockError,
    LockLost,
    LockNotAcquired,
    NotReplicated,
)


@pytest.mark.parametrize(
    "error",
    [
        LockError("m", key="k"),
        LockNotAcquired("busy", key="k", waited=1.5, holder_ttl=2.0),
        LockLost("lost", key="k", reason="expired", result=3),
        KeyTemplateError("bad", template="a:<b", position=2, expression="b"),
        ConfigurationError("conf", key="k"),
        BackendError("down", key="k", transient=True),
        NotReplicated("few", key="k", replicas=0, wanted=1),
    ],
    ids=lambda error: type(error).__name__,
)
def test_an_error_pickles_with_its_attributes(error: LockError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.__dict__ == error.__dict__


def test_a_lost_leases_lease_does_not_travel() -> None:
    lease = object()  # stands for this process's Lease (its lock, its engine)
    copy = pickle.loads(pickle.dumps(LockLost("lost", key="k", reason="not-owner", lease=lease)))  # type: ignore[arg-type]
    assert copy.lease is None
    assert copy.reason == "not-owner"
