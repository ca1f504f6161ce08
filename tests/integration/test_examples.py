"""Every script in examples/ runs to completion against a real server.

Each example asserts what it demonstrates and exits non-zero when something does not hold.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockaspect.testing import LockServer, ZooKeeperServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))
TIMEOUT = 60.0
#: Examples that need a ZooKeeper (and kazoo): they get the session's ZooKeeper server in
#: LOCKASPECT_ZK_URL, and skip where none is installed (unless LOCKASPECT_REQUIRE_ZOOKEEPER).
ZOOKEEPER_EXAMPLES = {"zookeeper_jobs.py"}


class LeftKeys(AssertionError):
    """An example left keys in the server it ran on."""


PARAMS = [pytest.param(script, id=script.stem) for script in SCRIPTS]


def run_example(script: Path, url: str | None, variable: str = "LOCKASPECT_URL") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("LOCKASPECT_URL", None)
    env.pop("LOCKASPECT_ZK_URL", None)
    if url is not None:
        env[variable] = url
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=EXAMPLES.parent,
        stdin=subprocess.DEVNULL,
    )


def test_there_are_examples() -> None:
    assert {p.name for p in SCRIPTS} >= {
        "quickstart.py",
        "fencing_redis.py",
        "fencing_sql.py",
        "methods_and_executor.py",
        "fair_queue.py",
    }


def needs_kazoo() -> None:
    """Skip a ZooKeeper example where kazoo is not installed (fail under
    ``LOCKASPECT_REQUIRE_ZOOKEEPER``, like the ``zookeeper_server`` fixture)."""
    if importlib.util.find_spec("kazoo") is None:
        if os.environ.get("LOCKASPECT_REQUIRE_ZOOKEEPER"):
            pytest.fail("a ZooKeeper is required here but kazoo is not installed")
        pytest.skip("kazoo is not installed: pip install 'lockaspect[zookeeper]'")


@pytest.mark.parametrize("script", PARAMS)
def test_example_runs(script: Path, request: pytest.FixtureRequest) -> None:
    # Not checked for the ZooKeeper example: the server removes empty container nodes on its
    # own schedule, after the run.
    left: list[bytes] = []
    if script.name in ZOOKEEPER_EXAMPLES:
        needs_kazoo()
        zookeeper: ZooKeeperServer = request.getfixturevalue("zookeeper_server")
        result = run_example(script, zookeeper.url, "LOCKASPECT_ZK_URL")
    else:
        server: LockServer = request.getfixturevalue("lock_server")
        redis = server.redis()
        try:
            before = set(redis.scan_iter(count=1000))
            result = run_example(script, server.url)
            # Whatever the example wrote (locks, fence counters, its data) must be gone: it
            # may run on the user's own server. The session server is shared, so compare.
            left = sorted(set(redis.scan_iter(count=1000)) - before)
        finally:
            redis.close()
    assert result.returncode == 0, f"{script.name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.rstrip().endswith("ok"), result.stdout
    if left:
        raise LeftKeys(f"{script.name} left {len(left)} key(s) in the server: {left[:10]}")


def test_example_starts_its_own_server_without_lockaspect_url() -> None:
    result = run_example(EXAMPLES / "quickstart.py", None)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "started a throwaway server" in result.stdout


def test_zookeeper_example_starts_its_own_zookeeper_without_a_url(zookeeper_classpath: str) -> None:
    needs_kazoo()
    result = run_example(EXAMPLES / "zookeeper_jobs.py", None)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "started a throwaway ZooKeeper" in result.stdout
    assert result.stdout.rstrip().endswith("ok"), result.stdout
