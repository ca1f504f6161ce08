"""lockaspect.contrib.django: ``settings.LOCKASPECT`` read and checked, the app's start-up,
its system checks, and the example project (examples/django_project) run by Django's test
runner against the session's Valkey and PostgreSQL.

Django's settings are process-wide, and tests/integration/test_postgres_xact.py configures them
in this process: so everything that needs configured settings runs in a subprocess (started
together, to keep the wall time down), and only the pure reading of the setting runs here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django")

from django.core.exceptions import ImproperlyConfigured

from lockaspect.contrib.django import LockaspectSettings, read_settings, setting_problems
from lockaspect.testing import LockServer

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "examples" / "django_project"
TIMEOUT = 60


class Made:
    """An observer class: counts how many were made."""

    made = 0

    def __init__(self) -> None:
        type(self).made += 1

    def __call__(self, event: Any) -> None:
        pass


def observe(event: Any) -> None:
    pass


# -- settings.LOCKASPECT, read in this process (no Django settings needed) ------------------


def test_a_full_setting_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCKASPECT_URL", raising=False)
    Made.made = 0
    read = read_settings(
        {
            "URL": "redis://127.0.0.1:6379/0",
            "POLICIES": {"orders.create": {"key": "order:<user.id>", "lease": 30}},
            "DEFAULTS": {"wait": 2.0},
            "OBSERVERS": [f"{__name__}.Made", observe],
            "OPTIONS": {"namespace": "shop:"},
            "CHECK": True,
        }
    )
    assert read.url == "redis://127.0.0.1:6379/0"
    assert read.policies == {"orders.create": {"key": "order:<user.id>", "lease": 30}}
    assert read.defaults == {"wait": 2.0}
    assert isinstance(read.observers[0], Made)
    assert read.observers[1] is observe
    assert read.options == {"namespace": "shop:"}
    assert read.check is True
    assert Made.made == 1


def test_nothing_set_is_nothing_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCKASPECT_URL", raising=False)
    assert read_settings(None) == read_settings({}) == LockaspectSettings()


def test_the_url_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKASPECT_URL", "redis://10.0.0.1:6379/2")
    assert read_settings({"OPTIONS": {"namespace": "x:"}}).url == "redis://10.0.0.1:6379/2"
    assert read_settings({"URL": "memory://"}).url == "memory://"


def test_checking_the_setting_makes_no_observer() -> None:
    Made.made = 0
    assert setting_problems({"URL": "memory://", "OBSERVERS": [f"{__name__}.Made"]}) == []
    assert Made.made == 0


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("redis://x", "settings.LOCKASPECT must be a dict, got str"),
        ({"URLS": "redis://x"}, "unknown key 'URLS' (did you mean 'URL'?)"),
        ({"URL": 6379}, 'settings.LOCKASPECT["URL"] must be a non-empty str'),
        ({"POLICIES": {"a": {"kee": "x"}}}, 'in settings.LOCKASPECT["POLICIES"] has unknown option(s) kee'),
        ({"POLICIES": {"a": {"lease": "30"}}}, "policy 'a' in settings.LOCKASPECT[\"POLICIES\"]: lease must be"),
        ({"POLICIES": "/nonexistent/locks.toml"}, 'settings.LOCKASPECT["POLICIES"]: cannot read lock policies'),
        ({"DEFAULTS": {"wait": -1}}, 'settings.LOCKASPECT["DEFAULTS"]'),
        ({"DEFAULTS": {"key": "k"}}, 'settings.LOCKASPECT["DEFAULTS"]'),
        ({"URL": "memory://", "OBSERVERS": ["no_such_module.Observer"]}, 'LOCKASPECT["OBSERVERS"][0]: cannot import'),
        ({"URL": "memory://", "OBSERVERS": [42]}, 'LOCKASPECT["OBSERVERS"][0] must be callable'),
        ({"URL": "memory://", "OBSERVERS": "a.b"}, 'LOCKASPECT["OBSERVERS"] must be a list'),
        ({"URL": "memory://", "OPTIONS": ["namespace"]}, 'LOCKASPECT["OPTIONS"] must be a dict'),
        ({"URL": "memory://", "OPTIONS": {"observers": []}}, 'use settings.LOCKASPECT["OBSERVERS"]'),
        ({"URL": "memory://", "CHECK": "yes"}, 'settings.LOCKASPECT["CHECK"] must be True or False'),
        ({"CHECK": True}, 'settings.LOCKASPECT["CHECK"] configure the client built from the store URL'),
    ],
)
def test_a_bad_setting_is_refused_naming_its_key(setting: Any, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCKASPECT_URL", raising=False)
    with pytest.raises(ImproperlyConfigured) as refused:
        read_settings(setting)
    assert expected in str(refused.value)
    assert any(expected in problem for problem in setting_problems(setting))


def test_every_problem_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCKASPECT_URL", raising=False)
    with pytest.raises(ImproperlyConfigured) as refused:
        read_settings({"URL": 1, "DEFAULTS": {"wait": -1}, "CHECK": "no"})
    lines = str(refused.value).splitlines()
    assert lines[0] == "settings.LOCKASPECT is invalid:"
    assert [line.split("]")[0] for line in lines[1:]] == [
        '  - settings.LOCKASPECT["URL"',
        '  - settings.LOCKASPECT["DEFAULTS"',
        '  - settings.LOCKASPECT["CHECK"',
    ]


# -- Django processes: the example project, start-up failures, the system checks ------------


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def environment(**values: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCKASPECT_URL", "LOCKASPECT_PG_URL")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(PROJECT)])
    env.update({k: v for k, v in values.items() if v is not None})
    return env


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=PROJECT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    return process.returncode, out + err


#: Run in a Django process of the example project: the system checks in the states they
#: report on, printed as JSON.
CHECKS = """
import json, django
django.setup()
from django.apps import apps
from django.test import override_settings
from lockaspect import LockClient, configure
from lockaspect.contrib.django.checks import check_settings, check_store
def ids(messages):
    return [(m.id, m.msg) for m in messages]
found = {"fine": ids(check_settings() + check_store())}
with override_settings(LOCKASPECT={"URL": 5, "DEFAULTS": {"wait": -1}}):
    found["bad"] = ids(check_settings())
configure(LockClient.from_url("redis://127.0.0.1:%d/0" % int(__import__("sys").argv[1])))
found["unreachable"] = ids(check_store())
app = apps.get_app_config("lockaspect")
built = app.client
app.close_client()
app.close_client()
found["closed"] = [built.closed, app.client is None]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def runs(lock_server: LockServer, postgres_server: Any) -> dict[str, tuple[int, str]]:
    """Every Django process this module looks at, started together and waited for."""
    port = closed_port()
    manage = [str(PROJECT / "manage.py")]
    processes = {
        "postgres": start(
            [*manage, "test", "ledger"],
            environment(LOCKASPECT_URL=lock_server.url, LOCKASPECT_PG_URL=postgres_server.url),
        ),
        "sqlite": start([*manage, "test", "ledger"], environment(LOCKASPECT_URL=lock_server.url)),
        "bad_url": start([*manage, "check"], environment(LOCKASPECT_URL="redis://127.0.0.1:notaport/0")),
        "unreachable": start([*manage, "check"], environment(LOCKASPECT_URL=f"redis://127.0.0.1:{port}/0")),
        "checks": start(
            ["-c", CHECKS, str(port)],
            environment(LOCKASPECT_URL=lock_server.url, DJANGO_SETTINGS_MODULE="shop.settings"),
        ),
    }
    return {name: finish(process) for name, process in processes.items()}


def test_the_example_project_passes_its_tests_on_postgresql(runs: dict[str, tuple[int, str]]) -> None:
    code, output = runs["postgres"]
    assert code == 0, output
    assert "Ran 10 tests" in output
    assert "\nOK\n" in output


def test_the_example_project_passes_its_tests_on_sqlite(runs: dict[str, tuple[int, str]]) -> None:
    code, output = runs["sqlite"]
    assert code == 0, output
    assert "OK (skipped=2)" in output  # the transaction-scoped lock's tests need PostgreSQL


def test_a_bad_store_url_stops_the_start_up(runs: dict[str, tuple[int, str]]) -> None:
    code, output = runs["bad_url"]
    assert code != 0
    assert "ImproperlyConfigured" in output
    assert 'settings.LOCKASPECT["URL"] and ["OPTIONS"]: cannot build the lock client' in output


def test_check_true_stops_the_start_up_on_an_unreachable_store(runs: dict[str, tuple[int, str]]) -> None:
    code, output = runs["unreachable"]
    assert code != 0
    assert 'ImproperlyConfigured: settings.LOCKASPECT["CHECK"]: the lock store failed its check' in output


def test_the_system_checks(runs: dict[str, tuple[int, str]]) -> None:
    code, output = runs["checks"]
    assert code == 0, output
    found = json.loads(output.strip().splitlines()[-1])
    assert found["fine"] == []
    assert [message_id for message_id, _ in found["bad"]] == ["lockaspect.E001", "lockaspect.E001"]
    assert 'settings.LOCKASPECT["URL"]' in found["bad"][0][1]
    assert 'settings.LOCKASPECT["DEFAULTS"]' in found["bad"][1][1]
    [(message_id, message)] = found["unreachable"]
    assert message_id == "lockaspect.E002"
    assert "the lock store failed its check" in message
    assert found["closed"] == [True, True]  # close_client() closes the app's client, twice is fine
