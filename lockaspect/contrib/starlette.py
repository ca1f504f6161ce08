"""Starlette and FastAPI: HTTP answers for busy and lost locks, and a lifespan for the client.

``pip install 'lockaspect[starlette]'`` (FastAPI is built on Starlette: everything here works
for a FastAPI app too)::

    from lockaspect.contrib.starlette import exception_handlers, lockaspect_lifespan

    app = FastAPI(lifespan=lockaspect_lifespan(defaults={"wait": 0.5}))
    app.exception_handlers.update(exception_handlers)

* :data:`exception_handlers` (or :func:`make_exception_handlers` for other statuses) turns a
  :class:`~lockaspect.LockNotAcquired` that escapes an endpoint into ``409 Conflict`` with a
  ``Retry-After`` header, and a :class:`~lockaspect.LockLost` into ``503 Service
  Unavailable``, each with a small JSON body, instead of a 500 and a logged traceback.
* :func:`lockaspect_lifespan` builds the :class:`~lockaspect.LockClient` (or takes yours),
  checks the store at start-up (``await client.acheck()``: a wrong URL, password, database or
  TLS setting fails the app's start, not its first request), makes it the process-wide default
  the decorators use, and closes it at shutdown.

docs/integrations/starlette.md has the whole story; examples/fastapi_orders.py an app.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar, overload

from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response

from lockaspect import config as _config
from lockaspect.client import LockClient
from lockaspect.errors import ConfigurationError, LockLost, LockNotAcquired

__all__ = [
    "ExceptionHandler",
    "ExceptionHandlers",
    "exception_handlers",
    "lockaspect_lifespan",
    "make_exception_handlers",
    "retry_after",
]

log = logging.getLogger("lockaspect.contrib.starlette")

AppT = TypeVar("AppT")
StateT = TypeVar("StateT")

#: The type of the handlers, as FastAPI spells it (Starlette's is wider). They also answer a
#: WebSocket's handshake: Starlette sends the response as a denial, where the server can.
ExceptionHandler = Callable[[Request, Any], Coroutine[Any, Any, Response]]
#: The type of the mapping: what ``FastAPI(exception_handlers=...)`` takes (its keys may be
#: status codes too), and so what ``Starlette(...)`` and ``app.exception_handlers.update``
#: take.
ExceptionHandlers = dict[int | type[Exception], ExceptionHandler]


def retry_after(seconds: float | None, *, default: float = 1.0, maximum: float | None = None) -> int:
    """The value of a ``Retry-After`` header for a wait of ``seconds``.

    Whole seconds (the header has no fractions), rounded up so that a client that obeys it
    does not come back before then, and at least 1 (``Retry-After: 0`` invites a busy loop).

    Args:
        seconds: Typically :attr:`LockNotAcquired.holder_ttl <lockaspect.LockNotAcquired>`,
            the holder's remaining lease as the store last reported it; ``None`` (unknown, or a
            lock without expiry) gives ``default``.
        default: Seconds to use when ``seconds`` is ``None``.
        maximum: Cap applied before rounding, or ``None`` for none.
    """
    value = default if seconds is None else seconds
    if maximum is not None:
        value = min(value, maximum)
    return max(1, math.ceil(value))


def _check_status(name: str, status: int) -> int:
    if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
        raise ConfigurationError(f"{name} must be an HTTP error status (400-599), got {status!r}")
    return status


def _check_seconds(name: str, value: float | None, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ConfigurationError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def make_exception_handlers(
    busy_status: int = 409,
    *,
    lost_status: int = 503,
    default_retry_after: float = 1.0,
    max_retry_after: float | None = None,
    lost_retry_after: float = 1.0,
    include_key: bool = True,
) -> ExceptionHandlers:
    """Exception handlers that answer lockaspect's lock errors with a proper HTTP status.

    Pass the result to ``Starlette(exception_handlers=...)``/``FastAPI(exception_handlers=...)``
    or merge it into an existing app's: ``app.exception_handlers.update(...)`` (before the app
    serves its first request: Starlette builds its middleware then).

    * :class:`~lockaspect.LockNotAcquired` (the lock stayed busy for the whole ``wait``):
      ``busy_status`` with ``Retry-After: n`` and the body
      ``{"error": "busy", "key": "order:42", "retry_after": n}``. ``n`` is the holder's
      remaining lease (``exc.holder_ttl``) rounded up to whole seconds, at least 1;
      ``default_retry_after`` when the store did not say. Logged at DEBUG, no traceback.
    * :class:`~lockaspect.LockLost` (the lease ended while the endpoint ran, so its work was
      not protected by the lock): ``lost_status`` with ``Retry-After: lost_retry_after``
      and ``{"error": "lock_lost", "key": ..., "reason": "not-owner", "retry_after": n}``.
      Logged at INFO (the watchdog already logged the loss itself as a WARNING).

    Subclasses of the two are covered too; other :class:`~lockaspect.LockError` subclasses
    (a bad key template, a store that is down) are bugs or outages and stay 500s.

    Args:
        busy_status: 409 Conflict (default), 423 Locked or 429 Too Many Requests, as your API
            prefers; any 4xx/5xx is accepted.
        lost_status: The status for a lost lock (default 503 Service Unavailable).
        default_retry_after: Seconds to send when the holder's lease is unknown.
        max_retry_after: Cap on the busy ``Retry-After``, or ``None``. Worth setting in
            watchdog mode: the holder's lease is then renewed while it works, so its remaining
            lease (up to the client's ``watchdog_lease``, 30 s by default) says when the lock
            frees at the latest if the holder dies, not when it will be released.
        lost_retry_after: Seconds to send with a lost lock.
        include_key: Put the rendered lock key in the body (default). Set ``False`` when the
            key holds something the caller must not see.

    Raises:
        ConfigurationError: a status outside 400-599 or a number of seconds that is not > 0.
    """
    busy = _check_status("busy_status", busy_status)
    lost = _check_status("lost_status", lost_status)
    default = _check_seconds("default_retry_after", default_retry_after, optional=False)
    maximum = _check_seconds("max_retry_after", max_retry_after, optional=True)
    lost_after = retry_after(_check_seconds("lost_retry_after", lost_retry_after, optional=False))
    assert default is not None

    def body(error: str, exc: LockNotAcquired | LockLost, seconds: int, **extra: Any) -> dict[str, Any]:
        content: dict[str, Any] = {"error": error}
        if include_key:
            content["key"] = exc.key
        return {**content, **extra, "retry_after": seconds}

    async def lock_not_acquired(conn: HTTPConnection, exc: Exception) -> Response:
        assert isinstance(exc, LockNotAcquired)
        seconds = retry_after(exc.holder_ttl, default=default, maximum=maximum)
        log.debug(
            "%s %s: lock %r is busy, answered %d (Retry-After %d)", _method(conn), conn.url.path, exc.key, busy, seconds
        )
        return JSONResponse(body("busy", exc, seconds), busy, headers={"Retry-After": str(seconds)})

    async def lock_lost(conn: HTTPConnection, exc: Exception) -> Response:
        assert isinstance(exc, LockLost)
        log.info("%s %s: lock %r was lost (%s), answered %d", _method(conn), conn.url.path, exc.key, exc.reason, lost)
        return JSONResponse(
            body("lock_lost", exc, lost_after, reason=exc.reason), lost, headers={"Retry-After": str(lost_after)}
        )

    return {LockNotAcquired: lock_not_acquired, LockLost: lock_lost}


def _method(conn: HTTPConnection) -> str:
    return str(conn.scope.get("method", "WEBSOCKET"))


#: ``make_exception_handlers()``: 409 with ``Retry-After`` for a busy lock, 503 for a lost one.
exception_handlers: ExceptionHandlers = make_exception_handlers()


@overload
def lockaspect_lifespan(
    client: LockClient | None = None,
    *,
    url: str | None = None,
    policies: Mapping[str, Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    check: bool = True,
    set_default: bool = True,
    close: bool = True,
    lifespan: None = None,
    **client_options: Any,
) -> Callable[[Any], AbstractAsyncContextManager[None]]: ...


@overload
def lockaspect_lifespan(
    client: LockClient | None = None,
    *,
    url: str | None = None,
    policies: Mapping[str, Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    check: bool = True,
    set_default: bool = True,
    close: bool = True,
    lifespan: Callable[[AppT], AbstractAsyncContextManager[StateT]],
    **client_options: Any,
) -> Callable[[AppT], AbstractAsyncContextManager[StateT]]: ...


def lockaspect_lifespan(
    client: LockClient | None = None,
    *,
    url: str | None = None,
    policies: Mapping[str, Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    check: bool = True,
    set_default: bool = True,
    close: bool = True,
    lifespan: Callable[[Any], AbstractAsyncContextManager[Any]] | None = None,
    **client_options: Any,
) -> Callable[[Any], AbstractAsyncContextManager[Any]]:
    """A lifespan that runs a :class:`~lockaspect.LockClient` for the app's lifetime.

    ``Starlette(lifespan=lockaspect_lifespan(url=...))``, ``FastAPI(lifespan=...)``. At
    start-up, in this order:

    1. the client: ``client`` as given, or ``LockClient.from_url(url, **client_options)``
       with ``url`` defaulting to the ``LOCKASPECT_URL`` environment variable;
    2. ``await client.acheck()`` (unless ``check=False``; see :meth:`LockClient.check`):
       connects, authenticates, selects the database, confirms the ACL permissions and loads
       the scripts, so a misconfigured store fails the start-up with a
       :class:`~lockaspect.ConfigurationError` or :class:`~lockaspect.BackendError` that says
       what to fix, instead of failing requests later;
    3. ``lockaspect.configure(client, policies=policies)`` (unless ``set_default=False``): the
       client every ``@distributed_lock`` without ``client=`` uses;
    4. ``app.state.lockaspect = client``, for handlers that lock by hand
       (``async with request.app.state.lockaspect.lock(...)``);
    5. your own ``lifespan``, if given: it runs inside, so it can take locks already, and what
       it yields (a state mapping, or ``None``) is what this lifespan yields.

    At shutdown your lifespan exits first, then ``await client.aclose()`` (unless
    ``close=False``): pending releases are awaited and the connections closed. A start-up
    that fails closes the client the same way. To nest it in your own lifespan instead::

        @contextlib.asynccontextmanager
        async def lifespan(app):
            async with lockaspect_lifespan(url=...)(app):
                yield

    Args:
        client: A client you built; then no ``url`` or client options.
        url: The store's URL (see :meth:`LockClient.from_url`); default ``$LOCKASPECT_URL``,
            read at start-up.
        policies: Named lock policies for :func:`lockaspect.configure` (configured also
            with ``set_default=False``; they replace the policies configured before).
        check: Check the store at start-up (default).
        set_default: Make the client the process-wide default (default). The default is
            per process: run one such app per process, or pass ``client=`` to the decorators.
        close: Close the client at shutdown (default), also one you passed in. A closed
            client cannot be used again: with ``close=True`` and your own client, the app
            can start only once; with ``close=False`` closing it is yours to do.
        lifespan: The app's own lifespan, run inside this one.
        **client_options: Passed to :meth:`LockClient.from_url`: ``namespace``,
            ``watchdog_lease``, ``observers``, ``defaults`` (the client-wide decorator
            defaults, e.g. ``{"wait": 0.5}``), driver options...

    Raises:
        ConfigurationError: at once for ``client`` together with ``url`` or client options;
            at start-up when there is no URL, or from the check.
    """
    if client is not None and (url is not None or client_options):
        raise ConfigurationError("pass either a client or url=/client options to lockaspect_lifespan(), not both")
    if client is not None and not isinstance(client, LockClient):
        raise TypeError(f"client must be a LockClient, got {type(client).__name__}")

    @contextlib.asynccontextmanager
    async def run(app: Any) -> AsyncIterator[Any]:
        locks = client if client is not None else LockClient.from_url(_store_url(url), **client_options)
        try:
            if check:
                await locks.acheck()
            if set_default:
                _config.configure(locks, policies=policies)
            elif policies is not None:
                _config.configure(policies=policies)
            state = getattr(app, "state", None)
            if state is not None:
                state.lockaspect = locks
            if lifespan is None:
                yield None
            else:
                async with lifespan(app) as inner:
                    yield inner
        finally:
            if close:
                await locks.aclose()

    return run


def _store_url(url: str | None) -> str:
    found = url or os.environ.get(_config.ENV_URL)
    if not found:
        raise ConfigurationError(
            "lockaspect_lifespan() has no store: pass url= or client=, or set the "
            f"{_config.ENV_URL} environment variable"
        )
    return found
