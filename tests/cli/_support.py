"""Running ``lockaspect`` as a user does: a subprocess (``python -m lockaspect``), its output
read as it comes (no sleeps), at 80 columns, with a pipe or a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

#: Upper bounds on waiting for a process: a failing test fails, it does not hang.
TIMEOUT = 30.0
COLUMNS = 80
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("LOCKASPECT_URL", "LOCKASPECT_PLAIN"):
        env.pop(name, None)
    env["COLUMNS"] = str(COLUMNS)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lockaspect", *args]


def lockaspect(
    *args: str, env: dict[str, str] | None = None, stdin: Any = subprocess.DEVNULL, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run ``lockaspect ARGS`` to its end, stdout and stderr captured."""
    return subprocess.run(
        command(*args), capture_output=True, text=True, env=env or cli_env(), stdin=stdin, timeout=timeout
    )


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``lockaspect ARGS``; read its output with :func:`read_until`."""
    return subprocess.Popen(
        command(*args),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or cli_env(),
    )


def start_python(code: str, *args: str) -> subprocess.Popen[str]:
    """A Python helper process running ``code`` (its output read with :func:`read_until`)."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )


def read_until(stream: IO[str] | None, wanted: Callable[[str], bool] | str, timeout: float = TIMEOUT) -> list[str]:
    """Lines read from ``stream`` up to and including the first that ``wanted`` accepts (a
    str: the line contains it)."""
    assert stream is not None
    accept = wanted if callable(wanted) else (lambda line: wanted in line)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        readable, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            raise AssertionError(f"no line matching {wanted!r} within {timeout}s; got {lines!r}")
        line = stream.readline()
        if not line:
            raise AssertionError(f"the stream ended before a line matching {wanted!r}; got {lines!r}")
        lines.append(line.rstrip("\n"))
        if accept(line):
            return lines


def in_terminal(args: Sequence[str], *, answer: str | None = None, columns: int = COLUMNS) -> tuple[int, str]:
    """Run ``lockaspect ARGS`` on a pseudo-terminal ``columns`` wide (stdin, stdout and
    stderr), typing ``answer`` once it asks; its exit status and its output without escapes."""
    master, replica = pty.openpty()
    fcntl.ioctl(replica, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    process = subprocess.Popen(
        command(*args), stdin=replica, stdout=replica, stderr=replica, env=cli_env(), close_fds=True
    )
    os.close(replica)
    chunks: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT
    answered = answer is None
    try:
        while True:
            readable, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                process.kill()
                raise AssertionError("no output within the timeout: " + b"".join(chunks).decode(errors="replace"))
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
            if not answered and b"[y/N]" in b"".join(chunks):
                os.write(master, answer.encode() + b"\n")  # type: ignore[union-attr]
                answered = True
        status = process.wait(timeout=TIMEOUT)
    finally:
        os.close(master)
    return status, ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r", "")


def assert_fits(text: str, columns: int = COLUMNS) -> None:
    """Every line of ``text`` is at most ``columns`` characters."""
    for line in text.splitlines():
        assert len(line) <= columns, f"{len(line)} > {columns} columns: {line!r}"


def need_owner_records(recorded: bool) -> None:
    """From here on the test checks host and pid: an xfail while the store records none
    (the ``owner_records`` fixture)."""
    if not recorded:
        import pytest

        pytest.xfail("this store does not record owners yet (the Redis owner records of issue 13)")
