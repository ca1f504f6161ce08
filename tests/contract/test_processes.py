"""Mutual exclusion across processes, for stores shared between processes (not memory://:
one process only). Each worker process marks its critical section by creating a file
exclusively: a second process inside at the same time finds it there and fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import EXCLUSIVE

WORKERS = 3

WORKER = """
import os, sys
from lockaspect import LockClient

url, namespace, kind, marker = sys.argv[1:]
with LockClient.from_url(url, namespace=namespace, watchdog_lease=1.0, tick=0.05) as client:
    for _ in range(10):
        if kind == "lock":
            block = client.lock("proc", wait=60)
        elif kind == "fair":
            block = client.fair_lock("proc", wait=60)
        elif kind == "semaphore":
            block = client.semaphore("proc", permits=1, wait=60)
        elif kind == "write":
            block = client.rw_lock("proc").write(wait=60)
        else:
            block = client.multi_lock(["proc", "proc:second"], wait=60)
        with block:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # FileExistsError: overlap
            os.unlink(marker)
"""


#: The stores shared between processes, by the fixture that serves them.
SERVERS = {"redis": "lock_server", "redis_cluster": "valkey_cluster", "redis_sentinel": "valkey_sentinel"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", EXCLUSIVE)
@pytest.mark.parametrize("server", list(SERVERS))
def test_processes_exclude_each_other(
    server: str, namespace: str, tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    """On Redis Cluster the multi-key set's two keys are in different slots (taken one by one)."""
    url = request.getfixturevalue(SERVERS[server]).url
    marker = str(tmp_path / "inside")
    processes = [
        subprocess.Popen([sys.executable, "-c", WORKER, url, namespace, kind, marker], stderr=subprocess.PIPE)
        for _ in range(WORKERS)
    ]
    failures = []
    for process in processes:
        _, stderr = process.communicate(timeout=120)
        if process.returncode:
            failures.append(stderr.decode())
    assert failures == []
