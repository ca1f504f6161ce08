"""Process-wide defaults: the default :class:`LockClient` and named lock policies."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from . import _defaults
from . import options as _options
from .client import LockClient
from .errors import ConfigurationError, KeyTemplateError
from .observe import Observer, Observers

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["POLICY_FIELDS", "configure", "default_client", "get_policy", "load_policies"]

ENV_URL = "LOCKASPECT_URL"

#: Options a named policy may set (the decorator's, minus ``client``, ``policy``, ``keys``
#: and ``permits``): see :mod:`lockaspect.options`.
POLICY_FIELDS = _options.POLICY_FIELDS

_lock = threading.Lock()
_client: LockClient | None = None
_owned = False  # built by us (from a URL), so ours to close when replaced
_policies: dict[str, dict[str, Any]] = {}
_generation = 0
_observers: list[Observer] | None = None  # configure(observers=...) alone: for the client built from the environment


def configure(
    client: LockClient | None = None,
    *,
    url: str | None = None,
    policies: Mapping[str, Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    observers: Iterable[Observer] | None = None,
    check: bool = False,
) -> LockClient | None:
    """Set the process-wide default client and/or the named lock policies.

    Args:
        client: The client decorated functions use when they name none.
        url: Build the default client with ``LockClient.from_url(url)`` instead.
        policies: Named policies, as a mapping ``{"orders.create": {"key": ..., "lease":
            30}}`` or the path of a TOML file with ``[locks."orders.create"]`` tables.
            Replaces the policies configured before. Each policy may set ``key``,
            ``lease``, ``delay_weight``, ``wait``, ``max_hold``, ``on_failure``, ``on_lost``,
            ``executor``, ``wait_strategy``, ``fair`` and ``mode`` (:data:`POLICY_FIELDS`);
            values are checked here. TOML has no null, so write
            ``lease = "watchdog"``, ``wait = "forever"`` and ``max_hold = "none"`` for ``None``.
        defaults: Process-wide defaults of the decorator's options (``lease``,
            ``delay_weight``, ``wait``, ``max_hold``, ``on_failure``, ``on_lost``,
            ``executor``, ``wait_strategy``), e.g. ``{"wait": 2.0}``, for every decorated
            function whatever its client. Precedence: the decorator's options > its policy >
            its client's ``defaults=`` > these > the library's defaults. Replaces the
            defaults configured before; ``{}`` clears them.
        observers: Observers of the client this call builds from ``url`` (or, given alone,
            of the default client built later from ``LOCKASPECT_URL``: once that client
            exists, ``observers`` alone raise :class:`ConfigurationError`); a client you
            pass in has its own.
        check: Run :meth:`LockClient.check` on the client built from ``url`` before it
            becomes the default: a misconfigured store fails here, at start-up.

    Returns:
        The default client now configured (``None`` if there is none yet).

    Without any configuration, the default client is built on first use from the
    ``LOCKASPECT_URL`` environment variable. A client built from ``url`` (or the
    environment) is closed when it is replaced; a client you pass in stays yours.

    Configure policies before importing the modules whose decorators use them to get
    their errors at import time; otherwise they are checked at the first call.
    """
    global _client, _owned, _policies, _generation, _observers
    if client is not None and url is not None:
        raise ConfigurationError("pass either client or url to configure(), not both")
    if client is not None and not isinstance(client, LockClient):
        raise TypeError(f"client must be a LockClient, got {type(client).__name__}")
    if client is not None and observers is not None:
        raise ConfigurationError(
            "configure(client, observers=...): a client you build has its own observers: "
            "LockClient(..., observers=[...]) or LockClient.from_url(url, observers=[...])"
        )
    if check and url is None:
        raise ConfigurationError(
            "configure(check=True) checks the client it builds from url=: give url= (or call client.check())"
        )
    watchers = None if observers is None else Observers.check(observers)
    if watchers is not None and url is None and _client is not None:
        raise ConfigurationError(
            "configure(observers=...): the default client exists already and keeps its observers; "
            "give url= with them to build a new default client that has them"
        )
    parsed = None if policies is None else _parse_policies(policies)
    process_defaults = None if defaults is None else _defaults.check_defaults(defaults, "configure()")
    new_client = None
    if url is not None:
        new_client = LockClient.from_url(url, observers=watchers if watchers is not None else _observers, check=check)
    elif client is not None:
        new_client = client
    with _lock:
        old, old_owned = _client, _owned
        if new_client is not None:
            _client, _owned = new_client, url is not None
        if parsed is not None:
            _policies = parsed
        if process_defaults is not None:
            _defaults.set_process_defaults(process_defaults)
        if watchers is not None and url is None:
            _observers = watchers
        _generation += 1
        current = _client
    if new_client is not None and old is not None and old_owned and old is not new_client:
        old.close()
    return current


def default_client() -> LockClient:
    """The configured default client, built from ``LOCKASPECT_URL`` on first use."""
    global _client, _owned
    client = _client
    if client is not None:
        return client
    with _lock:
        if _client is None:
            url = os.environ.get(ENV_URL)
            if not url:
                raise ConfigurationError(
                    "no lock client is configured: call lockaspect.configure(url=...) or "
                    "configure(client), pass client= to the decorator, or set the "
                    f"{ENV_URL} environment variable"
                )
            _client, _owned = LockClient.from_url(url, observers=_observers), True
        return _client


def generation() -> int:
    """Bumped by every :func:`configure` call, so cached resolutions can notice."""
    return _generation


def get_policy(name: str) -> dict[str, Any] | None:
    """The named policy's options, or ``None`` if there is no such policy."""
    with _lock:
        policy = _policies.get(name)
        return None if policy is None else dict(policy)


def has_policies() -> bool:
    return bool(_policies)


def policy_names() -> list[str]:
    with _lock:
        return sorted(_policies)


def load_policies(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Read ``[locks."<name>"]`` tables from a TOML file and check them."""
    file = Path(path)
    try:
        with file.open("rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigurationError(f"cannot read lock policies from {file}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"lock policy file {file} is not valid TOML: {exc}") from exc
    locks = data.get("locks")
    if not isinstance(locks, dict):
        raise ConfigurationError(f'lock policy file {file} has no [locks."<name>"] tables')
    return _parse_policies(locks, source=str(file), toml=True)


def _parse_policies(
    policies: Mapping[str, Mapping[str, Any]] | str | os.PathLike[str],
    source: str = "configure()",
    *,
    toml: bool = False,
) -> dict[str, dict[str, Any]]:
    if isinstance(policies, (str, os.PathLike)):
        return load_policies(policies)
    if not isinstance(policies, Mapping):
        raise TypeError(f"policies must be a mapping or a TOML file path, got {type(policies).__name__}")
    parsed: dict[str, dict[str, Any]] = {}
    for name, options in policies.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"policy names must be non-empty strings, got {name!r}")
        if not isinstance(options, Mapping):
            raise ConfigurationError(f"policy {name!r} in {source} must be a table of options")
        unknown = sorted(set(options) - POLICY_FIELDS)
        if unknown:
            raise ConfigurationError(
                f"policy {name!r} in {source} has unknown option(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(POLICY_FIELDS))}"
            )
        parsed[name] = _check_options(name, dict(options), source, toml=toml)
    return parsed


def _check_options(name: str, options: dict[str, Any], source: str, *, toml: bool = False) -> dict[str, Any]:
    """Check one policy's options (see :func:`lockaspect.options.check_policy`); the TOML
    spellings of ``None`` become ``None``. Every error is a ``ConfigurationError`` naming the
    policy and its source."""
    try:
        return _options.check_policy(options, toml=toml)
    except (ConfigurationError, KeyTemplateError, TypeError) as exc:
        raise ConfigurationError(f"policy {name!r} in {source}: {exc}") from exc
