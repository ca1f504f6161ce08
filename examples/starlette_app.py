"""A Starlette order service: one order per user and a limited stock, under distributed locks.

    POST /orders/{user_id}  {"voucher": "FLASH50"}
        201  {"user_id", "voucher", "fencing_token", "stock_left"}   the order is placed
        409  {"error": "duplicate", "order": {...}}                  this user already ordered
        410  {"error": "sold out"}                                   no stock left
        423  {"error": "busy", "key": ...}, Retry-After              a lock stayed busy ("key" says which)
        503  {"error": "lock_lost", "reason": ...}, Retry-After      the user's lock was lost meanwhile
        404 / 400                                                    unknown voucher / bad body
    PUT /vouchers/{voucher}  {"stock": 10}    start a sale (200)
    GET /vouchers/{voucher}                   {"stock": n, "orders": {user_id: order}}

Two locks make two read-modify-writes safe across any number of workers and replicas:

* ``@distributed_lock(key="order:<user_id>")`` on ``async def place_order``: one request per
  user at a time, so "has this user ordered?" and "record the order" cannot interleave. How
  long a second request for the same user waits comes from the ``orders.place`` policy the
  lifespan configures (``order_wait``); if the lock stays busy, the async ``on_failure``
  answers 423 (or 409 if the user has an order by then) instead of raising.
* ``async with client.lock("stock:<voucher>")``: the stock is read, checked and written back
  (GET, then SET) under the voucher's lock, so it is never oversold. If that lock stays busy,
  the ``LockNotAcquired`` it raises goes to ``lockaspect.contrib.starlette``'s exception
  handlers (made with ``busy_status=423``): 423 with a ``Retry-After`` from the holder's
  remaining lease. A lock lost meanwhile (``LockLost``) becomes a 503 there.

The lifespan takes the store from ``LOCKASPECT_URL`` (or starts a throwaway server when that
is unset) and runs ``lockaspect_lifespan`` inside it, which builds the LockClient, checks the
store, configures the client as the decorators' default and closes it at shutdown.

Run it as a script: it drives itself through Starlette's TestClient (no web server needed),
then runs a flash sale of concurrent requests on the app's event loop and checks that
exactly the stock was sold, to distinct users. It exits non-zero if anything does not hold:

    .venv/bin/python examples/starlette_app.py
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/starlette_app.py

Serve it for real with any ASGI server, e.g. ``uvicorn starlette_app:app`` from examples/.
Needs ``pip install starlette httpx2`` (both are in the ``test`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx
import redis
import redis.asyncio as aredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from lockaspect import (
    FailureContext,
    LockClient,
    current_lease,
    distributed_lock,
)
from lockaspect.contrib.starlette import lockaspect_lifespan, make_exception_handlers


@dataclass(frozen=True)
class Shop:
    """What the handlers need, made by the lifespan and kept on ``app.state.shop``."""

    url: str  # the store: locks and data on the same server here
    locks: LockClient  # also the decorators' default client (configure())
    redis: aredis.Redis  # the shop's data
    namespace: str  # the LockClient's namespace; the data lives under namespace + "data:"
    stock_wait: float | None  # seconds to wait for a voucher's stock lock

    def stock_key(self, voucher: str) -> str:
        return f"{self.namespace}data:stock:{voucher}"

    def orders_key(self, voucher: str) -> str:
        return f"{self.namespace}data:orders:{voucher}"


def busy(key: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": "busy", "key": key, "detail": detail}, 423, headers={"Retry-After": "1"})


async def order_busy(ctx: FailureContext) -> JSONResponse:
    """on_failure for place_order: another request for this user holds its lock.

    It may be async: here it looks up whether the user has an order already (a definite
    409) or not yet (423: come back when the other request is done).
    """
    shop: Shop = ctx.arguments["shop"]
    user_id, voucher = ctx.arguments["user_id"], ctx.arguments["voucher"]
    existing = await shop.redis.hget(shop.orders_key(voucher), user_id)
    if existing is not None:
        return JSONResponse({"error": "duplicate", "order": json.loads(existing)}, 409)
    return busy(ctx.key, f"another request for user {user_id} is being processed (waited {ctx.waited:.2f}s)")


# The key renders from the call's arguments (order:alice, order:bob, ...). The wait comes from
# the "orders.place" policy set in the lifespan; options written here override a policy's.
@distributed_lock(key="order:<user_id>", policy="orders.place", on_failure=order_busy)
async def place_order(shop: Shop, user_id: str, voucher: str) -> JSONResponse:
    lease = current_lease()  # this call's hold on order:<user_id>
    assert lease is not None
    # Check, then (further down) write: safe because no other request for this user runs now.
    existing = await shop.redis.hget(shop.orders_key(voucher), user_id)
    if existing is not None:
        return JSONResponse({"error": "duplicate", "order": json.loads(existing)}, 409)
    # The stock is shared by all users: a second, narrower lock for its read-modify-write.
    # If it stays busy for stock_wait, LockNotAcquired goes to the app's exception handler (423).
    async with shop.locks.lock(f"stock:{voucher}", wait=shop.stock_wait):
        stock = await shop.redis.get(shop.stock_key(voucher))
        if stock is None:
            return JSONResponse({"error": "unknown voucher", "voucher": voucher}, 404)
        left = int(stock)
        if left <= 0:
            return JSONResponse({"error": "sold out", "voucher": voucher}, 410)
        # The fencing token of the user's lock goes into the order: it tells which lock
        # holding wrote it, and is strictly larger for every later holding of order:<user_id>.
        order = {"user_id": user_id, "voucher": voucher, "fencing_token": lease.fencing_token}
        async with shop.redis.pipeline(transaction=True) as pipe:  # both writes or neither
            pipe.set(shop.stock_key(voucher), left - 1)
            pipe.hset(shop.orders_key(voucher), user_id, json.dumps(order))
            await pipe.execute()
    return JSONResponse({**order, "stock_left": left - 1}, 201)


async def post_order(request: Request) -> JSONResponse:
    try:
        body = await request.json()
        voucher = body["voucher"]
    except (ValueError, KeyError, TypeError):
        return JSONResponse({"error": 'expected a JSON body {"voucher": "..."}'}, 400)
    if not isinstance(voucher, str) or not voucher:
        return JSONResponse({"error": "voucher must be a non-empty string"}, 400)
    return await place_order(request.app.state.shop, request.path_params["user_id"], voucher)


async def put_voucher(request: Request) -> JSONResponse:
    """Start (or restart) a sale: set the stock and forget earlier orders."""
    shop: Shop = request.app.state.shop
    voucher = request.path_params["voucher"]
    try:
        stock = (await request.json())["stock"]
    except (ValueError, KeyError, TypeError):
        return JSONResponse({"error": 'expected a JSON body {"stock": n}'}, 400)
    if isinstance(stock, bool) or not isinstance(stock, int) or stock < 0:
        return JSONResponse({"error": "stock must be an integer >= 0"}, 400)
    async with (
        shop.locks.lock(f"stock:{voucher}", wait=shop.stock_wait),
        shop.redis.pipeline(transaction=True) as pipe,
    ):
        pipe.set(shop.stock_key(voucher), stock)
        pipe.delete(shop.orders_key(voucher))
        await pipe.execute()
    return JSONResponse({"voucher": voucher, "stock": stock})


async def get_voucher(request: Request) -> JSONResponse:
    shop: Shop = request.app.state.shop
    voucher = request.path_params["voucher"]
    stock = await shop.redis.get(shop.stock_key(voucher))
    if stock is None:
        return JSONResponse({"error": "unknown voucher", "voucher": voucher}, 404)
    orders = await shop.redis.hgetall(shop.orders_key(voucher))
    return JSONResponse(
        {"voucher": voucher, "stock": int(stock), "orders": {user: json.loads(o) for user, o in orders.items()}}
    )


def create_app(
    *,
    url: str | None = None,
    namespace: str | None = None,
    order_wait: float | None = 1.0,
    stock_wait: float | None = 5.0,
) -> Starlette:
    """The order service.

    Args:
        url: The lock store (and data store); default ``$LOCKASPECT_URL`` at startup, or a
            throwaway server when that is unset too.
        namespace: Prefix of every key the app writes; default a fresh one per startup.
        order_wait: Seconds a request waits for another request of the same user (0: answer
            423 at once; ``None``: wait as long as it takes).
        stock_wait: Seconds a request waits for the voucher's stock lock.

    The lifespan calls ``configure()``, which is process-wide: run one app per process.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            store = url or os.environ.get("LOCKASPECT_URL")
            if not store:
                from lockaspect.testing import LockServer  # pip install 'lockaspect[demo]'

                store = stack.enter_context(LockServer()).url
                print(f"started a throwaway server on {store}")
            prefix = namespace or f"orders-{uuid.uuid4().hex[:8]}:"
            # The LockClient: built, checked (a wrong URL fails here), made the decorators'
            # default along with the policy place_order takes its wait from, and closed with
            # the stack. It is also app.state.lockaspect.
            locks_lifespan = lockaspect_lifespan(
                url=store, namespace=prefix, policies={"orders.place": {"wait": order_wait}}
            )
            await stack.enter_async_context(locks_lifespan(app))
            data = aredis.Redis.from_url(store, decode_responses=True)
            stack.push_async_callback(data.aclose)
            app.state.shop = Shop(store, app.state.lockaspect, data, prefix, stock_wait)
            yield

    return Starlette(
        routes=[
            Route("/orders/{user_id}", post_order, methods=["POST"]),
            Route("/vouchers/{voucher}", put_voucher, methods=["PUT"]),
            Route("/vouchers/{voucher}", get_voucher, methods=["GET"]),
        ],
        # LockNotAcquired (the stock lock stayed busy): 423 with Retry-After. LockLost (the
        # user's lock was lost before place_order finished; whether the order was written is
        # not known there, and a retry answers 409 if it was): 503.
        exception_handlers=make_exception_handlers(busy_status=423),
        lifespan=lifespan,
    )


app = create_app()


async def flash_sale(app: Starlette, voucher: str, requests: list[str]) -> list[httpx.Response]:
    """POST an order for each user in ``requests``, all at once, on the running loop.

    httpx's ASGITransport calls the app in the calling task, so the gathered requests really
    interleave on one event loop (each round trip to the store is a switch point). It does not
    run the lifespan: call this on the loop of a running TestClient (``portal.call``).
    """
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop") as http:
        return list(
            await asyncio.gather(*(http.post(f"/orders/{user}", json={"voucher": voucher}) for user in requests))
        )


def check_sale(responses: list[httpx.Response], requests: list[str], stock: int, after: dict[str, Any]) -> Counter[int]:
    """Assert what a sale must give whatever the interleaving; return the status counts."""
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {201, 409, 410, 423}, statuses
    placed = [r.json() for r in responses if r.status_code == 201]
    buyers = [order["user_id"] for order in placed]
    assert len(buyers) == len(set(buyers)), f"a user ordered twice: {sorted(buyers)}"
    # Every 201 saw a different stock level: the read-modify-writes ran one at a time.
    assert sorted(order["stock_left"] for order in placed) == list(range(stock - len(placed), stock))
    assert after["stock"] == stock - len(placed) >= 0, (after["stock"], len(placed))
    assert set(after["orders"]) == set(buyers), (sorted(after["orders"]), sorted(buyers))
    for order in placed:
        assert after["orders"][order["user_id"]]["fencing_token"] == order["fencing_token"]
    # Each user's first request to get the user's lock finds no order and goes on to the
    # stock: with at least as many users as stock, the whole stock sells, unless a wait for
    # the stock lock ran out (a 423 on stock:<voucher>).
    stock_busy = [r for r in responses if r.status_code == 423 and r.json()["key"].startswith("stock:")]
    if not stock_busy and len(set(requests)) >= stock:
        assert len(placed) == stock, f"{len(placed)} orders for a stock of {stock}"
    return statuses


@contextlib.contextmanager
def deleting_keys_afterwards(app: Starlette) -> Iterator[None]:
    """When the block ends, delete every key under the app's namespace (data, lock fences)."""
    try:
        yield
    finally:
        shop: Shop = app.state.shop
        with redis.Redis.from_url(shop.url) as store:
            keys = list(store.scan_iter(match=f"{shop.namespace}*", count=1000))
            print(f"deleted {store.delete(*keys) if keys else 0} keys")


def main() -> None:
    shop_app = create_app()
    # The TestClient runs the lifespan (connects, or starts a server); the keys go before it ends.
    with TestClient(shop_app) as http, deleting_keys_afterwards(shop_app):
        print("1. alice orders: 201, with the fencing token of her lock order:alice")
        assert http.put("/vouchers/FLASH50", json={"stock": 2}).status_code == 200
        first = http.post("/orders/alice", json={"voucher": "FLASH50"})
        assert first.status_code == 201, first.text
        print(f"  {first.status_code} {first.json()}")
        assert first.json()["stock_left"] == 1

        print("2. alice again: 409, one order per user")
        again = http.post("/orders/alice", json={"voucher": "FLASH50"})
        print(f"  {again.status_code} {again.json()}")
        assert again.status_code == 409, again.text
        assert again.json()["order"]["fencing_token"] == first.json()["fencing_token"]

        print("3. bob takes the last voucher (201), carol finds it sold out (410)")
        bob = http.post("/orders/bob", json={"voucher": "FLASH50"})
        carol = http.post("/orders/carol", json={"voucher": "FLASH50"})
        print(f"  bob {bob.status_code}, carol {carol.status_code} {carol.json()}")
        assert (bob.status_code, carol.status_code) == (201, 410), (bob.text, carol.text)

        print("4. dave's lock is held elsewhere (another replica): 423 once order_wait runs out")
        shop: Shop = shop_app.state.shop
        # A second client is a second owner. (The TestClient carries this thread's context
        # into the request, so a lock held through the app's own client here would be
        # re-entered by the request rather than found busy.)
        with LockClient.from_url(shop.url, namespace=shop.namespace) as replica, replica.lock("order:dave"):
            dave = http.post("/orders/dave", json={"voucher": "FLASH50"})
        print(f"  {dave.status_code} {dave.json()}, Retry-After {dave.headers.get('retry-after')}")
        assert dave.status_code == 423, dave.text
        assert dave.json()["key"] == "order:dave"

        stock, users, total = 10, 20, 50
        print(f"5. a flash sale: {total} concurrent requests from {users} users for {stock} vouchers")
        assert http.put("/vouchers/MEGA", json={"stock": stock}).status_code == 200
        # Every user 2 or 3 times, in a row (double clicks): the duplicates race each other.
        requests = sorted(f"user-{i % users:02d}" for i in range(total))
        assert http.portal is not None  # set while the TestClient is entered
        responses = http.portal.call(flash_sale, shop_app, "MEGA", requests)
        after = http.get("/vouchers/MEGA").json()
        statuses = check_sale(responses, requests, stock, after)
        print(
            f"  {statuses[201]} placed, {statuses[409]} duplicates, {statuses[410]} sold out, "
            f"{statuses[423]} busy; stock left {after['stock']}; buyers: {', '.join(sorted(after['orders']))}"
        )
    print("ok")


if __name__ == "__main__":
    main()
