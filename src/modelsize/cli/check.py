"""``modelsize check PATH...``: exit 1 when a model file breaks the team's rules (for CI)."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Define the ``check`` sub-command's arguments."""
    from modelsize.checking import DEFAULT_FORBID

    p.add_argument("paths", nargs="+", metavar="PATH", help="model files (or checkpoint "
                   "directories) to check")
    p.add_argument("--max-size", default=None, metavar="SIZE",
                   help="largest allowed size of each file (e.g. 500MB, 2GiB)")
    p.add_argument("--forbid", default=",".join(k.value for k in DEFAULT_FORBID),
                   metavar="KINDS",
                   help="comma-separated findings that fail the check (default: %(default)s; "
                   "also ema, wide_dtype; 'none' for none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Execute ``modelsize check``: 0 when every file passes, 1 when one breaks a rule."""
    from modelsize.checking import check, parse_forbid, parse_max_size
    from modelsize.cli._remote import hub_or_path

    max_size = parse_max_size(args.max_size, "--max-size")
    forbid = parse_forbid(args.forbid)
    results = [check(hub_or_path(p), max_size=max_size, forbid=forbid) for p in args.paths]
    failed = [r for r in results if not r.ok]
    if args.json:
        print(json.dumps({"ok": not failed, "files": [r.to_dict() for r in results]}))
    else:
        for r in failed:
            for line in r.lines():
                print(line)
        n = sum(len(r.violations) for r in results)
        files = f"{len(results)} file{'s' if len(results) != 1 else ''}"
        print(f"modelsize check: {files}, "
              + (f"{n} violation{'s' if n != 1 else ''} in {len(failed)}" if n else "all pass"),
              file=sys.stderr if not n else sys.stdout)
    return 1 if failed else 0
