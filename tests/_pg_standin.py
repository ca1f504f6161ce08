"""A minimal stand-in for ``lockaspect.testing.postgres.PostgresServer`` (being written
elsewhere), with the same API, until it lands: a throwaway PostgreSQL 15 cluster run as the
``postgres`` user (we may be root; PostgreSQL refuses to run as root), ``fsync=off``, on a
free loopback port and a unix socket in its own directory.

Replace with the real one at merge: ``from lockaspect.testing import PostgresServer``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

BINDIR = Path(os.environ.get("LOCKASPECT_POSTGRES_BIN", "/usr/lib/postgresql/15/bin"))
READY_TIMEOUT = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    """A PostgreSQL server for one test session (see the module docstring)."""

    def __init__(self, port: int | None = None) -> None:
        self._port = port or _free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            self._as = {"user": entry.pw_uid, "group": entry.pw_gid}
            self._uid, self._gid = entry.pw_uid, entry.pw_gid

    # -- properties -----------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self._port}/postgres"

    @property
    def unix_url(self) -> str:
        assert self._dir is not None
        return f"postgresql://postgres@/postgres?host={self._dir / 'sock'}&port={self._port}"

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> PostgresServer:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="la-pg-"))
            (self._dir / "sock").mkdir()
            if self._as:
                for path in (self._dir, self._dir / "sock"):
                    os.chown(path, self._uid, self._gid)
            subprocess.run(
                [str(BINDIR / "initdb"), "-D", str(self._dir / "data"), "-A", "trust", "-U", "postgres", "--no-sync"],
                check=True,
                capture_output=True,
                **self._as,
            )
        self._spawn()
        return self

    def _spawn(self) -> None:
        assert self._dir is not None
        log = open(self._dir / "log", "ab")  # noqa: SIM115 - the server's stderr for its life
        self._process = subprocess.Popen(
            [
                str(BINDIR / "postgres"),
                "-D", str(self._dir / "data"),
                "-p", str(self._port),
                "-k", str(self._dir / "sock"),
                "-h", "127.0.0.1",
                "-c", "fsync=off",
                "-c", "full_page_writes=off",
                "-c", "synchronous_commit=off",
                "-c", "max_connections=300",
            ],
            stdout=log,
            stderr=log,
            **self._as,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                self.connect().close()
                return
            except Exception:  # noqa: BLE001 - not accepting connections yet
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not start: {(self._dir / 'log').read_text()[-2000:]}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its files."""
        self._halt(signal.SIGINT)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill(self) -> None:
        """SIGKILL the postmaster (its backends die with it when they notice)."""
        self._halt(signal.SIGKILL)

    def restart(self) -> None:
        """Stop (fast) and start again on the same port, keeping the data."""
        self._halt(signal.SIGINT)
        self._spawn()

    def _halt(self, sig: int) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(sig)
            process.wait(READY_TIMEOUT)

    def pause(self) -> None:
        assert self._process is not None
        os.kill(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        os.kill(self._process.pid, signal.SIGCONT)

    def connect(self) -> Any:
        """An autocommit psycopg connection as the superuser."""
        import psycopg

        return psycopg.connect(self.url, autocommit=True, connect_timeout=5)

    def terminate_backends(self, application_name: str | None = None) -> int:
        """``pg_terminate_backend`` every other client backend (of ``application_name``)."""
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                "AND backend_type = 'client backend' AND (%s::text IS NULL OR application_name = %s)",
                (application_name, application_name),
            ).fetchall()
        return len(rows)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
