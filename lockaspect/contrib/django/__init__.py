"""lockaspect for Django: ``"lockaspect.contrib.django"`` in ``INSTALLED_APPS`` configures the
process-wide default client from ``settings.LOCKASPECT`` (needs the ``django`` extra).

::

    INSTALLED_APPS = [..., "lockaspect.contrib.django"]
    LOCKASPECT = {
        "URL": "redis://127.0.0.1:6379/0",            # else the LOCKASPECT_URL environment variable
        "POLICIES": {"ledger.deposit": {"key": "account:<account_id>", "lease": 30}},
        "DEFAULTS": {"wait": 2.0},                     # client-wide decorator defaults
        "OBSERVERS": ["myapp.observers.LockMetrics"],  # objects, or dotted paths (classes are called)
        "OPTIONS": {"namespace": "shop:"},             # LockClient.from_url() keyword arguments
        "CHECK": True,                                 # client.check() at start-up (the default)
    }

A bad setting stops the process at start-up with
:class:`~django.core.exceptions.ImproperlyConfigured` naming the key. See
:class:`~lockaspect.contrib.django.apps.LockaspectConfig` and ``docs/integrations/django.md``
(also the fencing pattern inside ``transaction.atomic()``).
"""

from __future__ import annotations

from ._settings import KEYS, LockaspectSettings, read_settings, setting_problems

__all__ = ["KEYS", "LockaspectSettings", "read_settings", "setting_problems"]
