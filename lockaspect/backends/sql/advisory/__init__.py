"""PLACEHOLDER"""
from __future__ import annotations

from typing import Any

from ._options import parse_settings
from .store import PostgresAdvisoryStore

__all__ = ["PostgresAdvisoryStore", "open_postgres_store"]


def open_postgres_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> PostgresAdvisoryStore:
    """The store factory of ``postgresql://`` and ``postgres://`` URLs."""
    return PostgresAdvisoryStore(parse_settings(url, namespace, options))
