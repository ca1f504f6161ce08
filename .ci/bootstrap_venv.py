"""Create the project's virtualenv, even where ``python3 -m venv`` cannot install pip.

Debian's python3 ships without ``ensurepip`` unless python3-venv is installed, so a plain
``python3 -m venv`` fails on a fresh machine. Then we create the environment without pip
and install pip from its wheel on PyPI (a wheel is a zip that Python can run directly).

Usage: python3 .ci/bootstrap_venv.py .venv
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import venv
from pathlib import Path

INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def main(target: str) -> int:
    if sys.version_info < (3, 10):  # noqa: UP036 - this script runs on whatever python3 there is
        print(f"lockaspect needs Python 3.10 or newer; {sys.executable} is {sys.version.split()[0]}", file=sys.stderr)
        return 1
    path = Path(target)
    python = path / "bin" / "python"
    try:
        venv.EnvBuilder(with_pip=True).create(path)
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"venv with pip failed ({exc}); creating it without pip and fetching pip from PyPI", file=sys.stderr)
        venv.EnvBuilder(with_pip=False, clear=True).create(path)
        install_pip(python)
    subprocess.check_call([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    return 0


def install_pip(python: Path) -> None:
    """Install pip from its newest wheel on the configured index (PIP_INDEX_URL, else PyPI)."""
    url = pip_wheel_url()
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / url.rsplit("/", 1)[-1].split("#", 1)[0]
        urllib.request.urlretrieve(url, file)
        subprocess.check_call([str(python), f"{file}/pip", "install", "--quiet", str(file)])


def pip_wheel_url(index: str = INDEX) -> str:
    if index == "https://pypi.org/simple":
        api = "https://pypi.org/pypi/pip/json"
        with urllib.request.urlopen(api, timeout=60) as response:
            release = json.load(response)
        wheel = next(f["url"] for f in release["urls"] if f["filename"].endswith(".whl"))
        return urllib.parse.urljoin(api, str(wheel))  # some proxies answer with relative URLs
    return simple_index_wheel_url(index)


def simple_index_wheel_url(index: str) -> str:
    """The newest pip wheel on any PEP 503 "simple" index (a mirror, a proxy)."""
    page_url = f"{index}/pip/"
    with urllib.request.urlopen(page_url, timeout=60) as response:
        page = response.read().decode("utf-8", "replace")
    links = re.findall(r'href="([^"]*pip-[0-9][^"/]*-py3-none-any\.whl[^"]*)"', page)
    if not links:
        raise SystemExit(f"no pip wheel found at {page_url}")
    return urllib.parse.urljoin(page_url, links[-1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".venv"))
