"""Fixtures of the ``lockaspect`` command's tests: the session server (``lock_server``), a
fresh namespace per test (``namespace``) and clients on it (``make_client``) come from the
root conftest."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lockaspect import LockClient


@pytest.fixture
def owner_records(make_client: Callable[..., LockClient]) -> bool:
    """Whether the session server's store records who holds a lock (host, pid, ...): the
    Redis store's owner records land with issue 13; until then describe() lists holders it
    cannot name, and the assertions on host and pid are expected to fail (xfail)."""
    client = make_client()
    lease = client.acquire("owner-records-probe")
    try:
        info = client.describe("owner-records-probe")
    finally:
        lease.release()
    return info is not None and bool(info.holders) and info.holders[0].host is not None
