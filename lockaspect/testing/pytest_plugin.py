"""pytest fixtures for code that uses lockaspect (registered as a pytest plugin).

``lock_server``: a real Redis-compatible server for the whole session
(see :class:`lockaspect.testing.LockServer`).

``lock_client``: a :class:`~lockaspect.LockClient` on it, with a namespace of its own per
test so tests never see each other's locks; closed after the test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from ..client import LockClient
from .server import LockServer


@pytest.fixture(scope="session")
def lock_server() -> Iterator[LockServer]:
    """A throwaway server for the test session."""
    with LockServer() as server:
        yield server


@pytest.fixture
def lock_client(lock_server: LockServer) -> Iterator[LockClient]:
    """A client on ``lock_server`` with a fresh namespace."""
    client = LockClient.from_url(lock_server.url, namespace=f"test-{uuid.uuid4().hex[:12]}:")
    try:
        yield client
    finally:
        client.close()
