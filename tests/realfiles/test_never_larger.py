"""``modelsize slim FILE`` (the defaults, graph passes on, as the CLI runs it) never writes a
larger file than it was given, on every file of the real-file corpus (issue 18 item 8: a legacy
torch file, a pickled module and others grew by up to 40 kB, exit 0).

A file slim cannot write (a TFLite model, a SavedModel without TensorFlow) is left out; every
other output is at most its input's size, and a byte-for-byte copy when slim says there was
nothing to slim. Skips without the corpus cache (``tests/realfiles/fetch.py``).
"""

from __future__ import annotations

import filecmp
from pathlib import Path
from typing import Any

import pytest

import modelsize
from modelsize.errors import MissingDependencyError, UsageError
from tests.realfiles.fetch import CORPUS, ModelFile, Wheel, cache_dir


def _params() -> list[Any]:
    return [pytest.param(w, mf, id=f"{w.package}/{mf.name}") for w in CORPUS for mf in w.files]


def _on_disk(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


@pytest.mark.parametrize(("wheel", "mf"), _params())
def test_default_slim_is_never_larger(wheel: Wheel, mf: ModelFile, tmp_path: Path) -> None:
    path = cache_dir() / "files" / wheel.folder / mf.member.rstrip("/")
    if not path.exists():
        pytest.skip(f"{path} not fetched (run tests/realfiles/fetch.py)")
    try:
        report = modelsize.slim(path, graph=True, dry_run=True)
    except (MissingDependencyError, UsageError) as exc:
        pytest.skip(f"slim does not write this file here: {exc}")
    out = tmp_path / report.target.name
    report = modelsize.slim(path, out, graph=True)
    assert report.verified
    assert _on_disk(out) <= _on_disk(path), report.notes
    if report.copied:
        assert path.is_dir() or filecmp.cmp(path, out, shallow=False)
