"""A real ZooKeeper server for tests, and where its jars and ``java`` come from.

:class:`ZooKeeperServer` starts ``org.apache.zookeeper.server.ZooKeeperServerMain`` on a
generated ``zoo.cfg``: a free loopback port, a temporary data directory, no fsync, no admin
server. :func:`find_zookeeper_classpath` and :func:`find_java` are the searches for what it
runs. All three are re-exported by :mod:`lockaspect.testing`. Nothing here imports a
ZooKeeper client: use kazoo (``KazooClient(hosts=server.hosts)``) in the tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["ZooKeeperServer", "find_java", "find_zookeeper_classpath"]

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
DEBIAN_JAR = "/usr/share/java/zookeeper.jar"
# Without an slf4j binding the server logs nothing, and a failed start is silent.
DEBIAN_SLF4J = "/usr/share/java/slf4j-simple.jar"
INSTALL_HINT = "apt-get install libzookeeper-java default-jre-headless (Debian)"
JVM_OPTIONS = (
    "-Xmx128m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",  # C1 only: gentler on small CI machines
    "-Dzookeeper.jmx.log4j.disable=true",
    "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
    "-Dznode.container.checkIntervalMs=200",  # the default (60 s) leaves empty containers around
)


def find_zookeeper_classpath() -> str:
    """The Java classpath of a ZooKeeper server (with an slf4j binding, when there is one).

    Searched in order: the environment variable ``LOCKASPECT_ZOOKEEPER_CLASSPATH`` (used
    verbatim); ``ZOOKEEPER_HOME`` (an Apache release unpacked there: ``lib/*`` and the jars
    at its top); Debian's ``/usr/share/java/zookeeper.jar`` (from ``libzookeeper-java``; its
    manifest names every dependency jar), plus ``/usr/share/java/slf4j-simple.jar`` if present.

    Raises:
        FileNotFoundError: with install hints, when nothing is found.
    """
    override = os.environ.get("LOCKASPECT_ZOOKEEPER_CLASSPATH")
    if override:
        return override
    home = os.environ.get("ZOOKEEPER_HOME")
    if home and os.path.isdir(os.path.join(home, "lib")):
        return os.pathsep.join([os.path.join(home, "lib", "*"), os.path.join(home, "*")])
    if os.path.isfile(DEBIAN_JAR):
        jars = [DEBIAN_JAR]
        if os.path.isfile(DEBIAN_SLF4J):
            jars.append(DEBIAN_SLF4J)
        return os.pathsep.join(jars)
    raise FileNotFoundError(
        f"no ZooKeeper server jars found: {INSTALL_HINT}, "
        "or set LOCKASPECT_ZOOKEEPER_CLASSPATH to a classpath holding the ZooKeeper server"
    )


def find_java() -> str:
    """The ``java`` executable: ``LOCKASPECT_JAVA``, then ``$JAVA_HOME/bin/java``, then PATH.

    Raises:
        FileNotFoundError: with install hints, when none is found.
    """
    override = os.environ.get("LOCKASPECT_JAVA")
    if override:
        if not os.access(override, os.X_OK):
            raise FileNotFoundError(f"LOCKASPECT_JAVA={override} is not an executable")
        return override
    java_home = os.environ.get("JAVA_HOME")
    if java_home and os.access(os.path.join(java_home, "bin", "java"), os.X_OK):
        return os.path.join(java_home, "bin", "java")
    java = shutil.which("java")
    if java is None:
        raise FileNotFoundError(
            "no java found: apt-get install default-jre-headless (Debian), or set LOCKASPECT_JAVA or JAVA_HOME"
        )
    return java


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def four_letter(port: int, command: str, timeout: float = 1.0) -> str:
    """Send a four-letter command (``srvr``, ``conf``, ``dump``, ...) to ``127.0.0.1:port``; the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(command.encode("ascii"))
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (``T``), or ``/proc`` cannot tell."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii", errors="replace") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


class ZooKeeperServer:
    """A real standalone ZooKeeper server for tests, on ``127.0.0.1`` only.

    Args:
        classpath: The server's classpath; default :func:`find_zookeeper_classpath`.
        tick_time: ZooKeeper's ``tickTime`` in milliseconds (the session-timeout granularity).
        min_session_timeout: The least session timeout (ms) it grants; default ``2 * tick_time``.
        max_session_timeout: The greatest session timeout (ms) it grants; default 60000.

    Use as a context manager, or :meth:`start` / :meth:`stop`. :meth:`pause`, :meth:`resume`,
    :meth:`kill` and :meth:`restart` inject faults. Durability is off (``forceSync=no``).
    Sessions and their ephemeral nodes live in the data directory, so they survive a
    :meth:`kill` plus :meth:`restart`: a client that reconnects within its session timeout
    keeps its session. A pause longer than a session's timeout expires it once resumed.
    """

    def __init__(
        self,
        classpath: str | None = None,
        *,
        tick_time: int = 200,
        min_session_timeout: int | None = None,
        max_session_timeout: int | None = None,
    ) -> None:
        self.classpath = classpath or find_zookeeper_classpath()
        self.java = find_java()
        self.tick_time = tick_time
        self.min_session_timeout = 2 * tick_time if min_session_timeout is None else min_session_timeout
        self.max_session_timeout = 60_000 if max_session_timeout is None else max_session_timeout
        if not 0 < self.min_session_timeout <= self.max_session_timeout:
            raise ValueError("need 0 < min_session_timeout <= max_session_timeout")
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.version = ""
        self.dir = ""

    @property
    def data_dir(self) -> str:
        """The server's data directory (snapshots and transaction logs, inside :attr:`dir`)."""
        return os.path.join(self.dir, "data")

    @property
    def config_path(self) -> str:
        """The generated ``zoo.cfg``."""
        return os.path.join(self.dir, "zoo.cfg")

    @property
    def log_path(self) -> str:
        """The server's log (stdout and stderr)."""
        return os.path.join(self.dir, "zookeeper.log")

    @property
    def hosts(self) -> str:
        """``127.0.0.1:<port>``, the connect string for ``KazooClient(hosts=...)``."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """``zookeeper://127.0.0.1:<port>``."""
        return f"zookeeper://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The JVM's process id."""
        if self.process is None:
            raise RuntimeError("the server is not running")
        return self.process.pid

    def start(self) -> ZooKeeperServer:
        """Create a fresh data directory and start the server; wait until it serves requests."""
        if self.process is not None:
            return self
        fresh = not self.dir
        if fresh:
            self.dir = tempfile.mkdtemp(prefix="lockaspect-zk-")
            os.mkdir(self.data_dir)
        try:
            for _ in range(5):
                self.port = self.port or _free_port()
                if self._spawn():
                    return self
                self.port = 0  # the port was taken between choosing and binding: try another
            raise RuntimeError(f"ZooKeeper ({self.classpath}) did not start:\n{self._log_tail()}")
        except BaseException:
            if fresh:
                self._remove_dir()  # the error carries the log's tail
            raise

    def _write_config(self) -> None:
        Path(self.config_path).write_text(
            f"tickTime={self.tick_time}\n"
            f"dataDir={self.data_dir}\n"
            f"clientPort={self.port}\n"
            "clientPortAddress=127.0.0.1\n"
            f"minSessionTimeout={self.min_session_timeout}\n"
            f"maxSessionTimeout={self.max_session_timeout}\n"
            "maxClientCnxns=0\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=*\n"
            "forceSync=no\n"
            "autopurge.purgeInterval=0\n"
        )

    def _spawn(self) -> bool:
        self._write_config()
        argv = [self.java, *JVM_OPTIONS, "-cp", self.classpath, MAIN_CLASS, self.config_path]
        with open(self.log_path, "ab") as log:
            # A session of its own: a Ctrl-C in the terminal interrupts the tests, not their server.
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.dir,
            )
        return self._await_ready()

    def _await_ready(self) -> bool:
        # Not "ruok": it answers "imok" before the server serves requests. "srvr" shows "Mode:" once it does.
        process = self.process
        assert process is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self.process = None
                if "Address already in use" in self._log_tail():
                    return False
                raise RuntimeError(f"ZooKeeper exited with {process.returncode}:\n{self._log_tail()}")
            try:
                reply = four_letter(self.port, "srvr", timeout=0.5)
            except OSError:
                reply = ""
            if "Mode:" in reply:
                first = reply.splitlines()[0]
                self.version = first.partition(":")[2].split(",")[0].strip()
                return True
            time.sleep(0.01)
        process.kill()
        process.wait()
        self.process = None
        raise RuntimeError(f"ZooKeeper did not become ready in {READY_TIMEOUT} s:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def four_letter(self, command: str, timeout: float = 1.0) -> str:
        """The server's reply to a four-letter command: ``srvr``, ``conf``, ``dump``, ``cons``, ..."""
        return four_letter(self.port, command, timeout)

    def kill(self) -> None:
        """SIGKILL the server (a crash); keep the data and the port for :meth:`restart`."""
        process = self.process
        if process is None:
            return
        process.kill()
        process.wait()
        self.process = None

    def _shutdown(self) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            try:
                os.kill(process.pid, signal.SIGCONT)  # a paused JVM cannot exit
            except ProcessLookupError:
                pass
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.process = None

    def stop(self) -> None:
        """Stop the server (SIGTERM) and remove its directory. Safe to call twice."""
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
            raise RuntimeError(f"port {self.port} is taken; cannot restart ZooKeeper:\n{self._log_tail()}")

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers (clients go SUSPENDED).
        Returns once every thread of the JVM is stopped (where ``/proc`` shows it), so nothing
        sent afterwards is answered until :meth:`resume`."""
        pid = self.pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not _all_stopped(pid):
            time.sleep(0.001)

    def resume(self) -> None:
        """SIGCONT what :meth:`pause` stopped."""
        os.kill(self.pid, signal.SIGCONT)

    def connect(self, **options: Any) -> Any:
        """A started ``kazoo.client.KazooClient`` on this server (``options`` go to its
        constructor); the caller stops it. Needs kazoo (``lockaspect[zookeeper]``)."""
        from kazoo.client import KazooClient

        client = KazooClient(hosts=self.hosts, **options)
        client.start(timeout=READY_TIMEOUT)
        return client

    def expire_session(self, client_id: tuple[int, bytes]) -> None:
        """Expire the session ``client_id`` (a kazoo client's ``client_id``) on the server, for
        real: a second client joins the session and closes it. The session's owner sees
        SUSPENDED, then LOST, and its ephemeral nodes are gone."""
        twin = self.connect(client_id=client_id)
        twin.stop()
        twin.close()

    def __enter__(self) -> ZooKeeperServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.process is not None else "stopped"
        return f"<ZooKeeperServer {self.version or '?'} {self.url} {state}>"
