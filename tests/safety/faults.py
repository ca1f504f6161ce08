"""Real network faults between a client and a real server, for the safety tests.

:class:`FaultProxy` is a TCP proxy on loopback that forwards bytes between lockaspect and a
real server, and can stop forwarding them on command, per connection and per direction: the
bytes are kept (delayed, as a congested or partitioned network delays them) and forwarded in
order once released. Nothing is mocked: the server is real, the client's sockets are real,
only the path between them stalls.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` (a safety net
    against a hang, not a speed expectation)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


UP = "up"  # client -> server
DOWN = "down"  # server -> client


class _Pipe:
    """One proxied connection: two sockets, and what is held back in each direction."""

    def __init__(self, index: int, client: socket.socket, server: socket.socket) -> None:
        self.index = index
        self.client = client
        self.server = server
        self.held = {UP: False, DOWN: False}
        self.pending: dict[str, list[bytes]] = {UP: [], DOWN: []}
        self.eof = {UP: False, DOWN: False}
        self.bytes_up = 0
        self.closed = False


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` until told to stall.

    * :meth:`hold` stops forwarding (one direction, or both) on the connections open now,
      or on one of them; :meth:`hold_new` holds every connection opened from now on.
    * :meth:`release` forwards what was held, in order, and resumes.

    Use as a context manager; :attr:`url` is a ``redis://`` URL through the proxy.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pipes: list[_Pipe] = []
        self._hold_new: set[str] = set()
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._stopping = True
        self._poke()
        self._thread.join(10)
        for pipe in self._pipes:
            for sock in (pipe.client, pipe.server):
                sock.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- control ----------------------------------------------------------------------

    @property
    def connections(self) -> int:
        """How many connections were accepted so far."""
        with self._lock:
            return len(self._pipes)

    def hold(self, *directions: str, index: int | None = None) -> None:
        """Stop forwarding ``directions`` (default both) on the open connections (or the one
        accepted ``index``-th, from 0)."""
        directions = directions or (UP, DOWN)
        with self._lock:
            for pipe in self._pipes:
                if index is None or pipe.index == index:
                    for direction in directions:
                        pipe.held[direction] = True
        self._poke()

    def hold_new(self, *directions: str) -> None:
        """Hold ``directions`` (default both) on every connection accepted from now on."""
        with self._lock:
            self._hold_new = set(directions or (UP, DOWN))

    def release(self) -> None:
        """Forward everything held, in order, and stop holding (also new connections)."""
        with self._lock:
            self._hold_new = set()
            for pipe in self._pipes:
                pipe.held = {UP: False, DOWN: False}
        self._poke()

    def wait_for_bytes_up(self, index: int, count: int, timeout: float = 30.0) -> None:
        """Wait until connection ``index`` has sent ``count`` bytes towards the server (held
        or forwarded)."""
        with self._changed:
            ok = self._changed.wait_for(
                lambda: any(p.index == index and p.bytes_up >= count for p in self._pipes), timeout
            )
        if not ok:
            raise AssertionError(f"connection {index} never sent {count} bytes")

    @property
    def bytes_up(self) -> int:
        """Bytes the clients sent towards the server so far (held or forwarded)."""
        with self._lock:
            return sum(pipe.bytes_up for pipe in self._pipes)

    def wait_for_traffic(self, after: int, timeout: float = 30.0) -> None:
        """Wait until the clients sent more than ``after`` bytes (see :attr:`bytes_up`)."""
        with self._changed:
            ok = self._changed.wait_for(lambda: sum(p.bytes_up for p in self._pipes) > after, timeout)
        if not ok:
            raise AssertionError("no request went out")

    def wait_for_connections(self, count: int, timeout: float = 30.0) -> None:
        with self._changed:
            ok = self._changed.wait_for(lambda: len(self._pipes) >= count, timeout)
        if not ok:
            raise AssertionError(f"fewer than {count} connections reached the proxy")

    @contextmanager
    def holding(self, *directions: str) -> Iterator[None]:
        self.hold(*directions)
        try:
            yield
        finally:
            self.release()

    # -- the pump ---------------------------------------------------------------------

    def _poke(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                pipes = [pipe for pipe in self._pipes if not pipe.closed]
                for pipe in pipes:
                    self._flush(pipe)
            readers: list[socket.socket] = [self._listener, self._wake_r]
            for pipe in pipes:
                if not pipe.eof[UP]:
                    readers.append(pipe.client)
                if not pipe.eof[DOWN]:
                    readers.append(pipe.server)
            ready, _, _ = select.select(readers, [], [], 0.5)
            for sock in ready:
                if sock is self._wake_r:
                    self._wake_r.recv(4096)
                elif sock is self._listener:
                    self._accept()
                else:
                    self._pump(sock, pipes)

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        server = socket.create_connection(self.upstream)
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._changed:
            pipe = _Pipe(len(self._pipes), client, server)
            for direction in self._hold_new:
                pipe.held[direction] = True
            self._pipes.append(pipe)
            self._changed.notify_all()

    def _pump(self, sock: socket.socket, pipes: list[_Pipe]) -> None:
        for pipe in pipes:
            if sock is pipe.client or sock is pipe.server:
                break
        else:
            return
        direction = UP if sock is pipe.client else DOWN
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        with self._changed:
            if not data:
                # One side closed: pass the close on once everything held has gone through.
                pipe.eof[direction] = True
                pipe.pending[direction].append(b"")
            else:
                pipe.pending[direction].append(data)
                if direction == UP:
                    pipe.bytes_up += len(data)
                    self._changed.notify_all()
            self._flush(pipe)

    def _flush(self, pipe: _Pipe) -> None:
        for direction, target in ((UP, pipe.server), (DOWN, pipe.client)):
            if pipe.held[direction]:
                continue
            queue = pipe.pending[direction]
            while queue:
                data = queue.pop(0)
                try:
                    if data:
                        target.sendall(data)
                    else:
                        target.shutdown(socket.SHUT_WR)
                        if pipe.eof[UP] and pipe.eof[DOWN] and not any(pipe.pending.values()):
                            pipe.closed = True
                except OSError:
                    pipe.closed = True
                    queue.clear()
                    break
