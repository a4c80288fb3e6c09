"""The CLI's error funnel: bad input gets one line on stderr and exit 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_one_line_error, run_cli


def test_missing_path(tmp_path: Path) -> None:
    p = tmp_path / "nope.pt"
    proc = run_cli("inspect", str(p))
    assert_one_line_error(proc, p)
    assert "no such file" in proc.stderr


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.pt"
    p.write_bytes(b"")
    proc = run_cli("inspect", str(p))
    assert_one_line_error(proc, p)
    assert "empty" in proc.stderr


def test_unknown_format(tmp_path: Path) -> None:
    p = tmp_path / "notes.txt"
    p.write_text("hello, this is not a model\n")
    proc = run_cli("inspect", str(p))
    assert_one_line_error(proc, p)
    assert "unrecognised format" in proc.stderr


def test_directory_without_a_model(tmp_path: Path) -> None:
    (tmp_path / "readme.md").write_text("nothing here")
    proc = run_cli("inspect", str(tmp_path))
    assert_one_line_error(proc, tmp_path)


def test_control_characters_in_names_are_escaped(tmp_path: Path) -> None:
    p = tmp_path / "evil\x1b[31mname.bin"
    p.write_bytes(b"\x00" * 3)
    proc = run_cli("inspect", str(p))
    assert proc.returncode == 2
    assert "\x1b" not in proc.stderr


def test_version_and_help() -> None:
    assert run_cli("--version").returncode == 0
    proc = run_cli("--help")
    assert proc.returncode == 0 and "inspect" in proc.stdout


@pytest.mark.parametrize("columns", ["50", "120", "junk"])
def test_help_wraps_to_the_terminal_width_as_shutil_finds_it(
        columns: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's help formatter finds the width without shutil, as shutil would."""
    import argparse
    import shutil

    from modelsize.cli import _columns, build_parser

    monkeypatch.setenv("COLUMNS", columns)
    assert _columns() == shutil.get_terminal_size().columns
    parser = build_parser(["inspect"])
    with pytest.raises(SystemExit):
        parser.parse_args(["inspect", "--help"])
    ours = capsys.readouterr().out
    monkeypatch.setattr(argparse.ArgumentParser, "_get_formatter",
                        lambda self: argparse.HelpFormatter(prog=self.prog))
    with pytest.raises(SystemExit):
        build_parser(["inspect"]).parse_args(["inspect", "--help"])
    assert capsys.readouterr().out == ours
    assert max(map(len, ours.splitlines())) <= max(_columns(), 60)


def test_negative_top_is_refused(tmp_path: Path) -> None:
    """``inspect --top -1`` printed "(-1 of 32)" (issue 18, smaller ones)."""
    np = pytest.importorskip("numpy")
    p = tmp_path / "a.npy"
    np.save(p, np.zeros(4, dtype=np.float32))
    for bad, why in (("-1", "must be 0 or more, got -1"), ("x", "expected a whole number")):
        proc = run_cli("inspect", str(p), "--top", bad)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.splitlines() == [
            f"modelsize inspect: argument --top: {why}" + (f", got {bad!r}" if bad == "x" else "")
            + " (see modelsize inspect --help)"]
        assert proc.stdout == ""
    proc = run_cli("inspect", str(p), "--top", "0")
    assert proc.returncode == 0, proc.stderr
    assert "-1 of" not in proc.stdout
