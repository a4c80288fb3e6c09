"""``modelsize inspect PATH``: every byte of a saved model, by category."""

from __future__ import annotations

import argparse
import json
import os
import sys


def count(text: str) -> int:
    """An argparse type: a whole number, 0 or more (``--top -1`` printed "(-1 of 32)")."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Define the ``inspect`` sub-command's arguments."""
    p.add_argument("path", help="a model file, a checkpoint directory or prefix, a URL, or "
                   "ORG/REPO (a Hub repository, where no local path has that name)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--top", type=count, default=None, metavar="N",
                   help="largest tensors to list (default 10)")
    p.add_argument("--load-cost", action="store_true",
                   help="also measure the RAM and time of the usual ways to load it "
                   "(runs the real framework in a subprocess)")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="also write a self-contained HTML report with a treemap (works offline)")


def run(args: argparse.Namespace) -> int:
    """Execute ``modelsize inspect``."""
    from modelsize.inspection import inspect
    from modelsize.report.files import check_output_file

    check_output_file(args.html)
    text = str(args.path)
    if "/" in text and "://" not in text and not os.path.lexists(text):
        from modelsize.remote import hub_url

        url = hub_url(text)  # ORG/REPO, not a path here: the Hub's repository
        if url is not None:
            args.path = url
            return _remote(args)
    if "://" in str(args.path):  # modelsize.remote imports urllib, http, ssl: URLs only
        from modelsize.remote import is_remote

        if is_remote(args.path):
            return _remote(args)
    report = inspect(args.path)
    cost = None
    if args.load_cost:
        from modelsize.loadcost import measure_load_cost

        cost = measure_load_cost(report.inventory)
    if args.json:
        from modelsize.report.json_stream import dump

        data = report.to_json(top=args.top)
        if cost is not None:
            data["load_cost"] = cost.to_dict()
        dump(data, sys.stdout.write)  # the tensor list written as it is made
        sys.stdout.write("\n")
    else:
        from modelsize.report.text import render_inspect  # (textwrap: not for --json)

        sys.stdout.write(render_inspect(report, top=10 if args.top is None else args.top))
        if cost is not None:
            from modelsize.report.loadcost_text import render_load_cost

            sys.stdout.write("\n" + render_load_cost(cost))
    if args.html:
        from modelsize.report import html

        html.write(args.html, html.render_inspect(report))
    return 0


def _remote(args: argparse.Namespace) -> int:
    """``modelsize inspect URL``: headers fetched by range requests, nothing else."""
    from modelsize.errors import UsageError
    from modelsize.remote import inspect_remote

    if args.load_cost:
        raise UsageError("--load-cost needs the file on this disk: download it first")
    remote = inspect_remote(args.path)
    if args.json:
        print(json.dumps(remote.to_dict(top=args.top)))
    else:
        sys.stdout.write(remote.text(top=10 if args.top is None else args.top))
    if args.html:
        from modelsize.cli._remote import localize
        from modelsize.report import html

        html.write(args.html, localize(html.render_inspect(remote.report),
                                       {remote.local: remote.url}, as_html=True))
    return 0
