"""``lockaspect demo``: the flash sale (see :mod:`lockaspect.demo`)."""

from __future__ import annotations

import argparse

__all__ = ["demo_command"]


def demo_command(args: argparse.Namespace) -> int:
    from ..demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(url=args.url, workers=args.workers, quick=args.quick, unsafe=args.unsafe, plain=args.plain)
    )
