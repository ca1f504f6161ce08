"""examples/starlette_app.py, driven through Starlette's TestClient against the session server.

Sequential requests go through the TestClient; concurrent ones through httpx2's
ASGITransport, gathered on the app's own event loop (the TestClient's portal), where the
lifespan made the app's connections.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from lockaspect import LockClient
from lockaspect.testing import LockServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "starlette_app.py"


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("lockaspect_example_starlette_app", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


shop_example = _load_example()


@pytest.fixture
def make_app(lock_server: LockServer, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Starlette]:
    """The example app on the session server (through LOCKASPECT_URL) in the test's namespace."""
    monkeypatch.setenv("LOCKASPECT_URL", lock_server.url)

    def make(**options: Any) -> Starlette:
        app: Starlette = shop_example.create_app(namespace=namespace, **options)
        return app

    return make


@pytest.fixture
def app(make_app: Callable[..., Starlette]) -> Starlette:
    return make_app()


@pytest.fixture
def http(app: Starlette) -> Iterator[TestClient]:
    """A TestClient with the app's lifespan running (entered: connected; exited: closed)."""
    with TestClient(app) as client:
        yield client


def on_app_loop(http: TestClient, function: Callable[..., Any], *args: Any) -> Any:
    """Run ``await function(*args)`` on the event loop the app's lifespan and requests run on."""
    assert http.portal is not None
    return http.portal.call(function, *args)


def order(http: TestClient, user: str, voucher: str = "FLASH50") -> httpx.Response:
    return http.post(f"/orders/{user}", json={"voucher": voucher})


def start_sale(http: TestClient, voucher: str, stock: int) -> None:
    response = http.put(f"/vouchers/{voucher}", json={"stock": stock})
    assert response.status_code == 200, response.text


def test_an_order_gets_201_with_the_fencing_token_of_the_users_lock(
    http: TestClient, app: Starlette, raw: Any, namespace: str
) -> None:
    start_sale(http, "FLASH50", 3)
    response = order(http, "alice")
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["user_id"] == "alice"
    assert body["voucher"] == "FLASH50"
    assert body["stock_left"] == 2
    token = body["fencing_token"]
    assert isinstance(token, int)
    assert token > 0
    # The token is the one the store issued for order:alice in the app's namespace, and the
    # lock is gone once the response is out.
    assert int(raw.get(f"{namespace}{{order:alice}}:fence")) == token
    assert raw.exists(f"{namespace}{{order:alice}}") == 0
    assert raw.exists(f"{namespace}{{stock:FLASH50}}") == 0
    # The order and the stock are in the store.
    assert raw.get(f"{namespace}data:stock:FLASH50") == b"2"
    sale = http.get("/vouchers/FLASH50").json()
    assert sale["stock"] == 2
    assert sale["orders"] == {"alice": {"user_id": "alice", "voucher": "FLASH50", "fencing_token": token}}
    # A later holding of the same user's lock gets a larger token (a new sale lets alice
    # order again).
    start_sale(http, "FLASH50", 3)
    assert order(http, "alice").json()["fencing_token"] > token


def test_a_second_order_for_the_same_user_is_409(http: TestClient) -> None:
    start_sale(http, "FLASH50", 5)
    first = order(http, "alice")
    assert first.status_code == 201, first.text
    again = order(http, "alice")
    assert again.status_code == 409, again.text
    assert again.json()["error"] == "duplicate"
    assert again.json()["order"]["fencing_token"] == first.json()["fencing_token"]
    assert http.get("/vouchers/FLASH50").json()["stock"] == 4


def test_sold_out_is_410(http: TestClient) -> None:
    start_sale(http, "FLASH50", 1)
    assert order(http, "alice").status_code == 201
    late = order(http, "bob")
    assert late.status_code == 410, late.text
    assert late.json()["error"] == "sold out"
    sale = http.get("/vouchers/FLASH50").json()
    assert sale["stock"] == 0
    assert set(sale["orders"]) == {"alice"}


def test_unknown_voucher_and_bad_bodies(http: TestClient) -> None:
    assert order(http, "alice", "NOPE").status_code == 404
    assert http.post("/orders/alice", content=b"not json").status_code == 400
    assert http.post("/orders/alice", json={"coupon": "FLASH50"}).status_code == 400
    assert http.post("/orders/alice", json={"voucher": ""}).status_code == 400
    assert http.put("/vouchers/FLASH50", json={"stock": -1}).status_code == 400
    assert http.get("/vouchers/NOPE").status_code == 404


@pytest.mark.parametrize("order_wait", [0, 1.0, None], ids=["order_wait=0", "order_wait=1s", "order_wait=forever"])
def test_concurrent_requests_sell_exactly_the_stock_to_distinct_users(
    make_app: Callable[..., Starlette], order_wait: float | None
) -> None:
    """50 requests from 20 users (each 2 or 3 times in a row), all at once, for a stock of 10.

    Each user's first request to get the user's lock finds no order and goes on to the stock,
    so 20 requests reach the stock, and exactly 10 of them buy. (stock_wait=None: no request
    gives up on the stock lock, whatever the machine's speed.)
    """
    app = make_app(order_wait=order_wait, stock_wait=None)
    stock, users, total = 10, 20, 50
    requests = sorted(f"user-{i % users:02d}" for i in range(total))
    with TestClient(app) as http:
        start_sale(http, "MEGA", stock)
        responses = on_app_loop(http, shop_example.flash_sale, app, "MEGA", requests)
        after = http.get("/vouchers/MEGA").json()
    assert len(responses) == total
    statuses = shop_example.check_sale(responses, requests, stock, after)  # the example's own checks
    # Spelled out here as well:
    placed = [r.json() for r in responses if r.status_code == 201]
    buyers = [p["user_id"] for p in placed]
    assert len(placed) == stock == statuses[201]
    assert len(set(buyers)) == stock
    assert after["stock"] == 0
    assert sorted(p["stock_left"] for p in placed) == list(range(stock))
    assert set(after["orders"]) == set(buyers)
    assert all(set(p) == {"user_id", "voucher", "fencing_token", "stock_left"} for p in placed)
    assert all(r.json()["key"].startswith("order:") for r in responses if r.status_code == 423)
    if order_wait is None:
        # Duplicates waited for the first request of their user: 409 (it ordered) or 410.
        assert statuses[423] == 0, statuses
        assert statuses[201] + statuses[409] + statuses[410] == total


def test_concurrent_duplicates_of_one_user_wait_and_get_409(make_app: Callable[..., Starlette]) -> None:
    """With order_wait, a double submission waits for the first request instead of failing."""
    app = make_app(order_wait=None)
    with TestClient(app) as http:
        start_sale(http, "FLASH50", 5)
        responses = on_app_loop(http, shop_example.flash_sale, app, "FLASH50", ["alice"] * 5)
        sale = http.get("/vouchers/FLASH50").json()
    assert sorted(r.status_code for r in responses) == [201, 409, 409, 409, 409]
    assert sale["stock"] == 4
    placed = next(r.json() for r in responses if r.status_code == 201)
    assert all(r.json()["order"] == sale["orders"]["alice"] for r in responses if r.status_code == 409)
    assert sale["orders"]["alice"]["fencing_token"] == placed["fencing_token"]


async def _race_two_requests_while_the_stock_is_locked(
    app: Starlette, user: str, steal: bool = False
) -> dict[str, Any]:
    """Hold stock:FLASH50, send two orders for ``user`` at once, and look at the first answer
    while the other request is still inside place_order (blocked on the stock lock).

    ``steal``: then delete the user's lock from the store (as an expiry or a failover would)
    before the blocked request goes on."""
    shop = app.state.shop
    held, release = asyncio.Event(), asyncio.Event()

    async def hold_stock() -> None:
        # A task of its own: tasks made inside the block would inherit (re-enter) its lease.
        async with shop.locks.lock("stock:FLASH50"):
            held.set()
            await release.wait()

    holder = asyncio.create_task(hold_stock())
    await held.wait()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop") as client:
            requests = {
                asyncio.create_task(client.post(f"/orders/{user}", json={"voucher": "FLASH50"})) for _ in range(2)
            }
            done, pending = await asyncio.wait(requests, return_when=asyncio.FIRST_COMPLETED)
            first = done.pop().result()
            still_running = len(pending)
            # The request still running holds the user's lock (the lock hash, with its fence).
            user_lock = await shop.redis.hgetall(f"{shop.namespace}{{order:{user}}}")
            if steal:
                await shop.redis.delete(f"{shop.namespace}{{order:{user}}}")
            release.set()
            await holder
            (other,) = await asyncio.gather(*pending)
    finally:
        release.set()
        await holder
    return {"first": first, "still_running": still_running, "user_lock": user_lock, "other": other}


def test_the_users_lock_is_held_while_the_handler_runs(make_app: Callable[..., Starlette]) -> None:
    """order_wait=0: a request for a user whose lock another request holds gets 423 at once."""
    app = make_app(order_wait=0, stock_wait=None)  # the other request waits for the stock until released
    with TestClient(app) as http:
        start_sale(http, "FLASH50", 5)
        seen = on_app_loop(http, _race_two_requests_while_the_stock_is_locked, app, "alice")
        sale = http.get("/vouchers/FLASH50").json()
    first, other = seen["first"], seen["other"]
    assert seen["still_running"] == 1
    assert first.status_code == 423, first.text
    assert first.json()["key"] == "order:alice"
    assert first.headers["retry-after"] == "1"
    assert other.status_code == 201, other.text
    # What was in the store while the handler ran: the lock whose token the 201 carries.
    assert seen["user_lock"]["fence"] == str(other.json()["fencing_token"])
    assert sale["stock"] == 4
    assert set(sale["orders"]) == {"alice"}


def test_a_lock_lost_while_the_handler_runs_is_503(make_app: Callable[..., Starlette]) -> None:
    """The user's lock disappears from the store while its request runs: the request does not
    answer 201 as if it had been safe. Its release finds the lock gone, place_order raises
    LockLost, and the app's exception handler answers 503."""
    app = make_app(order_wait=0, stock_wait=None)
    with TestClient(app) as http:
        start_sale(http, "FLASH50", 5)
        seen = on_app_loop(http, _race_two_requests_while_the_stock_is_locked, app, "alice", True)
        sale = http.get("/vouchers/FLASH50").json()
    assert seen["first"].status_code == 423
    other = seen["other"]
    assert other.status_code == 503, other.text
    assert other.headers["retry-after"] == "1"
    # lockaspect.contrib.starlette's LockLost handler answered.
    assert other.json() == {"error": "lock_lost", "key": "order:alice", "reason": "not-owner", "retry_after": 1}
    # The body did run to its end (LockLost says the work was done without the lock's
    # protection, not that it was undone): the order is in the store.
    assert sale["orders"]["alice"]["fencing_token"] == int(seen["user_lock"]["fence"])


def test_a_busy_stock_lock_is_423(make_app: Callable[..., Starlette], make_client: Callable[..., LockClient]) -> None:
    with TestClient(make_app(stock_wait=0)) as http:
        start_sale(http, "FLASH50", 5)
        with make_client().lock("stock:FLASH50"):  # another replica, in the app's namespace
            busy = order(http, "alice")
        after = order(http, "alice")
    assert busy.status_code == 423, busy.text
    # lockaspect.contrib.starlette's LockNotAcquired handler (busy_status=423): the holder's
    # remaining lease (a 30 s watchdog lease), rounded up to whole seconds.
    assert busy.json()["key"] == "stock:FLASH50"
    assert busy.json()["error"] == "busy"
    assert 1 <= int(busy.headers["retry-after"]) == busy.json()["retry_after"] <= 30
    assert after.status_code == 201, after.text
    assert after.json()["stock_left"] == 4


def test_busy_answer_depends_on_whether_the_user_has_ordered(
    make_app: Callable[..., Starlette], make_client: Callable[..., LockClient]
) -> None:
    """The async on_failure: while another owner (a replica) holds the user's lock, a user
    without an order gets 423, a user with one gets 409."""
    with TestClient(make_app(order_wait=0)) as http:
        start_sale(http, "FLASH50", 5)
        assert order(http, "bob").status_code == 201
        # A second LockClient in the app's namespace is another owner. (The app's own client
        # would not do: the TestClient carries this thread's context, and with it the locks
        # this thread holds, into the request, which would then re-enter them.)
        replica = make_client()
        with replica.lock("order:alice"), replica.lock("order:bob"):
            alice, bob = order(http, "alice"), order(http, "bob")
        stock = http.get("/vouchers/FLASH50").json()["stock"]
        again = order(http, "alice")  # free again
    assert alice.status_code == 423, alice.text
    assert alice.json()["key"] == "order:alice"
    assert bob.status_code == 409, bob.text
    assert bob.json()["error"] == "duplicate"
    assert stock == 4
    assert again.status_code == 201, again.text


def test_lifespan_closes_what_it_opened(app: Starlette) -> None:
    with TestClient(app) as http:
        start_sale(http, "FLASH50", 1)
        shop = app.state.shop
        assert not shop.locks.closed
        assert order(http, "alice").status_code == 201
    assert shop.locks.closed
    assert shop.locks.threads() == []


def test_without_lockaspect_url_the_lifespan_starts_a_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LOCKASPECT_URL", raising=False)
    app = shop_example.create_app()
    with TestClient(app) as http:
        assert "started a throwaway server" in capsys.readouterr().out
        url = app.state.shop.url
        assert url.startswith("redis://127.0.0.1:")
        start_sale(http, "FLASH50", 1)
        assert order(http, "alice").status_code == 201
        assert order(http, "bob").status_code == 410
    # Stopped with the app.
    import redis

    probe = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        with pytest.raises(redis.ConnectionError):
            probe.ping()
    finally:
        probe.close()
