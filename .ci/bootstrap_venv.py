"""Create the project's virtualenv, even where ``python3 -m venv`` cannot install pip.

Debian's python3 ships without ``ensurepip`` unless python3-venv is installed, so a plain
``python3 -m venv`` fails on a fresh machine. Then we create the environment without pip
and install pip from its wheel on PyPI (a wheel is a zip that Python can run directly).

Usage: python3 .ci/bootstrap_venv.py .venv
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
import venv
from pathlib import Path

INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def main(target: str) -> int:
    if sys.version_info < (3, 10):
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
    with urllib.request.urlopen("https://pypi.org/pypi/pip/json", timeout=60) as response:
        release = json.load(response)
    wheel = next(f for f in release["urls"] if f["filename"].endswith(".whl"))
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / wheel["filename"]
        urllib.request.urlretrieve(wheel["url"], file)
        subprocess.check_call([str(python), f"{file}/pip", "install", "--quiet", str(file)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".venv"))
