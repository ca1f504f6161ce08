"""The Django app: ``"lockaspect.contrib.django"`` in ``INSTALLED_APPS``."""

from __future__ import annotations

import atexit
import threading
from typing import Any

from django.apps import AppConfig
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

from ... import config
from ...client import LockClient
from ...errors import BackendError, ConfigurationError, KeyTemplateError
from ._settings import LockaspectSettings, read_settings

__all__ = ["LockaspectConfig"]


class LockaspectConfig(AppConfig):  # type: ignore[misc]  # Django ships no type information
    """Configures lockaspect's process-wide default client from ``settings.LOCKASPECT``.

    In :meth:`ready` (once per process, as Django starts: ``manage.py`` commands, WSGI and
    ASGI servers, test runners) it reads the setting (:func:`read_settings`), builds the
    client with ``LockClient.from_url(URL, observers=OBSERVERS, **OPTIONS)``, makes it the
    default of every ``@distributed_lock`` that names no client (``lockaspect.configure(client,
    policies=POLICIES, defaults=DEFAULTS)``) and, unless ``CHECK`` is ``False``, checks the store
    (``client.check()``). Without ``URL`` the ``LOCKASPECT_URL`` environment variable is used;
    with neither, no client is built (policies and defaults are still configured).

    Every problem raises :class:`~django.core.exceptions.ImproperlyConfigured` naming the
    setting, so a misconfigured process stops at start-up. The client it built is its own:
    it is closed at process exit (``atexit``), or by :meth:`close_client`.

    The system checks it registers: ``lockaspect.E001`` (the setting is invalid),
    ``lockaspect.W001`` (no store URL anywhere) and, with ``manage.py check --deploy``,
    ``lockaspect.E002`` (the store fails ``client.check()``).
    """

    name = "lockaspect.contrib.django"
    label = "lockaspect"
    verbose_name = "lockaspect"
    default = True

    def __init__(self, app_name: str, app_module: Any) -> None:
        super().__init__(app_name, app_module)
        #: The client built from the settings (``None`` before :meth:`ready` or without a URL).
        self.client: LockClient | None = None
        #: The setting as read by :meth:`ready`.
        self.lockaspect_settings: LockaspectSettings | None = None
        self._closing = threading.Lock()

    def ready(self) -> None:
        from . import checks

        checks.register()
        read = read_settings(getattr(django_settings, "LOCKASPECT", None))
        self.lockaspect_settings = read
        self.client = configure_from(read)
        if self.client is not None:
            atexit.register(self.close_client)
        if read.check:
            check_store(self.client)

    def close_client(self) -> None:
        """Close the client :meth:`ready` built, if any (idempotent). Its locks still held
        are not released: their keys expire with their lease."""
        with self._closing:
            client, self.client = self.client, None
        if client is not None:
            client.close()
            atexit.unregister(self.close_client)


def configure_from(read: LockaspectSettings) -> LockClient | None:
    """Build the client ``read`` describes (``None`` without a URL) and configure it, with
    its policies and defaults, as lockaspect's default; :class:`ImproperlyConfigured` if
    the client cannot be built."""
    client = None
    if read.url is not None:
        try:
            client = LockClient.from_url(read.url, observers=read.observers, **read.options)
        except (ConfigurationError, TypeError, ValueError) as exc:
            raise ImproperlyConfigured(
                f'settings.LOCKASPECT["URL"] and ["OPTIONS"]: cannot build the lock client: {type(exc).__name__}: {exc}'
            ) from exc
    try:
        config.configure(client, policies=read.policies, defaults=read.defaults)
    except (ConfigurationError, KeyTemplateError, TypeError) as exc:
        if client is not None:
            client.close()
        raise ImproperlyConfigured(f"settings.LOCKASPECT: {exc}") from exc
    return client


def check_store(client: LockClient | None) -> None:
    """``client.check()`` on ``client`` (the default client if ``None``), as
    :class:`ImproperlyConfigured` naming ``settings.LOCKASPECT["CHECK"]`` when it fails."""
    try:
        (client or config.default_client()).check()
    except (ConfigurationError, BackendError) as exc:
        raise ImproperlyConfigured(
            f'settings.LOCKASPECT["CHECK"]: the lock store failed its check: {type(exc).__name__}: {exc}'
        ) from exc
