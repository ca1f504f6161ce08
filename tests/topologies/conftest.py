"""Fixtures of the topology fault tests: a cluster or sentinel set of the test's own (a fault
changes it), a key and namespace of the test's own, and clients on a topology's URL that are
closed after the test."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lockaspect import LockClient


@pytest.fixture
def key() -> str:
    return f"fault-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def namespace() -> str:
    return f"tf-{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def make(namespace: str) -> Iterator[Callable[..., LockClient]]:
    """``make(url, **options)``: a LockClient in the test's namespace (1 s watchdog lease
    renewed every 0.5 s, 50 ms tick unless given), closed after the test."""
    made: list[LockClient] = []

    def make(url: str, **options: Any) -> LockClient:
        options.setdefault("namespace", namespace)
        options.setdefault("watchdog_lease", 1.0)
        options.setdefault("tick", 0.05)
        options.setdefault("delay_weight", 0.5)
        client = LockClient.from_url(url, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
