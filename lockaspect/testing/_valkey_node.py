"""One ``valkey-server`` process with a generated config file, shared by
:class:`~lockaspect.testing.ValkeyCluster` and :class:`~lockaspect.testing.ValkeySentinel`.

Also the pieces both topologies need: ports below the ephemeral range, polling a condition
on live servers, a parallel stop, and :func:`tear_down`, which each topology registers with
:func:`weakref.finalize` (so it also runs at interpreter exit: a crashed test leaves no
server behind).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

__all__ = ["HOST", "ValkeyNode"]

HOST = "127.0.0.1"
READY_TIMEOUT = 20.0
STOP_TIMEOUT = 10.0
START_ATTEMPTS = 5
# Below the ephemeral range (32768-60999 on Linux by default), where every outgoing connection
# (clients, the cluster bus, replication links) takes its local port: a port chosen with bind(0)
# was taken by one of those between choosing and spawning in about one cluster start of 20.
PORT_RANGE = (20000, 32000)

_handed_out: set[int] = set()


class AddressInUse(RuntimeError):
    """The server could not bind its port (or bus port): start it again on new ones."""


def free_port() -> int:
    """A loopback port in :data:`PORT_RANGE` that binds now and was never handed out before
    by this process (two nodes of one topology must not get the same port)."""
    for _ in range(10_000):
        port = random.randint(*PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port left in {PORT_RANGE}")


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0, interval: float = 0.01) -> None:
    """Poll ``predicate`` until it is true; connection and server errors count as "not yet".

    Raises:
        TimeoutError: naming ``what`` and the last error seen.
    """
    import redis

    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what} (last error: {last!r})")
        time.sleep(interval)


def pairs(flat: Any) -> dict[Any, Any]:
    """A reply given as ``[k1, v1, k2, v2, ...]`` (RESP2) or a map, as a dict."""
    if isinstance(flat, dict):
        return flat
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


class ValkeyNode:
    """One ``valkey-server`` process of a topology, on a loopback port.

    Its config is generated as ``<dir>/<name>.conf`` and it logs to :attr:`log_path`
    (``<dir>/<name>.log``). It runs in a session of its own, so a Ctrl-C in the terminal
    interrupts the tests and not their servers. Nodes are made by
    :class:`~lockaspect.testing.ValkeyCluster` and :class:`~lockaspect.testing.ValkeySentinel`;
    :meth:`kill`, :meth:`stop`, :meth:`pause`, :meth:`resume` and :meth:`restart` inject faults
    (the topologies' methods of the same names also wait until the topology has settled).

    Attributes:
        name: ``node0``, ``replica1``, ``sentinel2``...
        port: The client port (kept across :meth:`kill` and :meth:`restart`).
        log_path: The server's log file, the first place to look when a test fails.
    """

    def __init__(
        self,
        binary: str,
        directory: str,
        name: str,
        *,
        sentinel: bool = False,
        cluster: bool = False,
    ) -> None:
        self.binary = binary
        self.directory = directory
        self.name = name
        self.sentinel = sentinel
        self.port = free_port()
        # An explicit bus port: the default (port + 10000) overflows above 55535.
        self.cluster_port = free_port() if cluster else 0
        self.config: list[str] = []
        self.conf_path = os.path.join(directory, f"{name}.conf")
        self.log_path = os.path.join(directory, f"{name}.log")
        self.process: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    @property
    def pid(self) -> int | None:
        """The server's process id, ``None`` while it is not running."""
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        """Whether the process runs (a paused one counts as alive)."""
        return self.process is not None and self.process.poll() is None

    def write_config(self) -> None:
        """Write ``<name>.conf`` from the base settings and :attr:`config`.

        A sentinel rewrites its own file (ids, epochs, peers) from its first start on: write
        it only before that.
        """
        lines = [
            f"port {self.port}",
            f"bind {HOST}",
            f"dir {self.directory}",
            "daemonize no",
            f"logfile {self.log_path}",
            "loglevel notice",
        ]
        if not self.sentinel:
            # The default delay (5 s) makes every replica's first full sync wait that long.
            lines += ['save ""', "appendonly no", "repl-diskless-sync-delay 0"]
        if self.cluster_port:
            lines.append(f"cluster-port {self.cluster_port}")
        Path(self.conf_path).write_text("\n".join([*lines, *self.config]) + "\n", encoding="utf-8")

    def spawn(self) -> None:
        """Start the process on the config file as it is; :meth:`wait_ready` waits for it."""
        if self.alive:
            raise RuntimeError(f"{self.name} is already running")
        argv = [self.binary, self.conf_path, *(["--sentinel"] if self.sentinel else [])]
        log = Path(self.log_path)
        self._log_offset = log.stat().st_size if log.exists() else 0
        # The log file replaces a pipe: nothing has to drain it.
        self.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Poll ``PING`` until the server answers.

        Raises:
            AddressInUse: the server exited because its port was taken.
            RuntimeError: it exited for another reason (with the end of its log).
        """

        def ready() -> bool:
            process = self.process
            if process is None or process.poll() is not None:
                if process is not None:
                    self.process = None
                log = self.log_tail()
                if "Address already in use" in log:
                    raise AddressInUse(f"{self.name}: port {self.port} or its bus port is taken")
                raise RuntimeError(f"{self.binary} ({self.name}) exited:\n{log}")
            with self.client(socket_connect_timeout=0.2, socket_timeout=0.5) as client:
                return bool(client.ping())

        wait_for(ready, f"{self.name} to answer PING", timeout, 0.005)

    def start(self) -> None:
        """First start: write the config, spawn, wait; on a taken port, again on new ports."""
        for attempt in range(START_ATTEMPTS):
            self.write_config()
            self.spawn()
            try:
                self.wait_ready()
                return
            except AddressInUse:
                if attempt == START_ATTEMPTS - 1:
                    raise
                self.new_ports()
        raise AssertionError("unreachable")

    def new_ports(self) -> None:
        """Choose another port (and bus port) before a new first start."""
        self.port = free_port()
        if self.cluster_port:
            self.cluster_port = free_port()

    def log_tail(self, chars: int = 3000) -> str:
        """What the server logged since it was last spawned (the end of it)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                return log.read().decode(errors="replace")[-chars:]
        except OSError:
            return ""

    def client(self, **options: Any) -> redis.Redis:
        """A plain redis-py client on this server (``socket_timeout`` 5 s unless given; bytes
        replies, as redis-py's default)."""
        import redis

        options.setdefault("socket_timeout", 5)
        return redis.Redis(host=HOST, port=self.port, **options)

    def role(self) -> str:
        """``master``, ``slave`` or ``sentinel``, from ``ROLE``."""
        with self.client() as client:
            return str(client.execute_command("ROLE")[0].decode())

    def kill(self) -> None:
        """SIGKILL the server; keep its directory, port and cluster state for :meth:`restart`."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
        if process is not None:
            process.wait()

    def stop(self) -> None:
        """Stop the server: SIGCONT (in case it is paused) and SIGTERM, SIGKILL after 10 s."""
        stop_all([self])

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers, not even the cluster bus."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        self._signal(signal.SIGCONT)

    def restart(self) -> None:
        """Start again on the same port and config files (after :meth:`kill`, say); a running
        server is stopped first.

        Raises:
            RuntimeError: if the port is taken meanwhile (it cannot change: peers know it).
        """
        self.stop()
        self.spawn()
        self.wait_ready()

    def _signal(self, signum: int) -> None:
        if self.process is None:
            raise RuntimeError(f"{self.name} is not running")
        self.process.send_signal(signum)

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.alive else "not running"
        return f"<ValkeyNode {self.name} {HOST}:{self.port} {state}>"


def stop_all(nodes: Iterable[ValkeyNode]) -> None:
    """SIGTERM every node first, then wait for all (in parallel: ~0.1 s for six, not ~0.6 s)."""
    processes: list[subprocess.Popen[bytes]] = []
    for node in nodes:
        process, node.process = node.process, None
        if process is None:
            continue
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.terminate()
        processes.append(process)
    deadline = time.monotonic() + STOP_TIMEOUT
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tear_down(nodes: Sequence[ValkeyNode], directory: str) -> None:
    """Stop ``nodes`` and remove their directory (a topology's stop, and its finalizer)."""
    stop_all(nodes)
    shutil.rmtree(directory, ignore_errors=True)


def start_all(nodes: Sequence[ValkeyNode]) -> None:
    """First start of several nodes: spawn them all, then wait for each; a node whose port
    was taken starts again on new ports."""
    for node in nodes:
        node.write_config()
        node.spawn()
    for node in nodes:
        try:
            node.wait_ready()
        except AddressInUse:
            node.new_ports()
            node.start()
