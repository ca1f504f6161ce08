"""Make sure a ZooKeeper server (Debian's jars and a JRE) exists for the test suite.

Uses the searches of ``lockaspect.testing.find_zookeeper_classpath`` and ``find_java``.
When either finds nothing: as root with apt-get, install Debian's ``libzookeeper-java`` and
``default-jre-headless`` (``apt-get update`` only if the install fails). There is no pip
fallback: otherwise it prints why it cannot and exits 0, and the ZooKeeper tests skip
(``LOCKASPECT_REQUIRE_ZOOKEEPER=1`` turns those skips into failures).

Usage: .venv/bin/python .ci/ensure_zookeeper.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from lockaspect.testing import find_java, find_zookeeper_classpath

PACKAGES = ["libzookeeper-java", "default-jre-headless"]


def found() -> tuple[str, str] | None:
    try:
        return find_java(), find_zookeeper_classpath()
    except FileNotFoundError:
        return None


def missing() -> str:
    reasons = []
    for find in (find_java, find_zookeeper_classpath):
        try:
            find()
        except FileNotFoundError as exc:
            reasons.append(str(exc))
    return "; ".join(reasons)


def apt_install() -> bool:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env).returncode == 0:
        return True
    if subprocess.run(["apt-get", "update"], env=env).returncode != 0:
        return False
    return subprocess.run(install, env=env).returncode == 0


def main() -> int:
    result = found()
    if result is None:
        if os.geteuid() != 0:
            print(f"not root, so cannot install ZooKeeper ({missing()}); the ZooKeeper tests will be skipped")
            return 0
        if not shutil.which("apt-get"):
            print(f"no apt-get, so cannot install ZooKeeper ({missing()}); the ZooKeeper tests will be skipped")
            return 0
        if apt_install():
            result = found()
    if result is None:
        print(f"installing ZooKeeper failed ({missing()}); the ZooKeeper tests will be skipped")
        return 0
    java, classpath = result
    print(f"ZooKeeper: java {java}, classpath {classpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
