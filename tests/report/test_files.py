"""``--html FILE`` is checked before the work and written whole (issue 18 #19)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from modelsize.errors import InputError, UsageError
from modelsize.report.files import check_output_file, write_text
from tests.conftest import assert_one_line_error, run_cli

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("html") / "m.pt"
    torch.save({"model": {"w": torch.ones(8)}, "optimizer": {
        "state": {0: {"exp_avg": torch.ones(8)}}, "param_groups": [{"params": [0]}]}}, path)
    return path


@pytest.mark.parametrize("verb", ["inspect", "slim", "diff", "estimate"])
def test_a_missing_folder_is_one_line_before_the_work(model: Path, tmp_path: Path,
                                                      verb: str) -> None:
    """The report was printed, then 'internal error: FileNotFoundError'."""
    args = {"inspect": ["inspect", str(model)],
            "slim": ["slim", str(model), "-o", str(tmp_path / "out.pt")],
            "diff": ["diff", str(model), str(model)],
            "estimate": ["estimate", "seed-cnn", "--batch", "2", "--device", "cpu"]}[verb]
    page = tmp_path / "missing" / "report.html"
    proc = run_cli(*args, "--html", str(page))
    assert_one_line_error(proc, page)
    assert "folder" in proc.stderr and "does not exist" in proc.stderr
    assert proc.stdout == ""  # refused before the work, not after the report
    assert not (tmp_path / "out.pt").exists()


def test_the_page_is_written_when_the_folder_is_there(model: Path, tmp_path: Path) -> None:
    proc = run_cli("inspect", str(model), "--html", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r.html").read_text().lower().startswith("<!doctype html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


def test_check_output_file(tmp_path: Path) -> None:
    check_output_file(None)
    check_output_file(tmp_path / "new.html")
    (tmp_path / "old.html").write_text("x")
    check_output_file(tmp_path / "old.html")
    check_output_file("/dev/null")
    (tmp_path / "file").write_text("x")
    for bad, why in [(tmp_path, "is a folder"), ("", "empty path"),
                     (tmp_path / "no" / "r.html", "does not exist"),
                     (tmp_path / "file" / "r.html", "cannot write there")]:
        with pytest.raises(UsageError, match=why) as exc:
            check_output_file(bad)
        assert "\n" not in str(exc.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    try:
        with pytest.raises(UsageError, match="cannot write into folder"):
            check_output_file(folder / "r.html")
    finally:
        folder.chmod(0o700)


def test_a_failure_at_write_time_is_one_line_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InputError, match="cannot write"):
        write_text(tmp_path / "gone" / "r.html", "<p>")

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    (tmp_path / "r.html").write_text("old page")
    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(InputError, match="No space left on device") as exc:
        write_text(tmp_path / "r.html", "<p>new page</p>")
    assert "\n" not in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]
    assert (tmp_path / "r.html").read_text() == "old page"
