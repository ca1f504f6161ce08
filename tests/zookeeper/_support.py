"""What the ZooKeeper store's tests share: a bounded wait, and views of the tree and of the
server's watches (read with a raw kazoo client and four-letter commands)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from lockaspect.testing import ZooKeeperServer

kazoo_exceptions = pytest.importorskip("kazoo.exceptions")

BOUND = 30.0  # seconds: how long a broken store may hang a test (never a timing threshold)


def until(condition: Callable[[], object], what: str, bound: float = BOUND) -> None:
    """Wait for a condition only the server (or another thread) can tell, bounded."""
    pause = threading.Event()
    deadline = time.monotonic() + bound
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        pause.wait(0.01)


def parent_of(namespace: str, key: str, chroot: str = "") -> str:
    """The container node of ``key`` (the encoded namespaced key under the namespace's node)."""
    return f"{chroot}/{namespace.rstrip(':')}/{namespace}{key}"


def contenders(raw: Any, namespace: str, key: str) -> list[str]:
    """The contender nodes of ``key``, in queue order (``[]`` once the parent is gone)."""
    try:
        children = raw.get_children(parent_of(namespace, key))
    except kazoo_exceptions.NoNodeError:
        return []
    return sorted(children, key=lambda name: int(name.rsplit("-", 1)[1]))


def watches_by_session(server: ZooKeeperServer) -> dict[int, list[str]]:
    """The server's watches (``wchc``): session id -> watched paths."""
    found: dict[int, list[str]] = {}
    current = None
    for line in server.four_letter("wchc").splitlines():
        if line.startswith("0x"):
            current = int(line, 16)
            found[current] = []
        elif line.strip() and current is not None:
            found[current].append(line.strip())
    return found


def waiting(server: ZooKeeperServer, raw: Any, namespace: str, key: str) -> list[int]:
    """The sessions queued on ``key`` as waiters, in queue order: each owns a contender node
    and watches another node of the key (a try's node, made and deleted in one attempt, is
    not a place in the queue)."""
    parent = parent_of(namespace, key)
    watches = watches_by_session(server)
    found = []
    for name in contenders(raw, namespace, key):
        stat = raw.exists(f"{parent}/{name}")
        if stat is None:
            continue
        owner = int(stat.ephemeralOwner)
        if any(path.startswith(parent + "/") and path != f"{parent}/{name}" for path in watches.get(owner, ())):
            found.append(owner)
    return found
