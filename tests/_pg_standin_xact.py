"""A minimal stand-in for ``lockaspect.testing.postgres.PostgresServer`` (being built on another
branch), for the transaction-scope tests until it lands: ``initdb`` and ``postgres`` from Debian's
``/usr/lib/postgresql/<N>/bin``, run as the ``postgres`` user when we are root, in a temporary
directory, on a free loopback port, without durability. Removed at merge."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def _bindir() -> str:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name))
    if not found:
        raise FileNotFoundError("no PostgreSQL binaries in /usr/lib/postgresql/*/bin (apt-get install postgresql)")
    return str(found[-1].parent)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    def __init__(self) -> None:
        self.bindir = _bindir()
        self.dir = ""
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> PostgresServer:
        self.dir = tempfile.mkdtemp(prefix="lockaspect-pg-xact-", dir="/tmp")
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        data = os.path.join(self.dir, "data")
        subprocess.run(
            [f"{self.bindir}/initdb", "-D", data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"],
            check=True,
            capture_output=True,
            cwd=self.dir,
            **self._as,
        )
        self.port = _free_port()
        argv = [f"{self.bindir}/postgres", "-D", data, "-k", self.dir, "-p", str(self.port), "-h", "127.0.0.1"]
        for setting in ("fsync=off", "synchronous_commit=off", "full_page_writes=off"):
            argv += ["-c", setting]
        with open(os.path.join(self.dir, "postgres.log"), "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir, **self._as
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.connect().close()
                return self
            except Exception:  # noqa: BLE001 - not accepting connections yet
                if self.process.poll() is not None:
                    raise RuntimeError(Path(self.dir, "postgres.log").read_text()) from None
                time.sleep(0.05)
        raise RuntimeError("postgres did not start in 30 s")

    def connect(self, **kwargs: Any) -> Any:
        import psycopg

        return psycopg.connect(self.url, autocommit=True, **kwargs)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)
