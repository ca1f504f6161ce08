"""The ``zookeeper://`` store when things go wrong, on a real ZooKeeper server: the server
paused (SIGSTOP) longer and shorter than the session timeout, killed and restarted; a
holder's session expired by the server; holder and waiter processes killed with SIGKILL;
connections lost while a contender node was being created. Each test that pauses or kills
the server has a server of its own (it starts in ~0.3 s).

Session timeouts are short (1 s where a session must end, several seconds where it must
survive), so the server, not a sleep, decides when things happen; a deadline only bounds a
hang. The happy paths are in ``test_store.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lockaspect import BackendError, LockClient, LockLost, LockNotAcquired
from lockaspect.backends.zookeeper import ZooKeeperStore
from lockaspect.observe import LockEvent
from lockaspect.testing import ZooKeeperServer

from ._support import BOUND, contenders, parent_of, until, waiting

kazoo_client = pytest.importorskip("kazoo.client")
KazooClient = kazoo_client.KazooClient

WORKTREE = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def own_zk(zookeeper_classpath: str) -> Iterator[ZooKeeperServer]:
    """A server of this test's own: it is paused, killed or restarted."""
    server = ZooKeeperServer(zookeeper_classpath)
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError, RuntimeError):
            server.resume()  # never leave a stopped JVM behind (stop() sends SIGCONT too)
        server.stop()


@pytest.fixture
def zk(zookeeper_server: ZooKeeperServer) -> ZooKeeperServer:
    return zookeeper_server


@pytest.fixture
def namespace() -> str:
    return f"zf-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def make(namespace: str) -> Iterator[Callable[..., LockClient]]:
    """``make(server, query="", **options)``: a LockClient on ``server`` in the test's
    namespace, closed after the test."""
    made: list[LockClient] = []

    def make(server: ZooKeeperServer | Gate, query: str = "", **options: Any) -> LockClient:
        options.setdefault("namespace", namespace)
        options.setdefault("tick", 0.05)
        client = LockClient.from_url(server.url + query, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def connect() -> Iterator[Callable[[ZooKeeperServer], Any]]:
    """``connect(server)``: a plain started kazoo client on ``server``, for looking at the tree."""
    clients: list[Any] = []

    def connect(server: ZooKeeperServer) -> Any:
        client = KazooClient(hosts=server.hosts, timeout=10.0)
        clients.append(client)
        client.start(timeout=BOUND)
        return client

    yield connect
    for client in clients:
        client.stop()
        client.close()


def owner(raw: Any, namespace: str, key: str, name: str) -> int | None:
    """The session that owns contender ``name`` of ``key`` (``None``: it went meanwhile)."""
    stat = raw.exists(f"{parent_of(namespace, key)}/{name}")
    return None if stat is None else int(stat.ephemeralOwner)


def kazoo_of(client: LockClient) -> Any:
    """The store's kazoo client (its ZooKeeper session), started."""
    store = client.backend
    assert isinstance(store, ZooKeeperStore)
    kazoo = store._session._client
    assert kazoo is not None
    return kazoo


def session_of(client: LockClient) -> int | None:
    """The id of the client's ZooKeeper session (``None`` while kazoo has none, reconnecting)."""
    client_id = kazoo_of(client).client_id
    return None if client_id is None else int(client_id[0])


def expire_session(server: ZooKeeperServer, client_id: tuple[int, bytes]) -> None:
    """Expire a session on the server for real: a second client joins it and closes it
    (``ZooKeeperServer`` has no such helper yet). The owner sees SUSPENDED, LOST, then
    CONNECTED on a new session; its ephemeral nodes are gone."""
    twin = KazooClient(hosts=server.hosts, client_id=client_id, timeout=10.0)
    twin.start(timeout=BOUND)
    twin.stop()
    twin.close()


class States:
    """A kazoo connection-state listener: an event per state seen (never blocks kazoo)."""

    def __init__(self, client: LockClient) -> None:
        self.seen: list[str] = []
        self.events = {state: threading.Event() for state in ("SUSPENDED", "CONNECTED", "LOST")}
        kazoo_of(client).add_listener(self)

    def __call__(self, state: str) -> None:
        self.seen.append(str(state))
        self.events[str(state)].set()

    def wait(self, state: str) -> None:
        assert self.events[state].wait(BOUND), f"no {state} seen; states so far: {self.seen}"


class Told:
    """An ``on_lost`` hook and observer: when and why each lease was reported lost."""

    def __init__(self) -> None:
        self.hooks: list[tuple[str, str | None, float]] = []
        self.events: list[tuple[str, str | None]] = []
        self.event = threading.Event()

    def on_lost(self, lease: Any) -> None:
        self.hooks.append((lease.key, lease.lost_reason, time.monotonic()))
        self.event.set()

    def __call__(self, event: LockEvent) -> None:
        if event.name == "lost":
            self.events.append((event.key, event.reason))


class Gate:
    """A TCP proxy on loopback in front of a server, to cut connections or keep them out.

    Open, it forwards both ways. :meth:`cut` resets the connections it carries (the clients
    reconnect at once, through it, on the same sessions). :meth:`shut` resets them and
    closes every new one at once, as a server that is down does, until :meth:`open`: a
    client never reaches a restarting server while it boots (a ZooKeeper that has bound its
    port but does not serve yet leaves kazoo's handshake hanging for the whole session
    timeout, and that would decide a test by chance).
    """

    def __init__(self, server: ZooKeeperServer) -> None:
        self.server = server
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.is_open = True
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.thread = threading.Thread(target=self._accept, name="zk-gate", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"zookeeper://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self.lock:
                admitted = self.is_open
            if not admitted:
                near.close()
                continue
            try:
                far = socket.create_connection(("127.0.0.1", self.server.port), timeout=BOUND)
            except OSError:
                near.close()
                continue
            far.settimeout(None)
            with self.lock:
                self.pairs.append((near, far))
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):  # the other direction ends too
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Reset every connection carried now (their sockets are closed)."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def shut(self) -> None:
        with self.lock:
            self.is_open = False
        self.cut()

    def open(self) -> None:
        with self.lock:
            self.is_open = True

    def close(self) -> None:
        self.shut()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a close alone does not)
        self.listener.close()
        self.thread.join(BOUND)


@pytest.fixture
def gate(own_zk: ZooKeeperServer) -> Iterator[Gate]:
    proxy = Gate(own_zk)
    yield proxy
    proxy.close()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": WORKTREE + os.pathsep + os.environ.get("PYTHONPATH", "")}


# -- 4. the server paused (SIGSTOP) ---------------------------------------------------------------


@pytest.mark.slow
def test_a_pause_longer_than_the_session_loses_the_lock_before_anyone_else_gets_it(
    own_zk: ZooKeeperServer, make: Callable[..., LockClient], connect: Callable[..., Any], namespace: str
) -> None:
    """SIGSTOP of the server for longer than the 1 s session timeout: while it is still
    stopped, the holder is told ('expired': its lease estimate ran out), its ``on_lost`` hook
    runs, its async body is cancelled, and its blocks raise LockLost; after SIGCONT the waiter
    of another client gets the lock, only after the holder was told, with a larger fencing
    token, and holds it alone."""
    told = Told()
    holder = make(own_zk, "?session_timeout=1", observers=[told])
    waiter = make(own_zk, "?session_timeout=4")  # outlives the pause: only the holder expires
    raw = connect(own_zk)
    taken: list[tuple[float, int, list[str]]] = []
    errors: list[BaseException] = []
    go = threading.Event()

    def wait_for_it() -> None:
        go.wait(BOUND)
        try:
            with waiter.lock("k", wait=BOUND) as lease:
                taken.append((time.monotonic(), lease.fencing_token, contenders(raw, namespace, "k")))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    cancelled = threading.Event()
    async_entered = threading.Event()
    async_outcome: list[BaseException | None] = []

    def async_holder() -> None:
        async def body() -> None:
            async with holder.lock("k2", on_lost=told.on_lost):
                async_entered.set()
                try:
                    await asyncio.sleep(BOUND * 4)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise

        try:
            asyncio.run(body())
            async_outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            async_outcome.append(exc)

    waiter_thread = threading.Thread(target=wait_for_it, daemon=True)
    waiter_thread.start()
    async_thread = threading.Thread(target=async_holder, daemon=True)
    async_thread.start()
    leases: list[Any] = []
    resumed: list[float] = []

    def hold() -> None:
        with holder.lock("k", on_lost=told.on_lost) as lease:
            leases.append(lease)
            assert async_entered.wait(BOUND)
            go.set()
            until(lambda: len(waiting(own_zk, raw, namespace, "k")) == 1, "the waiter to queue")
            own_zk.pause()
            paused = time.monotonic()
            try:
                until(lambda: len(told.hooks) == 2, "both holds to be reported lost")
                assert cancelled.wait(BOUND)
                assert lease.lost
                assert lease.lost_reason in ("expired", "session-lost")
                assert taken == []
                # keep it stopped past the session timeout, so the server expires the sessions
                threading.Event().wait(max(0.0, paused + 1.5 - time.monotonic()))
            finally:
                own_zk.resume()
            resumed.append(time.monotonic())
            waiter_thread.join(BOUND)

    with pytest.raises(LockLost) as info:
        hold()
    assert info.value.exception is None, info.value.exception  # the body itself did not fail
    assert info.value.reason in ("expired", "session-lost")
    async_thread.join(BOUND)
    assert len(async_outcome) == 1
    assert isinstance(async_outcome[0], LockLost), async_outcome
    assert errors == []
    assert sorted(key for key, _, _ in told.hooks) == ["k", "k2"]
    assert all(reason in ("expired", "session-lost") for _, reason, _ in told.hooks)
    assert all(at < resumed[0] for _, _, at in told.hooks)  # told while the server was still stopped
    (at, token, queue) = taken[0]
    assert at > max(at for _, _, at in told.hooks)
    assert token > leases[0].fencing_token
    assert len(queue) == 1  # the waiter's node alone: the holder's went with its session
    assert sorted(told.events) == sorted((key, reason) for key, reason, _ in told.hooks)


@pytest.mark.slow
def test_a_pause_shorter_than_the_session_keeps_the_lock_on_the_same_session(
    own_zk: ZooKeeperServer, make: Callable[..., LockClient], namespace: str
) -> None:
    """SIGSTOP of the server until the holder's connection is suspended, then SIGCONT: the
    session (6 s) reconnects in time, the lease is not lost, the node is the same, renewals
    carry on, another client still cannot take the lock, and the release frees it."""
    told = Told()
    renewed = threading.Event()

    def observe(event: LockEvent) -> None:
        told(event)
        if event.name == "renewed" and event.number:
            renewed.set()

    holder = make(own_zk, "?session_timeout=6", observers=[observe])
    other = make(own_zk, "?session_timeout=6")
    with holder.lock("k", on_lost=told.on_lost) as lease:
        states = States(holder)
        before = session_of(holder)
        own_zk.pause()
        try:
            states.wait("SUSPENDED")
        finally:
            own_zk.resume()
        states.wait("CONNECTED")
        session = holder.backend._session
        until(lambda: session.connected and session.verified, "the held node to be re-read")
        assert session_of(holder) == before
        assert "LOST" not in states.seen
        renewed.clear()
        assert renewed.wait(BOUND)  # the watchdog's next probe trusts the session again
        assert not lease.lost
        assert lease.held
        with pytest.raises(LockNotAcquired), other.lock("k"):
            pass
    assert told.hooks == []
    assert told.events == []
    with other.lock("k") as after:
        assert after.fencing_token > lease.fencing_token


# -- 5. the server expires a holder's session --------------------------------------------------------


def test_an_expired_session_loses_every_hold_at_once_and_the_client_carries_on(
    zk: ZooKeeperServer, make: Callable[..., LockClient], connect: Callable[..., Any], namespace: str
) -> None:
    """The server expires the holder's session (a real expiry, through a twin client): every
    hold of the client is lost at once with reason 'session-lost', fixed leases included, each
    ``on_lost`` hook runs and each block raises LockLost; the client's next locks live on its
    new session, with larger fencing tokens."""
    told = Told()
    client = make(zk, "?session_timeout=8", observers=[told])
    other = make(zk)
    raw = connect(zk)
    blocks = [
        client.lock("watchdog", on_lost=told.on_lost),
        client.lock("fixed", lease=30, on_lost=told.on_lost),
        client.rw_lock("rw").read(on_lost=told.on_lost),
        client.semaphore("sem", permits=2, on_lost=told.on_lost),
        client.fair_lock("fair", on_lost=told.on_lost),
    ]
    leases = [block.__enter__() for block in blocks]
    old = session_of(client)
    expire_session(zk, kazoo_of(client).client_id)
    until(lambda: len(told.hooks) == len(blocks), "every hold to be reported lost")
    assert {reason for _, reason, _ in told.hooks} == {"session-lost"}
    assert all(lease.lost and lease.lost_reason == "session-lost" for lease in leases)
    for block in reversed(blocks):
        with pytest.raises(LockLost) as info:
            block.__exit__(None, None, None)
        assert info.value.reason == "session-lost"
    assert sorted(key for key, _ in told.events) == ["fair", "fixed", "rw", "sem", "watchdog"]
    # the nodes went with the session: others get the locks at once
    for key in ("watchdog", "fixed", "fair"):
        with other.lock(key):
            pass
    until(lambda: session_of(client) not in (old, None), "the client's new session")
    with client.lock("watchdog") as again, client.lock("fixed", lease=30) as fixed:
        assert session_of(client) != old
        assert again.fencing_token > max(lease.fencing_token for lease in leases)
        assert fixed.fencing_token > again.fencing_token
        (name,) = contenders(raw, namespace, "watchdog")
        assert raw.exists(f"{parent_of(namespace, 'watchdog')}/{name}").ephemeralOwner == session_of(client)
    assert not again.lost
    assert not fixed.lost


def test_an_expired_session_gives_up_the_queue_places_and_waits_again(
    zk: ZooKeeperServer, make: Callable[..., LockClient], connect: Callable[..., Any], namespace: str
) -> None:
    """A waiter whose session the server expires queues again on its new session (its old node
    went with the old session) and gets the lock when the holder releases."""
    holder, waiter = make(zk), make(zk, "?session_timeout=8")
    raw = connect(zk)
    taken: list[int] = []
    with holder.lock("k") as held:
        thread = threading.Thread(target=lambda: taken.append(_take(waiter, "k")), daemon=True)
        thread.start()
        until(lambda: len(waiting(zk, raw, namespace, "k")) == 1, "the waiter to queue")
        first = contenders(raw, namespace, "k")[1]
        old = session_of(waiter)
        expire_session(zk, kazoo_of(waiter).client_id)
        until(lambda: session_of(waiter) not in (old, None), "the waiter's new session")
        until(
            lambda: len(waiting(zk, raw, namespace, "k")) == 1 and contenders(raw, namespace, "k")[1:] != [first],
            "the waiter to queue again",
        )
        assert taken == []
    thread.join(BOUND)
    assert taken
    assert taken[0] > held.fencing_token


def test_a_try_right_after_a_session_loss_waits_for_the_new_session(
    zk: ZooKeeperServer, make: Callable[..., LockClient]
) -> None:
    """A lock tried while kazoo is between the expired session and the new one (from a thread
    the LOST listener starts) gets the lock on the new session, well within its 8 s
    request_timeout, instead of failing."""
    client = make(zk, "?session_timeout=8")
    with client.lock("warm-up"):
        pass
    outcome: list[object] = []
    done = threading.Event()

    def try_it() -> None:
        try:
            with client.lock("k") as lease:
                outcome.append(lease.fencing_token)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)
        done.set()

    def on_state(state: str) -> bool:
        if state == "LOST":
            threading.Thread(target=try_it, daemon=True).start()
            return True  # remove this listener
        return False

    kazoo_of(client).add_listener(on_state)
    expire_session(zk, kazoo_of(client).client_id)
    assert done.wait(BOUND)
    assert len(outcome) == 1
    assert isinstance(outcome[0], int), outcome


def _take(client: LockClient, key: str, wait: float = BOUND) -> int:
    with client.lock(key, wait=wait) as lease:
        return lease.fencing_token


# -- 6. connection lost while a contender node is created ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["at-once", "after-suspension"])
def test_a_create_cut_off_by_a_pause_leaves_no_node(
    own_zk: ZooKeeperServer,
    make: Callable[..., LockClient],
    connect: Callable[..., Any],
    namespace: str,
    resume: str,
) -> None:
    """The server is stopped while a client creates its contender node: the attempt fails as a
    transient BackendError after its request_timeout (0.3 s). Resumed at once, the create's late
    answer is deleted; resumed after the connection was suspended, the create whose answer was
    lost is found again by its protected name after the same-session reconnection and deleted.
    Either way no node of the client is left, and the key can be locked."""
    client = make(own_zk, "?session_timeout=6&request_timeout=0.3")
    with client.lock("warm-up"):  # the session exists before the pause
        pass
    raw = connect(own_zk)
    states = States(client)
    failures: list[BaseException] = []
    own_zk.pause()
    try:
        for key in ("a", "b"):
            try:
                with client.lock(key):
                    pass
            except (BackendError, LockNotAcquired) as exc:
                failures.append(exc)
        if resume == "after-suspension":
            states.wait("SUSPENDED")
    finally:
        own_zk.resume()
    assert len(failures) == 2
    assert all(isinstance(exc, BackendError) and exc.transient for exc in failures), failures
    if resume == "after-suspension":
        states.wait("CONNECTED")
    session = client.backend._session
    for key in ("a", "b"):
        until(lambda key=key: contenders(raw, namespace, key) == [], f"the orphan node of {key!r} to be deleted")
    assert "LOST" not in states.seen
    assert session.book.nodes() == []
    for key in ("a", "b"):
        with client.lock(key, wait=BOUND) as lease:
            assert len(contenders(raw, namespace, key)) == 1
            assert lease.fencing_token > 0


@pytest.mark.slow
def test_server_killed_and_restarted_while_one_waits_and_one_tries(
    own_zk: ZooKeeperServer,
    gate: Gate,
    make: Callable[..., LockClient],
    connect: Callable[..., Any],
    namespace: str,
) -> None:
    """kill -9 of the server with a holder and a waiter (sessions of 8 s survive a restart on
    the same data): a try sent while it is down fails (transient) and leaves nothing once the
    server is back (its create, sent after the reconnection, is deleted); the holder still
    holds (same session, lease not lost), its release hands the lock to the waiter, and at
    that moment the waiter's node is the only one."""
    holder = make(gate, "?session_timeout=8")
    waiter = make(gate, "?session_timeout=8")
    tryer = make(gate, "?session_timeout=8&request_timeout=0.5")
    with tryer.lock("warm-up"):
        pass
    raw = connect(own_zk)
    taken: list[tuple[int, list[str]]] = []

    def wait_for_it() -> None:
        with waiter.lock("k", wait=BOUND) as lease:
            taken.append(
                (lease.fencing_token, [owner(raw, namespace, "k", name) for name in contenders(raw, namespace, "k")])
            )

    with holder.lock("k") as lease:
        thread = threading.Thread(target=wait_for_it, daemon=True)
        thread.start()
        until(lambda: len(waiting(own_zk, raw, namespace, "k")) == 1, "the waiter to queue")
        before = session_of(holder)
        gate.shut()
        raw.stop()
        own_zk.kill()
        with pytest.raises(BackendError) as info, tryer.lock("k"):
            pass
        assert info.value.transient
        own_zk.restart()
        gate.open()
        raw = connect(own_zk)
        session = holder.backend._session
        until(lambda: session.connected and session.verified, "the holder to reconnect")
        assert session_of(holder) == before
        until(lambda: tryer.backend._session.connected, "the tryer to reconnect")
        until(lambda: len(contenders(raw, namespace, "k")) == 2, "only the holder and the waiter")
        assert not lease.lost
        assert taken == []
    thread.join(BOUND)
    (token, owners) = taken[0]
    assert token > lease.fencing_token
    assert owners[0] == session_of(waiter)  # first in line: the old holder's node is gone
    assert session_of(holder) not in owners
    until(lambda: contenders(raw, namespace, "k") == [], "every node to go, the try's included")
    assert tryer.backend._session.book.nodes() == []


# -- a held node deleted after a same-session reconnection ------------------------------------------


def test_a_force_release_while_the_holder_is_cut_off_is_noticed_on_reconnection(
    own_zk: ZooKeeperServer, gate: Gate, make: Callable[..., LockClient]
) -> None:
    """An operator force-releases the key while the holder's connection is down: when the
    holder reconnects (same session) it re-reads its held node, finds it gone and is told
    (reason 'not-owner'), before its renewals trust the session again."""
    told = Told()
    holder = make(gate, "?session_timeout=8", watchdog_lease=60.0)
    operator = make(own_zk)
    seen: list[Any] = []

    def hold() -> None:
        with holder.lock("k", on_lost=told.on_lost) as lease:
            seen.append(lease)
            before = session_of(holder)
            gate.shut()
            until(lambda: not holder.backend._session.connected, "the holder to be cut off")
            assert operator.backend.force_release("k")
            gate.open()
            assert told.event.wait(BOUND)
            assert session_of(holder) == before
            assert lease.lost_reason == "not-owner"

    with pytest.raises(LockLost) as info:
        hold()
    assert info.value.exception is None, info.value.exception
    assert info.value.reason == "not-owner"
    with operator.lock("k") as again:
        assert again.fencing_token > seen[0].fencing_token


def test_a_force_release_after_a_same_session_reconnect_is_noticed(
    own_zk: ZooKeeperServer, gate: Gate, make: Callable[..., LockClient]
) -> None:
    """The holder's connection is cut and comes back at once on the same session (same
    node); then an operator force-releases the key and takes it. The holder must be told
    (reason 'not-owner') while the operator holds it, as it is without the cut (see
    test_store.py), not go on as a second holder."""
    told = Told()
    holder = make(gate, "?session_timeout=8", watchdog_lease=60.0)
    operator = make(own_zk)
    noticed: list[bool] = []

    def hold() -> None:
        with holder.lock("k", on_lost=told.on_lost) as lease:
            before = session_of(holder)
            states = States(holder)
            gate.cut()
            states.wait("SUSPENDED")
            states.wait("CONNECTED")
            session = holder.backend._session
            until(lambda: session.connected and session.verified, "the holder to reconnect")
            assert session_of(holder) == before
            assert not lease.lost
            assert operator.backend.force_release("k")
            with operator.lock("k", wait=BOUND):
                # the operator's client holds the lock now: the old holder must know it does not
                noticed.append(told.event.wait(3.0))

    with pytest.raises(LockLost) as info:
        hold()
    assert info.value.exception is None, info.value.exception
    assert noticed == [True]
    assert told.hooks[0][1] == "not-owner"


@pytest.mark.slow
def test_a_failed_re_read_after_a_reconnection_does_not_lose_every_lease_later(
    own_zk: ZooKeeperServer, gate: Gate, make: Callable[..., LockClient]
) -> None:
    """The holder's connection is cut and comes back on the same session, and the server
    stops answering just then (SIGSTOP from the CONNECTED listener) for 2 s: longer than the
    request timeout (0.5 s), not long enough to suspend the connection; the re-read of the
    held node gets no reply in time. Once the server answers again, the session and the
    node are fine: the lease must be renewed again, not reported lost."""
    renewed = threading.Event()

    def observe(event: LockEvent) -> None:
        if event.name == "renewed" and event.number:
            renewed.set()

    holder = make(gate, "?session_timeout=8&request_timeout=0.5", watchdog_lease=3.0, observers=[observe])
    session = holder.backend._session
    outcome: list[bool] = []

    def hold() -> None:
        with holder.lock("k") as lease:
            before = session_of(holder)
            stopped = threading.Event()

            def on_state(state: str) -> bool:
                if state == "CONNECTED":
                    own_zk.pause()  # before the re-read can be answered
                    stopped.set()
                    return True  # remove this listener
                return False

            kazoo_of(holder).add_listener(on_state)
            try:
                gate.cut()
                assert stopped.wait(BOUND)
                # the fault: no answer for 2 s, four request timeouts (the connection, whose
                # heartbeats allow 8 * 2/3 s of silence, stays up)
                threading.Event().wait(2.0)
            finally:
                own_zk.resume()
            assert session_of(holder) == before
            renewed.clear()
            until(lambda: renewed.is_set() or lease.lost, "a renewal or a loss")
            outcome.append(lease.lost)

    with contextlib.suppress(LockLost):
        hold()
    assert outcome == [False]  # renewed, not lost
    assert session.verified


# -- 3, 7. processes killed with SIGKILL ---------------------------------------------------------------

HOLDER = """
import sys, threading
from lockaspect import LockClient

url, namespace, key = sys.argv[1:4]
client = LockClient.from_url(url, namespace=namespace, tick=0.05)
with client.lock(key, wait=60) as lease:
    print(lease.fencing_token, flush=True)
    threading.Event().wait()
"""

WAITER = """
import sys
from lockaspect import LockClient

url, namespace, key = sys.argv[1:4]
client = LockClient.from_url(url, namespace=namespace, tick=0.05)
with client.lock(key, wait=120):
    print("acquired", flush=True)
"""


def spawn(script: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env()
    )


@pytest.mark.slow
def test_a_killed_holder_process_frees_the_lock_when_its_session_ends(
    zk: ZooKeeperServer, make: Callable[..., LockClient], connect: Callable[..., Any], namespace: str
) -> None:
    """kill -9 of a holder process (session timeout 1 s): the waiter of another client, which
    could not get the lock while the holder lived, gets it once the server ended the dead
    session, with a larger fencing token, and the dead holder's node is gone."""
    raw = connect(zk)
    holder = spawn(HOLDER, zk.url + "?session_timeout=1", namespace, "k")
    try:
        assert holder.stdout is not None
        held = int(holder.stdout.readline())
        (dead,) = contenders(raw, namespace, "k")
        waiter = make(zk)
        taken: list[tuple[int, list[str]]] = []

        def wait_for_it() -> None:
            with waiter.lock("k", wait=BOUND) as lease:
                taken.append((lease.fencing_token, contenders(raw, namespace, "k")))

        thread = threading.Thread(target=wait_for_it, daemon=True)
        thread.start()
        until(lambda: len(waiting(zk, raw, namespace, "k")) == 1, "the waiter to queue")
        assert taken == []
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(BOUND)
        thread.join(BOUND)
        (token, queue) = taken[0]
        assert token > held
        assert dead not in queue
        assert len(queue) == 1
    finally:
        holder.kill()
        holder.communicate()


@pytest.mark.slow
def test_a_dead_waiter_in_the_middle_of_the_queue_is_skipped_when_its_session_ends(
    zk: ZooKeeperServer, make: Callable[..., LockClient], connect: Callable[..., Any], namespace: str
) -> None:
    """Holder A, waiter B (a process, SIGKILLed while waiting, session timeout 1 s), waiter C:
    when A releases, C gets the lock, never while B's node is still queued ahead of it (FIFO),
    and never waits forever."""
    raw = connect(zk)
    holder, last = make(zk), make(zk)
    taken: list[tuple[int, list[str]]] = []
    with holder.lock("k") as lease:
        (held,) = contenders(raw, namespace, "k")
        middle = spawn(WAITER, zk.url + "?session_timeout=1", namespace, "k")
        try:
            until(lambda: len(waiting(zk, raw, namespace, "k")) == 1, "the middle waiter to queue")
            dead = contenders(raw, namespace, "k")[1]

            def wait_for_it() -> None:
                with last.lock("k", wait=BOUND) as mine:
                    taken.append((mine.fencing_token, contenders(raw, namespace, "k")))

            thread = threading.Thread(target=wait_for_it, daemon=True)
            thread.start()
            until(lambda: len(waiting(zk, raw, namespace, "k")) == 2, "the last waiter to queue")
            os.kill(middle.pid, signal.SIGKILL)
            middle.wait(BOUND)
        finally:
            middle.kill()
            out, _ = middle.communicate()
        assert out == b""  # it never got the lock
    thread.join(BOUND)
    (token, queue) = taken[0]
    assert token > lease.fencing_token
    assert held not in queue
    assert dead not in queue
    assert len(queue) == 1


@pytest.mark.slow
def test_a_waiter_killed_while_the_lock_is_free_does_not_block_the_next(
    zk: ZooKeeperServer, make: Callable[..., LockClient], connect: Callable[..., Any], namespace: str
) -> None:
    """The middle waiter B is killed after A released (B's node is first in line, a dead
    "holder"): C gets the lock once B's session ends."""
    raw = connect(zk)
    holder, last = make(zk), make(zk)
    taken: list[int] = []
    middle = spawn(HOLDER, zk.url + "?session_timeout=1", namespace, "k")
    try:
        assert middle.stdout is not None
        with holder.lock("k"):
            until(lambda: len(waiting(zk, raw, namespace, "k")) == 1, "the middle waiter to queue")
            thread = threading.Thread(target=lambda: taken.append(_take(last, "k")), daemon=True)
            thread.start()
            until(lambda: len(waiting(zk, raw, namespace, "k")) == 2, "the last waiter to queue")
        held = int(middle.stdout.readline())  # B holds now: A released
        assert taken == []
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait(BOUND)
        thread.join(BOUND)
        assert taken
        assert taken[0] > held
    finally:
        middle.kill()
        middle.communicate()
