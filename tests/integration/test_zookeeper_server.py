"""``ZooKeeperServer`` against the real ZooKeeper jars it finds, with kazoo as the client:
start and create a node, restart on the same port and data, crash, pause, and cleanup."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockaspect.testing import ZooKeeperServer, find_zookeeper_classpath
from lockaspect.testing import zookeeper as zookeeper_module

kazoo_client = pytest.importorskip("kazoo.client")
kazoo_protocol_states = pytest.importorskip("kazoo.protocol.states")
KazooClient = kazoo_client.KazooClient
KazooState = kazoo_protocol_states.KazooState

WAIT = 30.0  # a deadline against hanging, not a timing threshold


@pytest.fixture
def fresh_zookeeper(zookeeper_classpath: str) -> Iterator[ZooKeeperServer]:
    """A server of its own, for tests that kill, pause or restart it."""
    with ZooKeeperServer(zookeeper_classpath) as server:
        yield server


@pytest.fixture
def connect() -> Iterator[object]:
    """``connect(server, **options)``: a started KazooClient, stopped and closed after the test."""
    clients = []

    def connect(server: ZooKeeperServer, **options: object) -> object:
        client = KazooClient(hosts=server.hosts, **options)
        clients.append(client)
        client.start(timeout=WAIT)
        return client

    yield connect
    for client in clients:
        client.stop()
        client.close()


class StateLog:
    """Records a client's connection states, with an event per state to wait on."""

    def __init__(self) -> None:
        self.states: list[str] = []
        self.events = {state: threading.Event() for state in (KazooState.SUSPENDED, KazooState.CONNECTED, "LOST")}

    def __call__(self, state: str) -> None:  # runs on kazoo's connection thread: never block here
        self.states.append(state)
        self.events[state].set()

    def wait(self, state: str) -> None:
        assert self.events[state].wait(WAIT), f"no {state} seen; states so far: {self.states}"
        self.events[state].clear()


def test_the_session_server_creates_and_reads_nodes(zookeeper_server: ZooKeeperServer, connect) -> None:
    client = connect(zookeeper_server)
    path = client.create("/lockaspect-test/node", b"hello", makepath=True, sequence=True)
    data, _ = client.get(path)
    assert data == b"hello"
    assert zookeeper_server.hosts == f"127.0.0.1:{zookeeper_server.port}"
    assert zookeeper_server.url == f"zookeeper://127.0.0.1:{zookeeper_server.port}"
    assert zookeeper_server.url in repr(zookeeper_server)
    assert "running" in repr(zookeeper_server)
    assert zookeeper_server.version.startswith("3.")
    assert "Mode: standalone" in zookeeper_server.four_letter("srvr")


def test_it_listens_on_loopback_only_with_the_configured_session_bounds(zookeeper_classpath: str) -> None:
    with ZooKeeperServer(zookeeper_classpath, tick_time=100, max_session_timeout=5000) as server:
        conf = server.four_letter("conf")
        # Bound to 127.0.0.1 only: another address may take the same port (not so under 0.0.0.0).
        with socket.socket() as other:
            other.bind(("127.0.0.2", server.port))
        assert "minSessionTimeout=200" in conf
        assert "maxSessionTimeout=5000" in conf
        assert "tickTime=100" in conf
        assert "forceSync=no" in Path(server.config_path).read_text()


def test_restart_keeps_the_port_and_the_data(fresh_zookeeper: ZooKeeperServer, connect) -> None:
    client = connect(fresh_zookeeper)
    client.create("/kept", b"persistent")
    client.stop()
    port, pid, directory = fresh_zookeeper.port, fresh_zookeeper.pid, fresh_zookeeper.dir

    fresh_zookeeper.kill()
    assert os.path.isdir(directory)
    fresh_zookeeper.restart()
    assert (fresh_zookeeper.port, fresh_zookeeper.dir) == (port, directory)
    assert fresh_zookeeper.pid != pid
    assert connect(fresh_zookeeper).get("/kept")[0] == b"persistent"

    fresh_zookeeper.restart()  # from running: a clean stop, then the same start
    assert fresh_zookeeper.port == port
    assert connect(fresh_zookeeper).get("/kept")[0] == b"persistent"


def test_after_kill_a_client_cannot_connect(fresh_zookeeper: ZooKeeperServer) -> None:
    from kazoo.handlers.threading import KazooTimeoutError

    fresh_zookeeper.kill()
    assert "stopped" in repr(fresh_zookeeper)
    with pytest.raises(RuntimeError, match="not running"):
        fresh_zookeeper.pid  # noqa: B018
    client = KazooClient(hosts=fresh_zookeeper.hosts)
    try:
        with pytest.raises(KazooTimeoutError):
            client.start(timeout=1)
    finally:
        client.stop()
        client.close()


def test_pause_suspends_clients_and_resume_reconnects_them(fresh_zookeeper: ZooKeeperServer, connect) -> None:
    client = connect(fresh_zookeeper, timeout=2.0)
    log = StateLog()
    client.add_listener(log)
    client.create("/before-pause", b"x")

    fresh_zookeeper.pause()
    try:
        log.wait(KazooState.SUSPENDED)
    finally:
        fresh_zookeeper.resume()
    log.wait(KazooState.CONNECTED)
    assert client.state == KazooState.CONNECTED
    assert client.get("/before-pause")[0] == b"x"


def test_stop_removes_the_directory_and_is_idempotent(zookeeper_classpath: str) -> None:
    server = ZooKeeperServer(zookeeper_classpath).start()
    directory = server.dir
    assert os.path.isdir(directory)
    server.pause()  # a paused server still stops
    server.stop()
    assert not os.path.exists(directory)
    assert server.dir == ""
    assert server.process is None
    server.stop()
    with pytest.raises(RuntimeError, match="call start"):
        server.restart()


def test_a_taken_port_is_replaced(zookeeper_classpath: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        real_free_port = zookeeper_module._free_port
        monkeypatch.setattr(zookeeper_module, "_free_port", lambda: next(ports, None) or real_free_port())
        with ZooKeeperServer(zookeeper_classpath) as server:
            assert server.port != taken.getsockname()[1]
            assert "Mode:" in server.four_letter("srvr")


def test_the_classpath_search(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOCKASPECT_ZOOKEEPER_CLASSPATH", "/somewhere/zk.jar:/elsewhere/*")
    assert find_zookeeper_classpath() == "/somewhere/zk.jar:/elsewhere/*"
    monkeypatch.delenv("LOCKASPECT_ZOOKEEPER_CLASSPATH")
    monkeypatch.setattr(zookeeper_module, "DEBIAN_JAR", str(tmp_path / "zookeeper.jar"))
    with pytest.raises(FileNotFoundError, match="apt-get install libzookeeper-java default-jre-headless"):
        find_zookeeper_classpath()
    (tmp_path / "zookeeper.jar").touch()
    monkeypatch.setattr(zookeeper_module, "DEBIAN_SLF4J", str(tmp_path / "slf4j-simple.jar"))
    assert find_zookeeper_classpath() == str(tmp_path / "zookeeper.jar")
    (tmp_path / "slf4j-simple.jar").touch()
    assert find_zookeeper_classpath() == f"{tmp_path}/zookeeper.jar:{tmp_path}/slf4j-simple.jar"
