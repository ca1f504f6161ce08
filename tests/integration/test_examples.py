"""Every script in examples/ runs to completion against a real server.

Each example asserts what it demonstrates and exits non-zero when something does not hold.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockaspect.testing import LockServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))
TIMEOUT = 60.0


def run_example(script: Path, url: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("LOCKASPECT_URL", None)
    if url is not None:
        env["LOCKASPECT_URL"] = url
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


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_example_runs(script: Path, lock_server: LockServer) -> None:
    result = run_example(script, lock_server.url)
    assert result.returncode == 0, f"{script.name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.rstrip().endswith("ok"), result.stdout


def test_example_starts_its_own_server_without_lockaspect_url() -> None:
    result = run_example(EXAMPLES / "quickstart.py", None)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "started a throwaway server" in result.stdout
