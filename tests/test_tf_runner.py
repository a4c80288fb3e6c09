"""The test workers' TensorFlow process (tests/tf_runner.py) runs a snippet as
``python -c CODE ARGS`` would: checked here with this venv's Python (no TensorFlow needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tf_runner

ENV = {"PATH": "/usr/bin:/bin"}


@pytest.fixture
def runner() -> Iterator[tf_runner.Runner]:
    r = tf_runner.Runner(sys.executable, ENV)
    yield r
    r.close()


def test_a_snippet_sees_what_python_c_gives_it(runner: tf_runner.Runner, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    code = "import os, sys; print(__name__, sys.argv, os.getcwd()); x = 1"
    monkeypatch.chdir(tmp_path)
    fresh = subprocess.run([sys.executable, "-c", code, "a", "b c"], capture_output=True,
                           text=True, env=ENV)
    got = runner.run(code, ("a", "b c"), 30)
    assert (got.returncode, got.stdout, got.stderr) == (0, fresh.stdout, "")
    # fresh globals each time, the same process
    again = runner.run("print('x' in globals(), __import__('os').getpid())", (), 30)
    pid = runner.proc.pid if runner.proc else None
    assert again.stdout == f"False {pid}\n"


@pytest.mark.parametrize(("code", "rc", "stderr"), [
    ("import sys; sys.exit(3)", 3, ""),
    ("import sys; sys.exit('no')", 1, "no\n"),
    ("raise ValueError('bad')", 1, "ValueError: bad"),
    ("import sys; print('e', file=sys.stderr); sys.exit()", 0, "e\n"),
])
def test_exit_codes_and_errors(runner: tf_runner.Runner, code: str, rc: int,
                               stderr: str) -> None:
    got = runner.run(code, (), 30)
    assert got.returncode == rc
    assert stderr in got.stderr
    assert runner.run("print(1)", (), 30).stdout == "1\n"  # the runner goes on


def test_a_crash_or_a_hang_ends_the_runner_and_the_next_snippet_gets_a_new_one(
        runner: tf_runner.Runner) -> None:
    first = runner.run("import os; print(os.getpid())", (), 30).stdout
    crashed = runner.run("import os; os._exit(9)", (), 30)
    assert crashed.returncode != 0
    second = runner.run("import os; print(os.getpid())", (), 30).stdout
    assert first != second
    with pytest.raises(subprocess.TimeoutExpired):
        runner.run("import time; time.sleep(30)", (), 0.5)
    assert runner.run("print(2)", (), 30).stdout == "2\n"


def test_output_written_to_the_real_descriptors_does_not_break_the_replies(
        runner: tf_runner.Runner) -> None:
    got = runner.run("import os; os.write(1, b'raw\\n'); os.write(2, b'raw\\n'); print('ok')",
                     (), 30)
    assert (got.returncode, got.stdout) == (0, "ok\n")


def test_fresh_interpreters_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELSIZE_TF_FRESH", "1")
    a = tf_runner.run(sys.executable, ENV, "import os; print(os.getpid())", (), 30)
    b = tf_runner.run(sys.executable, ENV, "import os; print(os.getpid())", (), 30)
    assert a.stdout != b.stdout and os.getpid() != int(a.stdout)
