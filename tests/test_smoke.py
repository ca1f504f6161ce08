from lockaspect import LockClient, current_lease, distributed_lock


def test_decorated_call_holds_the_lock_and_releases_it(client: LockClient, raw) -> None:
    @distributed_lock(key="order:<order_id>", client=client, delay_weight=0.5)
    def place(order_id: int) -> tuple[str, int]:
        lease = current_lease()
        assert lease is not None
        assert raw.exists(client.backend.lock_key("order:7")) == 1
        return lease.key, lease.fencing_token

    key, first = place(7)
    assert key == "order:7"
    assert place(7) == ("order:7", first + 1)
    assert raw.exists(client.backend.lock_key("order:7")) == 0
