"""URLs on the command line: ``slim URL`` and ``diff URL PATH`` (``inspect URL`` and
``check URL`` go through :mod:`modelsize.remote` directly); a plain ``ORG/REPO`` that names
nothing on this disk is the Hub's repository for ``check`` and ``diff`` as for ``inspect``.

A remote file is read from a local copy (header regions mirrored sparsely for ``diff``, the
whole file downloaded for ``slim``) whose temporary path the reports would name: every report
leaves here with the URL in its place. ``slim URL`` writes its default output into the current
folder, under the name it would have beside the file, so that the fix ``inspect URL`` prints
(``modelsize slim URL ... -o x.slim.pt``) runs as printed.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelsize.errors import UsageError, printable


def localize(text: str, subs: dict[str, str], *, as_json: bool = False,
             as_html: bool = False) -> str:
    """``text`` with each temporary local path in ``subs`` replaced by its URL (escaped the
    way the text escapes strings: JSON or HTML)."""
    for local, url in subs.items():
        if as_json:
            local, url = json.dumps(local)[1:-1], json.dumps(url)[1:-1]
        elif as_html:
            local, url = html.escape(local), html.escape(url)
        text = text.replace(local, url)
    return text


def _localize_page(path: str | None, subs: dict[str, str]) -> None:
    if path and subs:
        from modelsize.report.files import write_text

        page = Path(path).read_text(encoding="utf-8")
        write_text(path, localize(page, subs, as_html=True))


def hub_or_path(text: str) -> str:
    """``hf://ORG/REPO`` for a plain ``ORG/REPO[@REVISION]`` that names nothing on this disk
    (as ``inspect`` reads it: :func:`modelsize.remote.hub_url`), else ``text`` itself."""
    if "/" not in text or "://" in text or os.path.lexists(text):
        return text
    from modelsize.remote import hub_url

    return hub_url(text) or text


def _url(text: str) -> str:
    from modelsize.remote import is_remote

    if not is_remote(text):
        raise UsageError(f"{printable(text)}: not a URL modelsize reads (http://, https://, "
                         "hf://, or an fsspec protocol such as s3://); for a local file give "
                         "its path")
    return text


def inventory_or_path(path: str, subs: dict[str, str]) -> Any:
    """``path`` itself, or for a URL its inventory (headers only, :func:`read_remote`), the
    mirror's path recorded in ``subs``."""
    if "://" not in path:
        return path
    from modelsize.remote import read_remote

    inventory, _stats, local = read_remote(_url(path))
    subs[local] = path
    return inventory


def diff_note(subs: dict[str, str]) -> str:
    """The line a diff with a remote side ends with."""
    return "".join(f"\n{printable(url)} read remotely by its headers: duplicate tensors "
                   "compared by samples of their bytes, not whole\n" for url in subs.values())


def slim_url(args: argparse.Namespace, run: Callable[[argparse.Namespace], int]) -> int:
    """``modelsize slim URL``: the file is downloaded (:func:`modelsize.remote.downloaded`)
    into a hidden folder beside OUT, slimmed as a local file by ``run`` and the folder
    removed; OUT defaults to the current folder; reports name the URL."""
    from modelsize.remote import downloaded

    url = _url(args.path)
    near = Path(args.out).parent if args.out else Path(".")
    with downloaded(url, near) as remote:
        local = str(remote.local)
        args.path = local
        if args.out is None:
            args.out = _default_out(args, run, local)
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            code = run(args)
        subs = {local: url}
        sys.stdout.write(localize(captured.getvalue(), subs, as_json=args.json))
        _localize_page(args.html, subs)
    return code


def _default_out(args: argparse.Namespace, run: Callable[[argparse.Namespace], int],
                 local: str) -> str:
    """The name slim would give the output beside the local copy (a dry run of the same
    command asks the writer), in the current folder."""
    from modelsize.findings import slim_target

    probe = argparse.Namespace(**{**vars(args), "dry_run": True, "json": True, "html": None,
                                  "out": None})
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        run(probe)
    try:
        return Path(json.loads(captured.getvalue())["output"]).name
    except (ValueError, KeyError, TypeError):
        return slim_target(Path(local)).name
