"""Shared test helpers: where the real third-party fixtures live, and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Bytecode written and reused, whatever the machine's PYTHONDONTWRITEBYTECODE says: without it
# every CLI subprocess of the suite compiles modelsize's modules again, and every worker
# rewrites and compiles every test module again on every run (7 s of collection a worker).
# Set before modelsize is imported, and for the workers and subprocesses started after.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import pytest  # noqa: E402

from modelsize.inventory import Inventory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Kernel probes' answers (modelsize.estimation.probe_cache) go to a folder of this run, shared
# by its CLI subprocesses, never to the user's cache.
os.environ.setdefault("MODELSIZE_CACHE_DIR", tempfile.mkdtemp(prefix="modelsize-test-cache-"))
#: Real files we cannot make here (Lua Torch .t7, exploit pickles). CI has shared/ beside the clone.
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"


def shared_fixture(*parts: str) -> Path:
    """Path under ../shared/fixtures, or skip the test when that folder is absent."""
    path = SHARED_FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (shared fixtures live beside the clone)")
    return path


def nbytes(*tensors: Any) -> int:
    """Bytes of real tensors, from ``numel * element_size`` (independent of modelsize)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def by_cat(inv: Inventory) -> dict[str, int]:
    """An inventory's bytes by category, keyed by the category's string value."""
    return {c.value: n for c, n in inv.bytes_by_category.items()}


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m modelsize ARGS`` in a subprocess and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "modelsize", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )


def cli_json(*args: str) -> dict[str, Any]:
    """Run the CLI with ``--json`` appended, assert exit 0, and parse stdout."""
    proc = run_cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], path: Path | str) -> None:
    """Bad input: exit 2, exactly one line on stderr naming the file, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert Path(path).name in lines[0], lines[0]


def tf_python() -> str:
    """The Python of the second venv that holds TensorFlow (and Keras), or skip the test.

    ``.ci/run`` builds it as ``.venv-tf`` and exports ``MODELSIZE_TF_PYTHON``; TensorFlow is
    never installed into the main test venv.
    """
    import os

    candidates = [os.environ.get("MODELSIZE_TF_PYTHON", ""), str(REPO / ".venv-tf/bin/python")]
    for c in candidates:
        if c and Path(c).is_file():
            return c
    pytest.skip("no TensorFlow venv (set MODELSIZE_TF_PYTHON or build .venv-tf as .ci/run does)")
    raise AssertionError("unreachable")


def run_printed_in_tf(command: str, cwd: Path,
                      timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """Run a ``modelsize ...`` command line as printed, with the TensorFlow venv's Python
    and this checkout's source (skips when there is no TF venv); its exit code is not
    checked."""
    import shlex

    argv = shlex.split(command)
    assert argv[0] == "modelsize", command
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'src')!r}); "
            "from modelsize.cli import main; sys.exit(main())")
    return subprocess.run(
        [tf_python(), "-c", code, *argv[1:]], capture_output=True, text=True, cwd=cwd,
        timeout=timeout, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin",
                              "HOME": tempfile.gettempdir()})


def run_in_tf(code: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with the TensorFlow venv's Python (skips when there is none), as
    ``python -c code args`` would, in this worker's TensorFlow process
    (:mod:`tests.tf_runner`: TensorFlow imported once, not once per snippet)."""
    from tests import tf_runner

    proc = tf_runner.run(
        tf_python(), {"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin",
                      "HOME": tempfile.gettempdir()},  # Keras writes ~/.keras/keras.json
        code, args, timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="session", autouse=True)
def _tf_runners() -> Any:
    """The workers' TensorFlow processes end with the session."""
    yield
    from tests import tf_runner

    tf_runner.close_all()


@pytest.fixture(autouse=True)
def _frozen_heap() -> None:
    """What is alive when a test starts (torch, transformers and their lazily imported
    modules: hundreds of thousands of objects) moved out of the cycle collector's sight:
    every ``gc.collect()`` of a test or a trace would otherwise walk it again (0.13-0.2 s
    each, 10 s of the generate tests). The previous test's garbage is collected first, so
    only what lives on is frozen (a module's fixtures that die later in a cycle stay:
    small)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture
def preads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every ``os.pread`` from now on, in order (the test's reads of a file)."""
    sizes: list[int] = []
    real = os.pread

    def counted(fd: int, n: int, at: int) -> bytes:
        sizes.append(n)
        return real(fd, n, at)

    monkeypatch.setattr(os, "pread", counted)
    return sizes
