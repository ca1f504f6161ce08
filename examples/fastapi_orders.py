"""A FastAPI order service: one order per user, however many requests arrive at once.

    POST /orders/{user_id}  {"item": "book"}
        201  {"order_id", "user_id", "item", "fencing_token"}   the user's order, placed now
        200  the same order                                     the user had ordered already
        409  {"error": "busy", "key": "order:<user_id>", "retry_after": n}, Retry-After: n
                                                                another request for this user
                                                                holds the user's lock
        503  {"error": "lock_lost", ...}                        the lock was lost meanwhile
    GET /orders/{user_id}   200 the order, 404 none

The endpoint itself is an ``async def`` under ``@distributed_lock(key="order:<user_id>")``:
"has this user ordered?" and "record the order" are two round trips to the store, and the
per-user lock keeps any other request for the same user (on this worker or any other
replica) out of the gap between them. With the default ``wait=0``, a request that finds the
lock busy raises ``LockNotAcquired``, which ``lockaspect.contrib.starlette``'s exception
handlers answer with 409 and a ``Retry-After``, never a 500 and a logged traceback.

``lockaspect_lifespan`` builds the LockClient from ``LOCKASPECT_URL``, checks the store at
start-up (a wrong URL or password fails the start, not the first order), makes it the
decorators' default and closes it at shutdown; the app's own lifespan (the order data's
Redis connection) runs inside it.

Run it as a script: it serves the app with uvicorn on a free loopback port, sends 200
concurrent requests for 50 users through httpx, checks that every user has exactly one order
and that every other answer is a 200 or a 409 with Retry-After, deletes the keys it wrote,
and exits non-zero if anything does not hold:

    .venv/bin/python examples/fastapi_orders.py          # starts a throwaway Valkey server
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/fastapi_orders.py

Serve it yourself with ``LOCKASPECT_URL=... .venv/bin/uvicorn fastapi_orders:app`` from
examples/. Needs ``pip install fastapi uvicorn httpx2`` (all three are in the ``test`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2 as httpx
import redis.asyncio as aredis
import uvicorn
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel

from lockaspect import current_lease, distributed_lock
from lockaspect.contrib.starlette import lockaspect_lifespan, make_exception_handlers


class OrderIn(BaseModel):
    item: str


def create_app(*, url: str | None = None, namespace: str | None = None) -> FastAPI:
    """The order service on the store ``url`` (default ``$LOCKASPECT_URL``, read at start-up).

    Lock keys and the order data live under ``namespace`` (default a fresh one per app), so
    that :func:`delete_keys` can remove everything the app wrote.
    """
    prefix = namespace or f"fastapi-orders-{uuid.uuid4().hex[:8]}:"

    @contextlib.asynccontextmanager
    async def orders_store(app: FastAPI) -> AsyncIterator[None]:
        # Runs inside lockaspect_lifespan: the lock client is checked and configured already.
        data = aredis.Redis.from_url(url or os.environ["LOCKASPECT_URL"], decode_responses=True)
        app.state.orders = data
        app.state.orders_key = f"{prefix}data:orders"
        app.state.log_key = f"{prefix}data:placed"
        try:
            yield
        finally:
            await data.aclose()

    app = FastAPI(
        title="orders",
        lifespan=lockaspect_lifespan(url=url, namespace=prefix, lifespan=orders_store),
        # 409 + Retry-After for a busy lock, 503 for a lost one. The holder's lock is renewed
        # while it works (watchdog mode), so its remaining lease (up to 30 s) says little about
        # when it is done: cap the hint.
        exception_handlers=make_exception_handlers(max_retry_after=2),
    )

    @app.post("/orders/{user_id}", status_code=201)
    @distributed_lock(key="order:<user_id>")
    async def place_order(user_id: str, order: OrderIn, request: Request, response: Response) -> dict[str, Any]:
        data: aredis.Redis = request.app.state.orders
        existing = await data.hget(request.app.state.orders_key, user_id)
        if existing is not None:
            response.status_code = 200
            return dict(json.loads(existing))
        lease = current_lease()
        assert lease is not None
        placed = {
            "order_id": uuid.uuid4().hex,
            "user_id": user_id,
            "item": order.item,
            # Strictly larger for every later holder of order:<user_id>: a database could
            # refuse writes that carry an older one (see docs/concepts/fencing.md).
            "fencing_token": lease.fencing_token,
        }
        async with data.pipeline(transaction=True) as pipe:
            pipe.hset(request.app.state.orders_key, user_id, json.dumps(placed))
            pipe.rpush(request.app.state.log_key, user_id)  # one entry per order ever placed
            await pipe.execute()
        return placed

    @app.get("/orders/{user_id}")
    async def get_order(user_id: str, request: Request, response: Response) -> dict[str, Any]:
        existing = await request.app.state.orders.hget(request.app.state.orders_key, user_id)
        if existing is None:
            response.status_code = 404
            return {"error": "no order", "user_id": user_id}
        return dict(json.loads(existing))

    app.state.namespace = prefix
    return app


app = create_app()


class _Server(uvicorn.Server):
    """uvicorn's server, telling another thread when its start-up is over (ready or failed)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.startup_done = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.startup_done.set()


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread on a free loopback port; yield its base URL.

    The socket is bound here (port 0: the kernel picks a free one) and handed to uvicorn.
    Start-up (the lifespan, and so the store check) has succeeded when this yields; a failed
    start-up raises here.
    """
    sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
    host, port = sock.getsockname()[:2]
    # log_config=None: leave the process's logging configuration alone.
    config = uvicorn.Config(app, lifespan="on", log_config=None, access_log=False, timeout_graceful_shutdown=5)
    server = _Server(config)

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except SystemExit:  # how uvicorn ends a failed start-up (after logging why); raised below
            pass

    thread = threading.Thread(target=run, name="uvicorn", daemon=True)
    thread.start()
    try:
        server.startup_done.wait()
        if not server.started:
            thread.join()
            raise RuntimeError("the app did not start (see uvicorn's log above)")
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


async def flood(base_url: str, users: list[str], item: str = "book") -> list[httpx.Response]:
    """POST an order for each entry of ``users`` (a user may repeat), all at once."""
    limits = httpx.Limits(max_connections=len(users), max_keepalive_connections=len(users))
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30.0, trust_env=False) as http:
        return list(await asyncio.gather(*(http.post(f"/orders/{user}", json={"item": item}) for user in users)))


def check_orders(responses: list[httpx.Response], users: list[str], placed_log: list[str]) -> Counter[int]:
    """What concurrent orders must give, whatever the interleaving; returns the status counts."""
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 201, 409}, statuses
    assert len(placed_log) == len(set(placed_log)), f"a user got two orders: {sorted(placed_log)}"
    # Each user's requests: at least one got the lock (only they compete for it), so exactly
    # one order per user, placed by exactly one 201.
    assert sorted(placed_log) == sorted(set(users)), (sorted(placed_log), sorted(set(users)))
    created = [r.json() for r in responses if r.status_code == 201]
    assert sorted(order["user_id"] for order in created) == sorted(set(users))
    orders = {order["user_id"]: order for order in created}
    for response in responses:
        if response.status_code == 200:  # a later request of the user: the same order
            assert response.json() == orders[response.json()["user_id"]]
        elif response.status_code == 409:  # the user's lock was busy: come back later
            body = response.json()
            assert body["error"] == "busy", body
            assert body["key"].startswith("order:"), body
            assert response.headers["retry-after"] == str(body["retry_after"]), (response.headers, body)
            assert 1 <= body["retry_after"] <= 2, body  # max_retry_after=2
    return statuses


async def delete_keys(url: str, namespace: str) -> int:
    """Delete every key under ``namespace`` (lock fences, the order data); returns how many."""
    async with aredis.Redis.from_url(url) as redis:
        keys = [key async for key in redis.scan_iter(match=f"{namespace}*", count=1000)]
        return int(await redis.delete(*keys)) if keys else 0


async def placed_log(url: str, app: FastAPI) -> list[str]:
    async with aredis.Redis.from_url(url, decode_responses=True) as redis:
        return list(await redis.lrange(app.state.namespace + "data:placed", 0, -1))


def main() -> None:
    with contextlib.ExitStack() as stack:
        url = os.environ.get("LOCKASPECT_URL")
        if not url:
            from lockaspect.testing import LockServer  # pip install 'lockaspect[demo]'

            url = stack.enter_context(LockServer()).url
            os.environ["LOCKASPECT_URL"] = url
            print(f"started a throwaway server on {url}")
        shop = create_app(url=url)
        stack.callback(lambda: print(f"deleted {asyncio.run(delete_keys(url, shop.state.namespace))} keys"))
        base_url = stack.enter_context(serve(shop))
        print(f"serving on {base_url}")

        users = [f"user-{i % 50:02d}" for i in range(200)]  # 4 requests per user, interleaved
        print(f"1. {len(users)} concurrent POST /orders/<user> for {len(set(users))} users")
        responses = asyncio.run(flood(base_url, users))
        statuses = check_orders(responses, users, asyncio.run(placed_log(url, shop)))
        print(f"  {statuses[201]} placed, {statuses[200]} already placed, {statuses[409]} busy (409, Retry-After)")

        print("2. the orders stay put: a later request gets the same order, with 200")
        again = httpx.post(f"{base_url}/orders/user-07", json={"item": "pen"}, trust_env=False)
        assert again.status_code == 200, again.text
        assert again.json() == httpx.get(f"{base_url}/orders/user-07", trust_env=False).json()
        print(f"  {again.status_code} {again.json()}")
    print("ok")


if __name__ == "__main__":
    main()
