"""lockaspect.contrib.starlette: the exception handlers and the lifespan, on Starlette and
FastAPI apps driven through their TestClient, with the locks on the session's Valkey."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient as FastAPITestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from lockaspect import BackendError, ConfigurationError, LockClient, LockNotAcquired, config, distributed_lock
from lockaspect.contrib.starlette import (
    exception_handlers,
    lockaspect_lifespan,
    make_exception_handlers,
    retry_after,
)
from lockaspect.testing import LockServer


@distributed_lock(key="job:<request.path_params['name']>")
async def run_job(request: Request) -> JSONResponse:
    name = request.path_params["name"]
    if request.query_params.get("steal"):
        # Delete our own lock from the store, as an expiry or a failover would: the release
        # then finds the key gone, and the call raises LockLost instead of returning.
        state = request.app.state
        raw = state.raw
        raw.delete(f"{state.lockaspect.backend.namespace}{{job:{name}}}")
    return JSONResponse({"done": name})


async def unknown_holder(request: Request) -> JSONResponse:
    raise LockNotAcquired("busy", key="job:x", waited=0.0, holder_ttl=None)


ROUTES = [Route("/jobs/{name}", run_job, methods=["POST"]), Route("/unknown", unknown_holder, methods=["POST"])]


@pytest.fixture
def make_app(
    lock_server: LockServer, namespace: str, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Starlette]:
    monkeypatch.setenv("LOCKASPECT_URL", lock_server.url)

    def make(handlers: Any = exception_handlers, **lifespan_options: Any) -> Starlette:
        lifespan_options.setdefault("namespace", namespace)
        app = Starlette(routes=ROUTES, exception_handlers=handlers, lifespan=lockaspect_lifespan(**lifespan_options))
        app.state.raw = raw
        return app

    return make


def test_retry_after_rounds_up_to_whole_seconds_at_least_one() -> None:
    assert retry_after(2.001) == 3
    assert retry_after(2.0) == 2
    assert retry_after(0.2) == 1
    assert retry_after(0.0) == 1
    assert retry_after(-1.0) == 1
    assert retry_after(None) == 1
    assert retry_after(None, default=7.5) == 8
    assert retry_after(29.3, maximum=5) == 5
    assert retry_after(0.4, maximum=5) == 1


def test_a_busy_lock_is_409_with_retry_after_from_the_holders_lease(
    make_app: Callable[..., Starlette], make_client: Callable[..., LockClient], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with TestClient(make_app()) as http:
        started = time.monotonic()
        with make_client().lock("job:nightly", lease=10.0):  # another owner, a 10 s lease
            busy = http.post("/jobs/nightly")
        elapsed = time.monotonic() - started
        free = http.post("/jobs/nightly")
    assert busy.status_code == 409, busy.text
    seconds = int(busy.headers["retry-after"])
    # The holder's remaining lease when the request found it busy, rounded up.
    assert 10 - elapsed <= seconds <= 10
    assert busy.json() == {"error": "busy", "key": "job:nightly", "retry_after": seconds}
    assert free.status_code == 200, free.text
    # Logged at DEBUG, without a traceback; nothing logged an error.
    busy_logs = [r for r in caplog.records if r.name == "lockaspect.contrib.starlette"]
    assert [r.levelno for r in busy_logs] == [logging.DEBUG]
    assert "job:nightly" in busy_logs[0].getMessage()
    assert all(r.exc_info is None and r.levelno < logging.WARNING for r in caplog.records), caplog.text


def test_an_unknown_holder_lease_gives_the_default_retry_after(make_app: Callable[..., Starlette]) -> None:
    with TestClient(make_app()) as http:
        default = http.post("/unknown")
    with TestClient(make_app(make_exception_handlers(default_retry_after=4.2))) as http:
        custom = http.post("/unknown")
    assert (default.status_code, default.headers["retry-after"], default.json()["retry_after"]) == (409, "1", 1)
    assert (custom.status_code, custom.headers["retry-after"], custom.json()["retry_after"]) == (409, "5", 5)


@pytest.mark.parametrize("status", [423, 429])
def test_the_busy_status_is_configurable(
    make_app: Callable[..., Starlette], make_client: Callable[..., LockClient], status: int
) -> None:
    handlers = make_exception_handlers(busy_status=status, max_retry_after=3, include_key=False)
    with TestClient(make_app(handlers)) as http, make_client().lock("job:nightly"):
        busy = http.post("/jobs/nightly")
    assert busy.status_code == status
    assert busy.headers["retry-after"] == "3"  # a 30 s watchdog lease, capped
    assert busy.json() == {"error": "busy", "retry_after": 3}


def test_bad_statuses_and_seconds_are_refused() -> None:
    for status in (200, 302, 600, True, "409"):
        with pytest.raises(ConfigurationError, match="busy_status"):
            make_exception_handlers(busy_status=status)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="lost_status"):
        make_exception_handlers(lost_status=399)
    with pytest.raises(ConfigurationError, match="default_retry_after"):
        make_exception_handlers(default_retry_after=0)
    with pytest.raises(ConfigurationError, match="max_retry_after"):
        make_exception_handlers(max_retry_after=float("inf"))


def test_a_lost_lock_is_503_not_500(make_app: Callable[..., Starlette], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lockaspect.contrib.starlette")
    with TestClient(make_app(), raise_server_exceptions=False) as http:
        lost = http.post("/jobs/nightly?steal=1")
    assert lost.status_code == 503, lost.text
    assert lost.headers["retry-after"] == "1"
    assert lost.json() == {"error": "lock_lost", "key": "job:nightly", "reason": "not-owner", "retry_after": 1}
    (record,) = [r for r in caplog.records if r.name == "lockaspect.contrib.starlette"]
    assert record.levelno == logging.INFO
    assert record.exc_info is None


def test_fastapi_takes_the_handlers_by_update(lock_server: LockServer, make_client: Callable[..., LockClient]) -> None:
    client = make_client()
    app = FastAPI(lifespan=lockaspect_lifespan(client))
    app.exception_handlers.update(exception_handlers)

    @app.post("/reports/{account}")
    @distributed_lock(key="report:<account>")
    async def report(account: str) -> dict[str, str]:
        return {"account": account}

    with FastAPITestClient(app) as http:
        assert config.default_client() is client
        with make_client().lock("report:acme"):
            busy = http.post("/reports/acme")
        done = http.post("/reports/acme")
    assert busy.status_code == 409, busy.text
    assert busy.json()["key"] == "report:acme"
    assert done.json() == {"account": "acme"}
    assert client.closed


def test_the_lifespan_builds_checks_configures_and_closes(make_app: Callable[..., Starlette], namespace: str) -> None:
    policies = {"jobs.nightly": {"wait": 0.25}}
    app = make_app(policies=policies, watchdog_lease=12.0, defaults={"wait": 0.5})
    with TestClient(app) as http:
        client = app.state.lockaspect
        assert isinstance(client, LockClient)
        assert client.backend.namespace == namespace  # client options go to from_url
        assert client.watchdog_lease == 12.0
        assert client.defaults == {"wait": 0.5}
        assert config.default_client() is client
        assert config.get_policy("jobs.nightly") == {"wait": 0.25}
        assert http.post("/jobs/a").json() == {"done": "a"}
        assert not client.closed
    assert client.closed
    assert client.threads() == []


def test_a_client_passed_in_is_used_and_closed_unless_told(make_client: Callable[..., LockClient]) -> None:
    kept, closed = make_client(), make_client()
    for client, close in ((kept, False), (closed, True)):
        app = Starlette(routes=ROUTES, lifespan=lockaspect_lifespan(client, close=close, set_default=False))
        before = config._client
        with TestClient(app):
            assert app.state.lockaspect is client
            assert config._client is before  # set_default=False
    assert not kept.closed
    assert closed.closed


def test_the_apps_own_lifespan_runs_inside_and_its_state_comes_through(
    make_app: Callable[..., Starlette], make_client: Callable[..., LockClient]
) -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def own(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        # The client is checked and configured already: the app's start-up can lock.
        async with app.state.lockaspect.lock("migrations"):
            events.append("start-up under a lock")
        yield {"greeting": "hello"}
        async with app.state.lockaspect.lock("migrations"):
            events.append("shutdown under a lock")

    async def greet(request: Request) -> JSONResponse:
        return JSONResponse({"greeting": request.state.greeting})

    app = Starlette(routes=[Route("/", greet)], lifespan=lockaspect_lifespan(make_client(), lifespan=own))
    with TestClient(app) as http:
        assert http.get("/").json() == {"greeting": "hello"}
    assert events == ["start-up under a lock", "shutdown under a lock"]
    assert app.state.lockaspect.closed


@pytest.mark.parametrize("passed_in", [False, True], ids=["url", "client"])
def test_a_store_that_cannot_be_reached_fails_the_start_up(passed_in: bool) -> None:
    with LockServer() as gone:
        url = gone.url
    client = LockClient.from_url(url) if passed_in else None
    lifespan = lockaspect_lifespan(client) if client is not None else lockaspect_lifespan(url=url)
    app = Starlette(routes=ROUTES, lifespan=lifespan)
    before = config._client
    with pytest.raises(BackendError, match="nothing answers"), TestClient(app):
        pass
    assert config._client is before  # not made the default
    assert getattr(app.state, "lockaspect", None) is None
    if client is not None:
        assert client.closed  # closed on the failed start-up, as at shutdown


def test_a_database_the_server_does_not_have_fails_the_start_up(lock_server: LockServer) -> None:
    url = lock_server.url.rsplit("/", 1)[0] + "/999"
    app = Starlette(routes=ROUTES, lifespan=lockaspect_lifespan(url=url))
    with pytest.raises(ConfigurationError, match="999"), TestClient(app):
        pass
    assert getattr(app.state, "lockaspect", None) is None


def test_without_a_url_the_start_up_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCKASPECT_URL", raising=False)
    app = Starlette(routes=ROUTES, lifespan=lockaspect_lifespan())
    with pytest.raises(ConfigurationError, match="LOCKASPECT_URL"), TestClient(app):
        pass


def test_a_client_and_a_url_together_are_refused(make_client: Callable[..., LockClient]) -> None:
    with pytest.raises(ConfigurationError, match="not both"):
        lockaspect_lifespan(make_client(), url="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigurationError, match="not both"):
        lockaspect_lifespan(make_client(), namespace="x:")
    with pytest.raises(TypeError, match="LockClient"):
        lockaspect_lifespan("redis://127.0.0.1:1/0")  # type: ignore[call-overload]
