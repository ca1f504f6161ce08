"""Settings of the example project (how to run it: ``manage.py``'s docstring).

The lockaspect part is ``INSTALLED_APPS`` and ``LOCKASPECT``; the rest is the least Django
needs. Environment: ``LOCKASPECT_URL`` (the lock store; a throwaway Valkey when unset) and
``LOCKASPECT_PG_URL`` (a PostgreSQL database; a SQLite file when unset).
"""

from __future__ import annotations

import atexit
import os
import tempfile
import uuid
from typing import Any
from urllib.parse import urlsplit


def _lock_store() -> str:
    url = os.environ.get("LOCKASPECT_URL")
    if url:
        return url
    from lockaspect.testing import LockServer

    server = LockServer().start()
    atexit.register(server.stop)
    return server.url


def _database() -> dict[str, Any]:
    url = os.environ.get("LOCKASPECT_PG_URL")
    if not url:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.path.join(tempfile.gettempdir(), "lockaspect-django-example.sqlite3"),
            "OPTIONS": {"timeout": 20},
        }
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/") or "postgres",
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


def _delete_keys(url: str, namespace: str) -> None:
    """Leave nothing behind in the user's server: the locks are released, but stores keep
    a fence counter per key."""
    import redis

    with redis.Redis.from_url(url) as server:
        for key in server.scan_iter(match=f"{namespace}*"):
            server.delete(key)


SECRET_KEY = "lockaspect-example-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
USE_TZ = True
ROOT_URLCONF = "shop.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
MIDDLEWARE: list[str] = []
DATABASES = {"default": _database()}

INSTALLED_APPS = ["lockaspect.contrib.django", "ledger"]

NAMESPACE = f"django-example-{uuid.uuid4().hex[:8]}:"
LOCKASPECT = {
    "URL": _lock_store(),
    # Each endpoint's lock, by name: @distributed_lock(policy="ledger.deposit").
    "POLICIES": {"ledger.deposit": {"key": "account:<account>"}},
    # For every decorated function that does not say otherwise: wait up to 1 s for the lock.
    "DEFAULTS": {"wait": 1.0},
    "OBSERVERS": ["ledger.observers.LockEventCounter"],
    "OPTIONS": {"namespace": NAMESPACE},
    # Connect, authenticate and load the scripts at start-up: a wrong URL stops the process here.
    "CHECK": True,
}
if LOCKASPECT["URL"].startswith("redis://"):
    atexit.register(_delete_keys, LOCKASPECT["URL"], NAMESPACE)
