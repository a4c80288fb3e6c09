"""``modelsize diff A B``: two checkpoints side by side."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Define the ``diff`` sub-command's arguments."""
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="also write a self-contained HTML report (works offline)")


def run(args: argparse.Namespace) -> int:
    """Execute ``modelsize diff``."""
    from modelsize.cli._remote import hub_or_path
    from modelsize.diff import diff
    from modelsize.report.diff_text import render_diff
    from modelsize.report.files import check_output_file

    check_output_file(args.html)
    a: Any = hub_or_path(args.a)  # ORG/REPO naming nothing here: the Hub's repository
    b: Any = hub_or_path(args.b)
    subs: dict[str, str] = {}  # a URL's temporary mirror -> the URL
    if "://" in a or "://" in b:  # URLs: read by their headers, named in place of the mirrors
        from modelsize.cli._remote import diff_note, inventory_or_path, localize

        a, b = inventory_or_path(a, subs), inventory_or_path(b, subs)
    result = diff(a, b)
    if args.json:
        text = json.dumps(result.to_dict(), indent=2) + "\n"
        sys.stdout.write(localize(text, subs, as_json=True) if subs else text)
    else:
        text = render_diff(result)
        sys.stdout.write(localize(text, subs) + diff_note(subs) if subs else text)
    if args.html:
        from modelsize.report import html

        page = html.render_diff(result)
        html.write(args.html, localize(page, subs, as_html=True) if subs else page)
    return 0
