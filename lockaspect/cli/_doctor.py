"""``lockaspect doctor``: print :func:`lockaspect.doctor.diagnose`'s verdicts, one per line."""

from __future__ import annotations

import argparse
import logging
import textwrap

from ._common import Output, command, store_errors, store_url
from ._table import Column, plain_lines, rich_table

__all__ = ["doctor_command"]

_STYLE = {"ok": "green", "warn": "yellow", "error": "bold red", "info": "dim"}
_COLUMNS = (
    Column("VERDICT", min_width=7, value_styles=tuple(_STYLE.items())),
    Column("CHECK", flexible=True, min_width=10),
    Column("DETAIL", flexible=True, min_width=20, wrap=True),
)


@command("doctor")
def doctor_command(args: argparse.Namespace) -> int:
    from ..doctor import diagnose

    out = Output(args)
    url = store_url(args)
    # kazoo logs every failed connection attempt; the "reachable" line says it once.
    logging.getLogger("kazoo").setLevel(logging.CRITICAL)
    with store_errors():
        report = diagnose(url, args.namespace, args.wait_replicas)
    if out.json:
        out.emit_json(report.to_dict())
        return report.status
    for where, checks in report.sections:
        rows = [[check.verdict, check.name, check.detail] for check in checks]
        if out.rich:
            out.console.print(rich_table(_COLUMNS, rows, out.width, title=where))
        else:
            out.line(where)
            print("\n".join(plain_lines(_COLUMNS, rows, out.width)), file=out.stream)
        out.line()
    if report.acl_rule is not None:
        out.line("The ACL rule lockaspect needs (one line; on every node of a cluster):")
        for line in textwrap.wrap(report.acl_rule, max(20, out.width - 2), break_on_hyphens=False):
            out.line("  " + line)
        out.line()
    counts = {verdict: sum(1 for c in report.checks if c.verdict == verdict) for verdict in _STYLE}
    tally = ", ".join(f"{n} {verdict}" for verdict, n in counts.items() if n)
    meaning = {0: "all well", 1: "warnings", 2: "errors"}[report.status]
    out.line(f"{tally}: exit status {report.status} ({meaning})")
    return report.status
