"""Shared helper for benchmark scripts: each owns one section of benchmarks/RESULTS.md."""

from __future__ import annotations

import platform
import re
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
_HEADER = (
    "# Benchmark results\n\n"
    "Each section is written by the script it names; rerun the command shown to reproduce it.\n"
    "Machine for these numbers unless a section says otherwise: "
    f"{platform.machine()}, Python {platform.python_version()}.\n"
)


def write_section(name: str, markdown: str) -> None:
    """Replace (or append) the section ``name`` of RESULTS.md with ``markdown``."""
    text = RESULTS.read_text() if RESULTS.exists() else _HEADER
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
