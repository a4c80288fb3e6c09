"""Paths as users type them: ``.``, ``..``, a trailing slash (issue 18 #13), and symbolic
links that loop or dangle, resolved through one helper (issue 18 #26)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from modelsize.errors import InputError, PathNotFoundError
from modelsize.formats.base import real_path
from tests.conftest import REPO, assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``run/model.safetensors`` with a float64 tensor, so that inspect prints a fix."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("paths") / "run"
    (folder / "sub").mkdir(parents=True)
    save_file({"w": torch.ones(4, 4), "wide": torch.ones(64, dtype=torch.float64)},
              str(folder / "model.safetensors"))
    return folder


def _fix(stdout: str) -> list[str]:
    """The first printed fix, as argv (``modelsize`` left out)."""
    action = json.loads(stdout)["findings"][0]["action"]
    assert action.startswith("modelsize slim "), action
    return shlex.split(action)[1:]


# (working folder relative to run/, spelling of run/)
SPELLINGS = [(".", "."), (".", "./"), ("sub", ".."), ("sub", "../"), ("sub", "../sub/.."),
             ("..", "run/"), ("..", "run/sub/..")]


@pytest.mark.parametrize(("cwd", "given"), SPELLINGS)
def test_every_verb_takes_the_folder_however_it_is_spelled(
        run_folder: Path, tmp_path: Path, cwd: str, given: str) -> None:
    work = shutil.copytree(run_folder, tmp_path / "run")
    where = (work / cwd)
    proc = run_cli("inspect", given, "--json", cwd=where)
    assert proc.returncode == 0, proc.stderr
    fix = _fix(proc.stdout)
    assert real_path(where / fix[1]) == real_path(work)
    proc = run_cli(*fix, cwd=where)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run.slim").is_dir()
    assert sorted(p.name for p in work.iterdir()) == ["model.safetensors", "sub"]
    proc = run_cli("check", given, cwd=where)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("diff", given, str(tmp_path / "run.slim"), "--json", cwd=where)
    assert proc.returncode == 0, proc.stderr


def test_an_empty_path_is_refused(tmp_path: Path) -> None:
    proc = run_cli("inspect", "", cwd=tmp_path)
    assert proc.returncode == 2 and "empty path" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# -- symbolic links ------------------------------------------------------------------------


def test_real_path_turns_loops_and_dangling_links_into_input_errors(tmp_path: Path) -> None:
    os.symlink("self", tmp_path / "self")
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    os.symlink("nowhere", tmp_path / "dangling")
    (tmp_path / "file").write_bytes(b"x")
    os.symlink("file", tmp_path / "link")
    for name in ("self", "a", "self/x"):
        for must_exist in (True, False):
            with pytest.raises(InputError, match="symbolic link loop"):
                real_path(tmp_path / name, must_exist=must_exist)
    with pytest.raises(InputError, match="symbolic link to nowhere, which does not exist"):
        real_path(tmp_path / "dangling")
    with pytest.raises(PathNotFoundError):
        real_path(tmp_path / "missing")
    assert real_path(tmp_path / "missing", must_exist=False) == tmp_path.resolve() / "missing"
    assert real_path(tmp_path / "link") == (tmp_path / "file").resolve()


def test_saved_model_whose_data_file_links_to_itself(tmp_path: Path) -> None:
    model = shutil.copytree(REPO / "tests" / "fixtures" / "tensorflow" / "saved_model",
                            tmp_path / "sm")
    data = model / "variables" / "variables.data-00000-of-00001"
    data.unlink()
    os.symlink(data.name, data)
    for verb in ("inspect", "slim", "check"):
        proc = run_cli(verb, str(model))
        assert_one_line_error(proc, data)
        assert "symbolic link loop" in proc.stderr
    assert not (tmp_path / "sm.slim").exists()


@pytest.mark.parametrize(("target", "message"), [("loop", "symbolic link loop"),
                                                 ("nowhere", "which does not exist")])
def test_a_link_given_as_the_model(tmp_path: Path, target: str, message: str) -> None:
    os.symlink(target, tmp_path / "loop")
    proc = run_cli("inspect", "loop", cwd=tmp_path)
    assert_one_line_error(proc, "loop")
    assert message in proc.stderr


def test_no_path_is_resolved_but_through_real_path() -> None:
    """``Path.resolve()`` raises RuntimeError on a loop (Python < 3.13) and ``realpath``
    returns a path quietly: every resolution goes through ``formats.base.real_path``."""
    calls = re.compile(r"\.resolve\(|os\.path\.realpath\(|\brealpath\(")
    found = [f"{p.relative_to(REPO)}:{i}" for p in (REPO / "src").rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if calls.search(line) and p.name != "base.py"]
    assert found == []
