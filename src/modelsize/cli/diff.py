"""``modelsize diff A B``: two checkpoints side by side."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Define the ``diff`` sub-command's arguments."""
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="also write a self-contained HTML report (works offline)")


def run(args: argparse.Namespace) -> int:
    """Execute ``modelsize diff``."""
    from modelsize.diff import diff
    from modelsize.report.diff_text import render_diff
    from modelsize.report.files import check_output_file

    check_output_file(args.html)
    result = diff(args.a, args.b)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        sys.stdout.write(render_diff(result))
    if args.html:
        from modelsize.report import html

        html.write(args.html, html.render_diff(result))
    return 0
