"""Reading and checking ``settings.LOCKASPECT``: every problem found, each naming its key."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from ..._defaults import check_defaults
from ...config import ENV_URL, _parse_policies
from ...errors import ConfigurationError, KeyTemplateError

__all__ = ["KEYS", "LockaspectSettings", "read_settings", "setting_problems"]

#: The keys ``settings.LOCKASPECT`` may have.
KEYS = ("URL", "POLICIES", "DEFAULTS", "OBSERVERS", "OPTIONS", "CHECK")

Observer = Callable[[Any], object]


@dataclass(frozen=True)
class LockaspectSettings:
    """``settings.LOCKASPECT``, checked (see ``docs/integrations/django.md``)."""

    #: The lock store's URL: ``URL``, else the ``LOCKASPECT_URL`` environment variable, else None.
    url: str | None = None
    #: Named policies (checked), or None to leave the configured ones alone.
    policies: dict[str, dict[str, Any]] | None = None
    #: Client-wide defaults of the decorator options, or None.
    defaults: dict[str, Any] | None = None
    #: The observers of the client built from ``url``, dotted paths imported (classes called).
    observers: tuple[Observer, ...] = ()
    #: Keyword arguments of ``LockClient.from_url`` (``namespace``, ``watchdog_lease``, ...).
    options: dict[str, Any] = field(default_factory=dict)
    #: Check the store (``client.check()``) in ``AppConfig.ready()``.
    check: bool = True


def _name(key: str) -> str:
    return f'settings.LOCKASPECT["{key}"]'


def read_settings(value: object) -> LockaspectSettings:
    """``settings.LOCKASPECT`` (``value``; ``None`` when it is not set), checked.

    Dotted paths in ``OBSERVERS`` are imported; a class is called without arguments to make
    the observer. Nothing is connected to.

    Raises:
        ImproperlyConfigured: listing every problem found, each naming its key (for
            example ``settings.LOCKASPECT["POLICIES"]: policy 'orders' ...``).
    """
    settings, problems = _read(value, instantiate=True)
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise ImproperlyConfigured(f"settings.LOCKASPECT is invalid:\n{listed}")
    assert settings is not None
    return settings


def setting_problems(value: object) -> list[str]:
    """What :func:`read_settings` would refuse in ``value``, without making any observer (a
    class named in ``OBSERVERS`` is imported, not called)."""
    return _read(value, instantiate=False)[1]


def _read(value: object, *, instantiate: bool) -> tuple[LockaspectSettings | None, list[str]]:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        return None, [f"settings.LOCKASPECT must be a dict, got {type(value).__name__}"]
    problems: list[str] = []
    for key in value:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"settings.LOCKASPECT has an unknown key {key!r}{hint}; allowed: {', '.join(KEYS)}")
    url = _url(value.get("URL"), problems)
    policies = _policies(value.get("POLICIES"), problems)
    defaults = _defaults(value.get("DEFAULTS"), problems)
    observers = _observers(value.get("OBSERVERS"), problems, instantiate=instantiate)
    options = _client_options(value.get("OPTIONS"), problems)
    check = value.get("CHECK", True)
    if not isinstance(check, bool):
        problems.append(f"{_name('CHECK')} must be True or False, got {check!r}")
    if url is None and value.get("URL") is None:
        given = [key for key in ("OBSERVERS", "OPTIONS", "CHECK") if value.get(key)]
        if given:
            problems.append(
                f"{', '.join(_name(key) for key in given)} configure the client built from the store URL, "
                f"but there is none: set {_name('URL')} or the {ENV_URL} environment variable"
            )
    if problems:
        return None, problems
    settings = LockaspectSettings(
        url=url, policies=policies, defaults=defaults, observers=observers, options=options, check=bool(check)
    )
    return settings, []


def _url(value: object, problems: list[str]) -> str | None:
    if value is None:
        return os.environ.get(ENV_URL) or None
    if not isinstance(value, str) or not value:
        problems.append(f"{_name('URL')} must be a non-empty str such as 'redis://127.0.0.1:6379/0', got {value!r}")
        return None
    return value


def _policies(value: object, problems: list[str]) -> dict[str, dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, (Mapping, str, os.PathLike)):
        problems.append(f"{_name('POLICIES')} must be a dict or the path of a TOML file, got {type(value).__name__}")
        return None
    try:
        return _parse_policies(value, source=_name("POLICIES"))
    except (ConfigurationError, TypeError) as exc:
        message = str(exc)
        problems.append(message if _name("POLICIES") in message else f"{_name('POLICIES')}: {message}")
        return None


def _defaults(value: object, problems: list[str]) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        return dict(check_defaults(value, _name("DEFAULTS")))
    except (ConfigurationError, KeyTemplateError, TypeError) as exc:
        problems.append(str(exc))
        return None


def _observers(value: object, problems: list[str], *, instantiate: bool) -> tuple[Observer, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        problems.append(f"{_name('OBSERVERS')} must be a list of observers or dotted paths, got {value!r}")
        return ()
    made: list[Observer] = []
    for index, item in enumerate(value):
        where = f"{_name('OBSERVERS')}[{index}]"
        if isinstance(item, str):
            try:
                item = import_string(item)
            except ImportError as exc:
                problems.append(f"{where}: cannot import {item!r}: {exc}")
                continue
            if isinstance(item, type):
                if not instantiate:
                    continue
                try:
                    item = item()
                except Exception as exc:  # noqa: BLE001 - reported as a problem of the setting, with its type
                    problems.append(f"{where}: {item.__qualname__}() raised {type(exc).__name__}: {exc}")
                    continue
        if not callable(item):
            problems.append(f"{where} must be callable (an observer takes a LockEvent), got {item!r}")
            continue
        made.append(item)
    return tuple(made)


def _client_options(value: object, problems: list[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        problems.append(f"{_name('OPTIONS')} must be a dict of LockClient.from_url() keyword arguments, got {value!r}")
        return {}
    if "observers" in value:
        problems.append(f"{_name('OPTIONS')} cannot set observers: use {_name('OBSERVERS')}")
    return dict(value)
