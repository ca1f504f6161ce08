"""Integration fixtures. ``postgres_server`` comes from lockaspect's pytest plugin once
``lockaspect.testing.postgres`` exists; until then, a minimal stand-in (tests/_pg_standin_xact.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("lockaspect.testing.postgres") is None:

    @pytest.fixture(scope="session")
    def postgres_server() -> Iterator[Any]:
        from tests._pg_standin_xact import PostgresServer

        server = PostgresServer().start()
        yield server
        server.stop()
