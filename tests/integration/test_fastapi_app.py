"""examples/fastapi_orders.py served by a real uvicorn on loopback, driven by httpx.

One server for the module (the app's lifespan checks the session's Valkey at start-up); the
requests go over TCP, so they interleave as they would in production: 200 at once, 4 per user.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from lockaspect import LockClient, config
from lockaspect.testing import LockServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi_orders.py"


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("lockaspect_example_fastapi_orders", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic looks the module up to resolve OrderIn's annotations
    spec.loader.exec_module(module)
    return module


orders_example = _load_example()


class Served:
    def __init__(self, app: Any, base_url: str, url: str) -> None:
        self.app = app
        self.base_url = base_url
        self.url = url
        self.namespace: str = app.state.namespace

    def post(self, user: str, item: str = "book") -> httpx.Response:
        return httpx.post(f"{self.base_url}/orders/{user}", json={"item": item}, trust_env=False)

    def placed_log(self) -> list[str]:
        return list(asyncio.run(orders_example.placed_log(self.url, self.app)))


@pytest.fixture(scope="module")
def served(lock_server: LockServer) -> Iterator[Served]:
    """The example app under uvicorn; the process-wide default client its lifespan configured
    is put back as it was afterwards, and the keys it wrote are deleted."""
    saved = (config._client, config._owned, dict(config._policies))
    app = orders_example.create_app(url=lock_server.url, namespace=f"t-fastapi-{uuid.uuid4().hex[:8]}:")
    try:
        with orders_example.serve(app) as base_url:
            yield Served(app, base_url, lock_server.url)
        assert app.state.lockaspect.closed  # the lifespan closed its client at shutdown
    finally:
        config._client, config._owned, config._policies = saved[0], saved[1], saved[2]
        config._generation += 1
        asyncio.run(orders_example.delete_keys(lock_server.url, app.state.namespace))


def test_200_concurrent_requests_place_one_order_per_user_and_answer_409_when_busy(served: Served) -> None:
    users = [f"flood-{i % 50:02d}" for i in range(200)]  # 4 per user, interleaved
    responses = asyncio.run(orders_example.flood(served.base_url, users))
    assert len(responses) == 200
    placed = [user for user in served.placed_log() if user.startswith("flood-")]
    # The example's own checks: statuses only 201/200/409, one order per user in the store,
    # every 200 returns that order, every 409 says busy with a Retry-After of 1 or 2 s.
    statuses = orders_example.check_orders(responses, users, placed)
    # Spelled out here as well:
    assert statuses[500] == 0
    assert statuses[201] == 50
    assert statuses[200] + statuses[409] == 150
    assert len(placed) == len(set(placed)) == 50
    for response in responses:
        if response.status_code == 409:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["key"] == "order:" + response.request.url.path.rsplit("/", 1)[1]
    # What each user has now is the order its 201 returned.
    created = {r.json()["user_id"]: r.json() for r in responses if r.status_code == 201}
    for user in ("flood-00", "flood-49"):
        assert httpx.get(f"{served.base_url}/orders/{user}", trust_env=False).json() == created[user]


def test_a_user_whose_lock_another_replica_holds_gets_409_with_retry_after(served: Served) -> None:
    """Deterministic contention: another client (a replica) holds the user's lock."""
    with (
        LockClient.from_url(served.url, namespace=served.namespace) as replica,
        replica.lock("order:held-user", lease=60.0),
    ):
        busy = [served.post("held-user") for _ in range(3)]
        assert not served.placed_log().count("held-user")
    for response in busy:
        assert response.status_code == 409, response.text
        # The holder has ~60 s left; the example caps the hint at 2 s.
        assert response.headers["retry-after"] == "2"
        assert response.json() == {"error": "busy", "key": "order:held-user", "retry_after": 2}
    # Released: the next request places the order, the one after gets it back.
    first, again = served.post("held-user"), served.post("held-user")
    assert (first.status_code, again.status_code) == (201, 200), (first.text, again.text)
    assert again.json() == first.json()
    assert served.placed_log().count("held-user") == 1


def test_the_order_carries_the_fencing_token_of_the_users_lock(served: Served, lock_server: LockServer) -> None:
    response = served.post("fenced-user")
    assert response.status_code == 201, response.text
    raw = lock_server.redis()
    try:
        fence = raw.get(f"{served.namespace}{{order:fenced-user}}:fence")
        held = raw.exists(f"{served.namespace}{{order:fenced-user}}")
    finally:
        raw.close()
    assert int(fence) == response.json()["fencing_token"]
    assert held == 0  # released when the endpoint returned


def test_unknown_order_is_404_and_a_bad_body_is_422(served: Served) -> None:
    assert httpx.get(f"{served.base_url}/orders/nobody", trust_env=False).status_code == 404
    bad = httpx.post(f"{served.base_url}/orders/someone", json={"sku": 1}, trust_env=False)
    assert bad.status_code == 422  # FastAPI's validation, before the lock is taken
    assert "someone" not in served.placed_log()


def test_the_app_does_not_start_on_a_store_it_cannot_reach() -> None:
    """lockaspect_lifespan checks the store at start-up: uvicorn's start fails, no request is
    ever served."""
    with LockServer() as gone:
        url = gone.url
    app = orders_example.create_app(url=url)
    with pytest.raises(RuntimeError, match="did not start"), orders_example.serve(app):
        pass
