"""Django system checks for ``settings.LOCKASPECT`` (``manage.py check``)."""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
from django.core import checks

from ... import config
from ...client import LockClient
from ...config import ENV_URL
from ...errors import BackendError, ConfigurationError
from ._settings import setting_problems

__all__ = ["check_settings", "check_store", "register"]

TAG = "lockaspect"


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``lockaspect.E001`` for each problem of ``settings.LOCKASPECT`` as it is now;
    ``lockaspect.W001`` when no store URL is set anywhere (decorated functions that name no
    client would raise ``ConfigurationError`` at their first call)."""
    value = getattr(django_settings, "LOCKASPECT", None)
    problems = setting_problems(value)
    messages: list[checks.CheckMessage] = [
        checks.Error(problem, hint="See docs/integrations/django.md.", id="lockaspect.E001") for problem in problems
    ]
    if not problems and _no_default_client():
        messages.append(
            checks.Warning(
                f'no lock store is configured: neither settings.LOCKASPECT["URL"] nor the {ENV_URL} '
                "environment variable is set",
                hint="@distributed_lock without client= raises ConfigurationError until one is.",
                id="lockaspect.W001",
            )
        )
    return messages


def _no_default_client() -> bool:
    try:
        config.default_client()
    except ConfigurationError:
        return True
    return False


def check_store(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``lockaspect.E002`` if the default client's store fails ``client.check()``
    (registered as a deployment check: ``manage.py check --deploy``)."""
    try:
        client: LockClient = config.default_client()
    except ConfigurationError:
        return []  # W001 says so
    try:
        client.check()
    except (ConfigurationError, BackendError) as exc:
        return [
            checks.Error(
                f"the lock store failed its check: {type(exc).__name__}: {exc}",
                hint='Fix settings.LOCKASPECT["URL"] / ["OPTIONS"] or the store (the error says what).',
                obj=client,
                id="lockaspect.E002",
            )
        ]
    return []


def register() -> None:
    """Register the checks (once; :meth:`LockaspectConfig.ready` calls it)."""
    checks.register(check_settings, TAG)
    checks.register(check_store, TAG, deploy=True)
